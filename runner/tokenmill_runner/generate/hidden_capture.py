"""The hidden-state pass: for every committed sample, the target's aux states of exactly prompt ids + output ids.

After the generation stream, each committed row of this worker's share (store/work_split.py) without a committed
state file is sent as a capture request (facts/hidden_states.capture_request: full prefill, no cached prefix) through
the stream's client (client.py: every live replica, least loaded first, retries for overload, dropped connections
and dead replicas, the outage wait), its answer checked (the token ids the server echoes equal the row's, one state
row per token) and committed by store/hidden_states.py. A capture is recorded as failed only when the client gives
it up; a resume captures only what has no marker, and leaves a recorded failure to --retry-failed (counted apart:
`failed_before`, never as committed). At most `concurrency` answers are held at once, each parsed without building
Python floats (one sample's states, never a shard's). With a fence
(the generation stream's, store/shards.Fence) every marker and failure record proves the output's lease first; once
it cannot, the pass sends nothing more, drops what is in flight and raises LeaseLost (the CLI exits 6).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..facts.hidden_states import CAPTURE_CONCURRENCY, StateShape, capture_request
from ..store.capture_progress import CaptureCounts, ProgressBeat
from ..store.hidden_states import (
    AUX,
    StateKind,
    captured_keys,
    clean_state_leftovers,
    clear_failure,
    commit_states,
    committed_samples,
    failed_keys,
    record_failure,
)
from ..store.lease import LeaseLost
from ..store.shards import Fence, new_run_token
from ..store.storage import Storage
from ..store.work_split import WHOLE, WorkShare
from .client import GenerateClient, ServerFatalError
from .results import AttemptFailed, Fault, GenerationFailure, ServersUnavailable, aborted

logger = logging.getLogger(__name__)

_FIELD = b'"hidden_states":'
# The characters a JSON list of numbers is made of; the first other one ends the value (a NaN served as null, too).
_NOT_NUMERIC = re.compile(rb"[^0-9eE+\-.,\[\]\s]")
# JSON text per state value is at most this long (orjson's shortest float repr plus a comma).
_MAX_CHARS_PER_VALUE = 26


class CaptureError(ValueError):
    """An answer that cannot be stored as the sample's states; the message names the sample and what differs, and
    `fault` whose it is (client.py's rules: SAMPLE is retried and charged to the sample, FINAL is recorded now)."""

    def __init__(self, message: str, fault: Fault = Fault.FINAL) -> None:
        super().__init__(message)
        self.fault = fault


@dataclass
class CaptureSummary(CaptureCounts):
    """A pass's counts (what its progress objects carry) with the kind and the failures' messages."""

    kind: str = "aux"
    failures: list[str] = field(default_factory=list)


def _aborted(rest: Any, where: str) -> None:
    """An answer SGLang aborted (finish_reason abort: a retraction, a server stopping) is classified like the
    stream's (results.aborted): by its status when it has one."""
    meta = rest.get("meta_info") if isinstance(rest, dict) else None
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(finish, dict) and finish.get("type") == "abort":
        failed = aborted(finish, where)
        raise CaptureError(failed.message, failed.fault)


def parse_states(body: bytes, sequence: list[int], shape: StateShape, where: str) -> np.ndarray:
    """The states of `sequence` from a /generate answer, as float64 [tokens * layers * hidden].

    The answer's hidden_states entries are the prefill chunks (2-D) and then decoded rows (1-D): the first
    tokens * row_values numbers are the prefill's, as long as every chunk survived the finished_len cut."""
    start = body.find(_FIELD)
    if start < 0:
        try:
            _aborted(orjson.loads(body), where)
        except orjson.JSONDecodeError:
            raise CaptureError(f"{where}: the answer is not JSON", Fault.SAMPLE) from None
        raise CaptureError(f"{where}: the answer has no meta_info.hidden_states (is the server started with "
                           "--enable-return-aux-hidden-states, or --enable-return-hidden-states for the final "
                           "state?)")
    value_start = start + len(_FIELD)
    end_match = _NOT_NUMERIC.search(body, value_start)
    value_end = end_match.start() if end_match else len(body)
    if body[value_end:value_end + 4] == b"null":
        raise CaptureError(f"{where}: a state value is null (NaN or inf served)", Fault.SAMPLE)
    value_end = value_start + len(body[value_start:value_end].rstrip(b", \t\r\n"))
    try:
        rest = orjson.loads(body[:value_start] + b"null" + body[value_end:])
    except orjson.JSONDecodeError:
        raise CaptureError(f"{where}: the answer is not JSON", Fault.SAMPLE) from None
    _aborted(rest, where)
    reported = rest.get("prompt_token_ids") if isinstance(rest, dict) else None
    if reported is None and isinstance(rest, dict):
        reported = [entry[1] for entry in rest.get("meta_info", {}).get("input_token_logprobs") or []] or None
    if reported != sequence:
        raise CaptureError(f"{where}: the server reports {len(reported or [])} token ids that differ from the row's "
                           f"{len(sequence)} prompt + output ids; the states would not belong to the row")
    text = body[value_start:value_end].translate(None, b"[]").strip().strip(b",")
    # numpy's text parser reads the numbers without building a Python object per value (memory: the float64s only).
    values = np.fromstring(text, dtype=np.float64, sep=",") if text else np.zeros(0)
    wanted = len(sequence) * shape.row_values
    if values.size < wanted or values.size % shape.row_values:
        # Another attempt (on another replica, the prefix gone from the cache) can answer whole.
        raise CaptureError(f"{where}: {values.size // max(1, shape.row_values)} state rows of "
                           f"{shape.row_values} values for {len(sequence)} tokens (a prefix served from the cache, "
                           "or prefill chunks cut by finished_len)", Fault.SAMPLE)
    return values[:wanted]


def _sequence(row: dict[str, Any]) -> list[int]:
    if "turns" in row:  # a multi-turn sample: the last turn holds the whole conversation's ids
        last = row["turns"][-1]
        return list(last["prompt_ids"]) + list(last["output_ids"])
    return list(row["prompt_ids"]) + list(row["output_ids"])


async def capture_dataset(storage: Storage, dataset: str, servers: GenerateClient | str, shape: StateShape, *,
                          api_key: str | None = None, chunked_prefill_tokens: int = 8192,
                          concurrency: int = CAPTURE_CONCURRENCY,
                          retry_failed: bool = False, spool: Path | None = None,
                          timeout_s: float = 600.0, share: WorkShare = WHOLE,
                          fence: Fence | None = None, kind: StateKind = AUX,
                          beat: ProgressBeat | None = None) -> CaptureSummary:
    """Capture the states of every committed row of `dataset` in `share` (store/work_split.py: the workers split
    the pass as they split the stream, by the current worker count) that has none committed. `servers` is the
    stream's client (every live replica, its retries, the outage wait), or one URL for a client of its own (`api_key`
    and `timeout_s` are then its). A capture's failure is recorded only when the client gives it up (what no retry
    fixes); a resume leaves recorded failures alone (`failed_before`) unless `retry_failed`. Raises LeaseLost when
    `fence` can no longer prove the lease (nothing is committed after that) and the client's ServersUnavailable past
    the outage budget (nothing is written off). `beat` gets the counts as they move (store/capture_progress.py:
    what the operator shows while the pass runs)."""
    if isinstance(servers, str):
        own = GenerateClient([servers], api_key=api_key, concurrency=concurrency, timeout_s=timeout_s,
                             prefix_affine=False)
        try:
            return await capture_dataset(storage, dataset, own, shape, chunked_prefill_tokens=chunked_prefill_tokens,
                                         concurrency=concurrency, retry_failed=retry_failed, spool=spool,
                                         share=share, fence=fence, kind=kind, beat=beat)
        finally:
            await own.aclose()
    client = servers
    summary = CaptureSummary()
    stopped: list[BaseException] = []
    fence = fence or Fence.unleased(new_run_token())  # without a lease, this call is a writer of its own
    if share.index == 0:  # one worker of the pass removes what killed or taken-over writers left unmarked
        await asyncio.to_thread(clean_state_leftovers, storage, dataset, kind, fence)
    done = captured_keys(storage, dataset, kind)
    failed = failed_keys(storage, dataset, kind)
    limit = asyncio.Semaphore(concurrency)
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    # SGLang refuses a rid already in flight ("Duplicate request ID detected"), so a second writer of the same run
    # (or a retry while the first request is still running) needs its own.
    writer = secrets.token_hex(4)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def heartbeat(final: bool = False) -> None:
        if beat is not None and (document := beat.due(summary, final)) is not None:
            await loop.run_in_executor(pool, beat.write, document)

    def stop(error: BaseException) -> None:
        # The lease lost, the servers gone past the outage budget, a wrong key: what is in flight could only be
        # refused at its marker or fail again, so the server's time is not spent on it.
        stopped.append(error)
        for task in tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def one(row: dict[str, Any], key: str) -> None:
        sequence = _sequence(row)
        where = f"dataset {dataset!r} sample {row['sample_id']!r} (index {row.get('sample_index', 0)})"
        rid = f"hs-{kind.name}-{key}-{writer}"
        bound = len(sequence) * shape.row_values * _MAX_CHARS_PER_VALUE + (1 << 20) + 64 * len(sequence)

        def body(attempt: int, server: str) -> bytes:
            return orjson.dumps(capture_request(sequence, f"{rid}-{attempt}", chunked_prefill_tokens))

        async def read(server: str, data: bytes, attempt: int) -> np.ndarray | AttemptFailed:
            try:
                return await loop.run_in_executor(pool, parse_states, data, sequence, shape, f"{server}: {where}")
            except CaptureError as error:
                return AttemptFailed(error.fault, "capture_failed", str(error))

        try:
            result = await client.send(body, read, limit_bytes=bound)
            if isinstance(result, GenerationFailure):
                await loop.run_in_executor(pool, _record, storage, dataset, row, result.message, fence, kind)
                summary.failed += 1
                summary.failures.append(f"{where}: {result.message}")
                logger.warning("hidden-state capture failed: %s: %s", where, result.message)
            else:
                # In the pool: the fence may wait for a late renewal, which must not stall the other answers.
                await loop.run_in_executor(
                    pool, lambda: commit_states(storage, dataset, row["sample_id"], row.get("sample_index", 0),
                                                sequence, result, shape, fence, spool, kind))
                del result
                if key in failed:
                    await loop.run_in_executor(pool, clear_failure, storage, dataset, key, fence, kind)
                summary.captured += 1
                summary.state_bytes += shape.state_bytes(len(sequence))
        except (LeaseLost, ServersUnavailable, ServerFatalError) as error:
            stop(error)
            return
        finally:
            limit.release()
        await heartbeat()  # not in `finally`: a cancelled task writes nothing

    try:
        for key, row in committed_samples(storage, dataset, share):
            if stopped:
                break
            if key in done:
                summary.skipped += 1
                await heartbeat()
                continue
            if key in failed and not retry_failed:
                summary.failed_before += 1
                await heartbeat()
                continue
            await limit.acquire()
            if stopped:
                limit.release()
                break
            task = asyncio.create_task(one(row, key))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await heartbeat(final=True)
        if beat is not None:
            beat.finish(summary)
        if not stopped:
            for result in results:
                if isinstance(result, BaseException):
                    raise result
    finally:
        pool.shutdown(wait=True)
    if stopped:
        raise stopped[0]
    return summary


def _record(storage: Storage, dataset: str, row: dict[str, Any], reason: str, fence: Fence,
            kind: StateKind) -> None:
    record_failure(storage, dataset, row["sample_id"], row.get("sample_index", 0), reason, fence, kind)
