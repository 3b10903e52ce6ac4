"""The hidden-state pass: for every committed sample, the target's aux states of exactly prompt ids + output ids.

After the generation stream, each committed row without a committed state file is sent once as a capture request
(facts/hidden_states.capture_request: full prefill, no cached prefix), its answer checked (the token ids the server
echoes equal the row's, one state row per token) and committed by store/hidden_states.py. A resume captures only
what has no marker; a failed capture is recorded and retried only with retry_failed. At most `concurrency` answers
are held at once, each parsed without building Python floats (one sample's states, never a shard's). With a fence
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

import httpx
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
from .client import auth_headers

logger = logging.getLogger(__name__)

_FIELD = b'"hidden_states":'
# The characters a JSON list of numbers is made of; the first other one ends the value (a NaN served as null, too).
_NOT_NUMERIC = re.compile(rb"[^0-9eE+\-.,\[\]\s]")
# JSON text per state value is at most this long (orjson's shortest float repr plus a comma).
_MAX_CHARS_PER_VALUE = 26


class CaptureError(ValueError):
    """An answer that cannot be stored as the sample's states; the message names the sample and what differs."""


@dataclass
class CaptureSummary(CaptureCounts):
    """A pass's counts (what its progress objects carry) with the kind and the failures' messages."""

    kind: str = "aux"
    failures: list[str] = field(default_factory=list)


def parse_states(body: bytes, sequence: list[int], shape: StateShape, where: str) -> np.ndarray:
    """The states of `sequence` from a /generate answer, as float64 [tokens * layers * hidden].

    The answer's hidden_states entries are the prefill chunks (2-D) and then decoded rows (1-D): the first
    tokens * row_values numbers are the prefill's, as long as every chunk survived the finished_len cut."""
    start = body.find(_FIELD)
    if start < 0:
        raise CaptureError(f"{where}: the answer has no meta_info.hidden_states (is the server started with "
                           "--enable-return-aux-hidden-states, or --enable-return-hidden-states for the final "
                           "state?)")
    value_start = start + len(_FIELD)
    end_match = _NOT_NUMERIC.search(body, value_start)
    value_end = end_match.start() if end_match else len(body)
    if body[value_end:value_end + 4] == b"null":
        raise CaptureError(f"{where}: a state value is null (NaN or inf served)")
    value_end = value_start + len(body[value_start:value_end].rstrip(b", \t\r\n"))
    rest = orjson.loads(body[:value_start] + b"null" + body[value_end:])
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
        raise CaptureError(f"{where}: {values.size // max(1, shape.row_values)} state rows of "
                           f"{shape.row_values} values for {len(sequence)} tokens (a prefix served from the cache, "
                           "or prefill chunks cut by finished_len)")
    return values[:wanted]


def _sequence(row: dict[str, Any]) -> list[int]:
    if "turns" in row:  # a multi-turn sample: the last turn holds the whole conversation's ids
        last = row["turns"][-1]
        return list(last["prompt_ids"]) + list(last["output_ids"])
    return list(row["prompt_ids"]) + list(row["output_ids"])


async def capture_dataset(storage: Storage, dataset: str, server: str, shape: StateShape, *,
                          api_key: str | None = None, chunked_prefill_tokens: int = 8192,
                          concurrency: int = CAPTURE_CONCURRENCY,
                          retry_failed: bool = False, spool: Path | None = None,
                          timeout_s: float = 600.0, worker: int | None = None,
                          fence: Fence | None = None, kind: StateKind = AUX,
                          beat: ProgressBeat | None = None) -> CaptureSummary:
    """Capture the states of every committed row of `dataset` that has none committed (those this worker
    committed, when `worker` is given: the workers split the pass as they split the samples). Raises LeaseLost
    when `fence` can no longer prove the lease; nothing is committed after that. `beat` gets the counts as they
    move (store/capture_progress.py: what the operator shows while the pass runs)."""
    summary = CaptureSummary()
    lost: list[LeaseLost] = []
    fence = fence or Fence.unleased(new_run_token())  # without a lease, this call is a writer of its own
    if worker in (None, 0):  # one worker of the pass removes what killed or taken-over writers left unmarked
        await asyncio.to_thread(clean_state_leftovers, storage, dataset, kind, fence)
    done = captured_keys(storage, dataset, kind)
    failed = failed_keys(storage, dataset, kind)
    limit = asyncio.Semaphore(concurrency)
    # smg answers 415 to a body without its JSON content type (SGLang itself does not check).
    headers = {"Content-Type": "application/json", **auth_headers(api_key)}
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    # SGLang refuses a rid already in flight ("Duplicate request ID detected"), so a second writer of the same run
    # (or a retry while the first request is still running) needs its own.
    writer = secrets.token_hex(4)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def heartbeat(final: bool = False) -> None:
        if beat is not None and (document := beat.due(summary, final)) is not None:
            await loop.run_in_executor(pool, beat.write, document)

    def give_up(error: LeaseLost) -> None:
        # What is in flight could only be refused at its marker: the server's time is not spent on it.
        lost.append(error)
        for task in tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def one(client: httpx.AsyncClient, row: dict[str, Any], key: str) -> None:
        sequence = _sequence(row)
        where = f"dataset {dataset!r} sample {row['sample_id']!r} (index {row.get('sample_index', 0)})"
        body = capture_request(sequence, f"hs-{kind.name}-{key}-{writer}", chunked_prefill_tokens)
        bound = len(sequence) * shape.row_values * _MAX_CHARS_PER_VALUE + (1 << 20) + 64 * len(sequence)
        try:
            async with client.stream("POST", f"{server}/generate", content=orjson.dumps(body)) as answer:
                chunks, size = [], 0
                async for chunk in answer.aiter_bytes():
                    size += len(chunk)
                    if size > bound:
                        raise CaptureError(f"{where}: the answer exceeds {bound} bytes, more than "
                                           f"{len(sequence)} tokens' states can take")
                    chunks.append(chunk)
                data = b"".join(chunks)
                del chunks
            if answer.status_code != 200:
                raise CaptureError(f"{where}: HTTP {answer.status_code}: {data[:300]!r}")
            values = await loop.run_in_executor(pool, parse_states, data, sequence, shape, where)
            del data
            # In the pool: the fence may wait for a late renewal, which must not stall the other answers' streams.
            await loop.run_in_executor(
                pool, lambda: commit_states(storage, dataset, row["sample_id"], row.get("sample_index", 0),
                                            sequence, values, shape, fence, spool, kind))
            if key in failed:
                await loop.run_in_executor(pool, clear_failure, storage, dataset, key, fence, kind)
            summary.captured += 1
            summary.state_bytes += shape.state_bytes(len(sequence))
        except (CaptureError, httpx.HTTPError) as error:
            summary.failed += 1
            summary.failures.append(str(error))
            logger.warning("hidden-state capture failed: %s", error)
            reason = str(error)
            try:
                await loop.run_in_executor(pool, lambda: record_failure(
                    storage, dataset, row["sample_id"], row.get("sample_index", 0), reason, fence, kind))
            except LeaseLost as gone:
                give_up(gone)
        except LeaseLost as error:
            give_up(error)
        finally:
            limit.release()
        await heartbeat()  # not in `finally`: a cancelled task writes nothing

    try:
        async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
            for key, row in committed_samples(storage, dataset, worker):
                if lost:
                    break
                if key in done or (key in failed and not retry_failed):
                    summary.skipped += 1
                    await heartbeat()
                    continue
                await limit.acquire()
                if lost:
                    limit.release()
                    break
                task = asyncio.create_task(one(client, row, key))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await heartbeat(final=True)
            if beat is not None:
                beat.finish(summary)
            if not lost:
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
    finally:
        pool.shutdown(wait=True)
    if lost:
        raise lost[0]
    return summary
