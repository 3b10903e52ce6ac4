#!/usr/bin/env python3
"""Scale: does cost follow new work, not history? Not a test (tests/integration/test_bench_scale.py runs --quick and
checks only the structure of what it reports).

For a small and a large output (default 200k and 10M samples, 256 per marker: 781 and 39,063 markers), on local
disk and on the moto S3 server the tests use (its own process), it synthesises a committed output directly (markers
written in parallel, 99 % of the slots committed, plus an empty shard object per marker so listings are as long as
a real run's), then measures, each in a child process whose peak RSS is read from wait4():

- operator, cold: the passes over an output without a checkpoint it trusts (every marker read once, counted from the
  first in steps of SWEEP_NAMES names and MARKERS_PER_PASS reads, the passes following at once; it then writes one);
- operator, restarted, 1 and 10 resources (10 resources over the same output: each keeps its own index, so memory
  and work are per resource; moto could not hold ten 10M outputs): the first pass (checkpoint + markers after its
  horizon), a steady pass after 1 % new markers, the full listing of names before a run ends (whole, in one pass)
  and the periodic one (every 10 min: steps of SWEEP_NAMES names taking turns with incremental passes, the passes
  following at once: all of them are its passes in the figures);
  with the S3 calls each pass made; a pass that stopped at its share of markers (gather.MARKERS_PER_PASS) is followed
  by the next at once, as the operator does, and each is one pass in the figures;
- runner: the first start (the counting pass, cached), then a resume: start-up (`prepare_states`: cached scan,
  checkpoint, every marker name listed, leftovers) and the skip pass to the first unsettled line;
- `tokenmill report`: time and peak RSS (the real CLI);
- split: 64 runner workers over 100 simulated replicas (the simulator's capacity model, time-scaled, in one
  process), the real split (`belongs_to_worker` through the cached scan), the real shard buffer, commit protocol and
  index; 8 workers are killed at 30 % and restarted; then every marker is folded: no slot without an outcome (gap),
  none with two (overlap), every marker's lines owned by its worker.

Targets (issue 14): operator <= 256 MiB and <= 2 s per pass at 10M samples; runner and report peak RSS within 10 %
between the two sizes; resume start-up <= 60 s at 40k markers.

    .venv/bin/python hack/bench/bench_scale.py [--samples 10000000] [--small 200000] [--json out.json]
    .venv/bin/python hack/bench/bench_scale.py --quick      # a minute: 20k and 2k samples, smoke test
    # only some readers, backends and sizes; --workdir keeps the outputs, --reuse measures them again unsynthesised
    .venv/bin/python hack/bench/bench_scale.py --only runner-resume,report --backends local --workdir /tmp/scale
    .venv/bin/python hack/bench/bench_scale.py --only report --backends local --sizes large --workdir /tmp/scale --reuse
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import orjson

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "demo-model"
DATASET = "bench"
PER_MARKER = 256
COMMITTED_SHARE = 0.99
RUN_HOURS = 57  # the seeds' run: markers spread over its length
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
MIB = 1024 * 1024


# --- synthesis ---------------------------------------------------------------------------------------------------

def end_time(samples: int) -> datetime:
    return datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def marker_time(number: int, markers: int, samples: int) -> datetime:
    return end_time(samples) - timedelta(hours=RUN_HOURS) * (1 - number / max(markers, 1))


def write_source(path: Path, samples: int) -> None:
    """One prompt per line, unique ids (what the runner's counting pass and resume read)."""
    with path.open("wb") as handle:
        for start in range(0, samples, 100_000):
            handle.write(b"".join(
                b'{"sample_id":"p%09d","messages":[{"role":"user","content":"Prompt %d: say something."}]}\n' % (i, i)
                for i in range(start + 1, min(start + 100_000, samples) + 1)))


def build_marker(number: int, lines: range, at: datetime, worker: int) -> tuple[str, bytes, str, bytes]:
    """A marker as the runner writes it (ledger.build_marker's layout), with plausible lengths, and the shard's
    token-counts file it names (store/token_counts.py: what the report reads instead of the shard)."""
    from tokenmill_runner.stats.token_freq import ShardCounts
    from tokenmill_runner.store.marker_names import marker_name
    from tokenmill_runner.store.token_counts import counts_name, encode_counts

    rng = np.random.default_rng(number)
    n = len(lines)
    done = np.minimum(rng.lognormal(np.log(470), 1.5, n).astype(np.int64) + 1, 10240)
    end = np.where(rng.random(n) < 0.9, done // 2, -1)
    finish = ["length" if d >= 10240 else "stop" for d in done.tolist()]
    shard_id = f"w{worker:03d}-{worker:016x}-{number:06d}"
    samples = {
        "sample_id": [f"p{line:09d}" for line in lines], "line": list(lines), "sample_index": [0] * n,
        "prompt_tokens": rng.integers(50, 2000, n).tolist(), "completion_tokens": done.tolist(),
        "finish_reason": finish, "matched_stop": [163586 if f == "stop" else None for f in finish],
        "reasoning_end": [None if e < 0 else e for e in end.tolist()],
        "reasoning_end_token_id": [None if e < 0 else 163607 for e in end.tolist()],
        "has_tool_call": (rng.random(n) < 0.2).tolist(), "max_new_tokens": [10240] * n,
        "latency_s": np.round(rng.lognormal(3.0, 1.0, n), 3).tolist(),
    }
    marker = {"version": 2, "dataset": DATASET, "shard_id": shard_id, "worker": worker,
              "committed_at": at.isoformat(), "data": f"shards/{shard_id}.parquet", "data_bytes": 1,
              "errors": None, "samples": samples,
              "failed": {"line": [], "sample_index": [], "sample_id": [], "reason": []},
              "token_counts": counts_name(shard_id)}
    ids = np.unique(rng.integers(0, 163_840, 256))
    counts = np.bincount(rng.integers(0, ids.size, int(done.sum())), minlength=ids.size)
    keep = counts > 0
    tokens = ShardCounts(ids[keep], counts[keep], rng.integers(0, n, int(keep.sum())))
    return (f"{DATASET}/commits/{marker_name(at, shard_id)}", orjson.dumps(marker),
            f"{DATASET}/{counts_name(shard_id)}", encode_counts(DATASET, shard_id, n, tokens))


def markers_of(samples: int) -> int:
    return -(-samples // PER_MARKER)


def committed_markers(samples: int) -> int:
    return int(markers_of(samples) * COMMITTED_SHARE)


def _synth_part(uri: str, endpoint: str | None, samples: int, numbers: list[int]) -> None:
    from tokenmill_runner.store.storage import open_storage

    storage = open_storage(uri, endpoint)
    total = markers_of(samples)

    def one(number: int) -> None:
        lines = range(number * PER_MARKER + 1, min((number + 1) * PER_MARKER, samples) + 1)
        worker = number % 64
        key, data, counts_key, counts = build_marker(number, lines, marker_time(number, total, samples), worker)
        storage.put(f"{DATASET}/shards/w{worker:03d}-{worker:016x}-{number:06d}.parquet", b"-")
        storage.put(counts_key, counts)
        storage.put(key, data)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, numbers))


def synthesize(uri: str, endpoint: str | None, samples: int, processes: int = 2) -> float:
    """Markers for the first 99 % of the slots, written by `processes` processes of 16 threads; run.json."""
    from tokenmill_runner.store.storage import open_storage

    started = time.perf_counter()
    numbers = list(range(committed_markers(samples)))
    chunks = [numbers[i::processes] for i in range(processes)]
    children = [subprocess.Popen([sys.executable, __file__, "child", "synth", uri, endpoint or "", str(samples),
                                  json.dumps(chunk)]) for chunk in chunks]
    if any(child.wait() for child in children):
        raise SystemExit("synthesis failed")
    run = {"version": 1, "name": "bench", "spec": {"datasets": [{"name": DATASET}], "model": {"path": str(MODEL)}},
           "context_length": 32768, "datasets": {DATASET: {"rows": samples}}, "workers": 64,
           "tokenizer": {"reasoning_end_token": "</think>", "reasoning_end_id": 163607}}
    open_storage(uri, endpoint).put("run.json", orjson.dumps(run))
    return time.perf_counter() - started


# --- children: each measured in its own process -------------------------------------------------------------------

def count_calls(storage: Any) -> Counter[str]:
    """S3 API calls by operation (an S3 bill's view of a pass); empty for local storage."""
    calls: Counter[str] = Counter()
    client = getattr(storage, "_client", None)
    if client is not None:
        client.meta.events.register("before-call.s3.*", lambda model, **_: calls.update([model.name]))
        whole = storage._get_whole  # a capped read's GET bypasses botocore's events (storage.py)

        def counted(key: str, max_bytes: int) -> bytes | None:
            calls.update(["GetObject"])
            return whole(key, max_bytes)  # type: ignore[no-any-return]

        storage._get_whole = counted
    return calls


def _timed(calls: Counter[str], action: Any) -> dict[str, Any]:
    """Wall seconds, CPU seconds (the process's, its reading threads' included: on a shared machine the wall time
    also counts the waits for a core) and S3 calls of one pass."""
    before = Counter(calls)
    started, cpu = time.perf_counter(), time.process_time()
    action()
    return {"seconds": round(time.perf_counter() - started, 4), "cpu_seconds": round(time.process_time() - cpu, 4),
            "calls": dict(calls - before)}


def steady_markers(uri: str, endpoint: str | None, samples: int, at: datetime, tag: int) -> int:
    """1 % of the markers again (the slots not committed yet, under new shard ids: the I/O of a steady pass)."""
    from tokenmill_runner.store.storage import open_storage

    storage = open_storage(uri, endpoint)
    total, first = markers_of(samples), committed_markers(samples)
    count = max(total // 100, 1)

    def one(i: int) -> None:
        number = first + i % max(total - first, 1)
        lines = range(number * PER_MARKER + 1, min((number + 1) * PER_MARKER, samples) + 1)
        key, data, counts_key, counts = build_marker(1_000_000 * tag + number, lines, at + timedelta(milliseconds=i),
                                                     63 - i % 64)
        storage.put(counts_key, counts)
        storage.put(key, data)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(count)))
    return count


def child_operator(uri: str, endpoint: str | None, samples: int, resources: int, cold: bool) -> dict[str, Any]:
    import tokenmill_operator.handlers  # noqa: F401 - the operator process's imports (kopf, clients): its baseline
    from tokenmill_operator.observe.access import OBSERVE_RETRY
    from tokenmill_operator.observe.gather import (
        CHECKPOINT_WRITER,
        FULL_LISTING_EVERY,
        OutputIndex,
        checkpoint_signer,
        observe_progress,
    )
    from tokenmill_runner.store.index_store import write_checkpoint
    from tokenmill_runner.store.storage import open_storage

    storage = open_storage(uri, endpoint, retry=OBSERVE_RETRY)
    calls = count_calls(storage)
    now = end_time(samples) + timedelta(minutes=1)
    started = now - timedelta(hours=RUN_HOURS + 1)
    outputs = [OutputIndex() for _ in range(resources)]
    facts: list[Any] = []

    def observe(output: OutputIndex, at: datetime, full: bool = False) -> None:
        facts.append(observe_progress(storage, output, at, started, full=full)[0])

    def caught_up(output: OutputIndex, at: datetime, full: bool = False) -> list[dict[str, Any]]:
        """A pass, and the passes that follow it at once while the last one was behind (MARKERS_PER_PASS, the full
        listing's steps)."""
        passes: list[dict[str, Any]] = []
        while not passes or output.behind:
            passes.append(_timed(calls, lambda: observe(output, at, full)))
        return passes

    result: dict[str, Any] = {"first": [p for o in outputs for p in caught_up(o, now)]}
    if cold:
        # No checkpoint in the passes of a count: the operator's next pass writes it, with the count's horizon.
        observe(outputs[0], now + timedelta(seconds=30))
        index = outputs[0].datasets[DATASET]
        if not list(storage.list(f"{DATASET}/index/")):  # fewer than CHECKPOINT_EVERY markers (a --quick size)
            write_checkpoint(storage, index, CHECKPOINT_WRITER, now, checkpoint_signer().key)
        result["completed"] = facts[-1].overall.completed
        return result
    tag = int(time.time() * 1000) % 1000
    result["new_markers"] = steady_markers(uri, endpoint, samples, now + timedelta(seconds=5), tag)
    later = now + timedelta(seconds=15)
    result["steady"] = [p for o in outputs for p in caught_up(o, later)]
    result["full_listing"] = caught_up(outputs[0], later + timedelta(seconds=15), True)  # once the Job finished
    assert not outputs[0].incomplete
    result["sweep"] = caught_up(outputs[0], later + FULL_LISTING_EVERY + timedelta(seconds=30))
    index = outputs[0].datasets[DATASET]
    result.update(completed=facts[-1].overall.completed, markers=index.markers,
                  index_bytes=index.ledger.nbytes + index.known_hashes().nbytes)
    return result


def _runner_config(uri: str, endpoint: str | None, source: str, worker: int, workers: int) -> Any:
    from tokenmill_runner.spec.config import RunnerConfig
    from tokenmill_runner.spec.resource import DatasetGenerationSpec

    spec = DatasetGenerationSpec.model_validate({
        "model": {"path": str(MODEL)}, "datasets": [{"name": DATASET, "source": source}],
        "output": {"uri": uri, "endpoint": endpoint}, "sampling": {"maxNewTokens": 10240}})
    return RunnerConfig(spec=spec, servers=["http://127.0.0.1:9"], output_uri=uri, worker_index=worker,
                        worker_count=workers)


def child_runner(uri: str, endpoint: str | None, source: str, worker: int, workers: int) -> dict[str, Any]:
    from types import SimpleNamespace

    from tokenmill_runner.generate.pipeline import Runner, SettledTally
    from tokenmill_runner.prepare import prepare_states
    from tokenmill_runner.source.reader import read_prompts
    from tokenmill_runner.store.storage import open_storage

    config = _runner_config(uri, endpoint, source, worker, workers)
    storage = open_storage(uri, endpoint)
    calls = count_calls(storage)
    started = time.perf_counter()
    [state], _ = prepare_states(config, storage, {})
    startup = {"seconds": round(time.perf_counter() - started, 3), "calls": dict(calls)}
    # What the stream does before its first request: read the source, asking the ledger before parsing a row.
    runner = SimpleNamespace(config=config, _settled=SettledTally())
    wanted = Runner._wanted.__get__(runner)
    started = time.perf_counter()
    first = next((item.line for item in read_prompts(source, "jsonl", wanted=lambda line: wanted(state, False, line))), None)
    Runner._count_settled_lines.__get__(runner)(state)
    return {"startup": startup, "first_unsettled_line": first, "skipped": state.skipped,
            "to_first_unsettled_s": round(time.perf_counter() - started, 3), "markers": state.commits.markers}


def run_child(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `bench_scale.py child ...`, return its JSON answer and its peak RSS (MiB) from wait4."""
    with tempfile.TemporaryFile() as out:
        # One operator key for every child, as the chart's Secret gives one to every restart of the operator: a
        # restarted operator starts from the checkpoints it keyed before.
        process = subprocess.Popen([sys.executable, __file__, "child", *args], stdout=out,
                                   env={"TOKENMILL_CHECKPOINT_KEY": "bench-scale", **os.environ, **(env or {})})
        _, status, usage = os.wait4(process.pid, 0)
        out.seek(0)
        text = out.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child {args[0]} failed: {text[-2000:]}")
    return {**json.loads(text.strip().splitlines()[-1]), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def run_report(uri: str, endpoint: str | None) -> dict[str, Any]:
    # The synthetic output is timed, not judged (it has no run.json, so its verdict is FAIL): exit 0 is a report made.
    command = [sys.executable, "-m", "tokenmill_runner.cli", "-q", "report", uri, "--fail-on", "never"]
    if endpoint:
        command += ["--s3-endpoint", endpoint]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"tokenmill report {uri} failed")
    return {"seconds": round(time.perf_counter() - started, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


# --- the split simulation ------------------------------------------------------------------------------------------

def write_split_source(path: Path, prompts: int) -> None:
    """Unique ids, 0.2 % of lines repeating an earlier id, 0.1 % of lines not JSON: every kind of outcome."""
    rng = random.Random(64)
    with path.open("wb") as handle:
        for line in range(1, prompts + 1):
            roll = rng.random()
            if roll < 0.001:
                handle.write(b"{not json\n")
                continue
            sample = rng.randrange(1, line) if roll < 0.003 and line > 1 else line
            handle.write(orjson.dumps({"sample_id": f"q{sample}", "messages": [
                {"role": "user", "content": f"q {line}"}]}) + b"\n")


class SimReplica:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.completed = 0


async def _split_worker(worker: int, workers: int, replicas: list[SimReplica], storage: Any, source: str,
                        concurrency: int, stats: Counter[str]) -> None:
    from tokenmill_runner.source.prompts import Prompt, duplicate_error, id_hash
    from tokenmill_runner.source.reader import read_prompts
    from tokenmill_runner.source.scan_cache import cached_scan
    from tokenmill_runner.store.index_store import open_index
    from tokenmill_runner.store.lease_rules import CleanRule
    from tokenmill_runner.store.ledger import Slot
    from tokenmill_runner.store.shards import ShardBuffer, clean_leftovers, commit_shard, new_run_token, new_shard_id
    from tokenmill_sim.capacity import Job

    scan = cached_scan(storage, DATASET, source, "jsonl", None, None, worker, workers)
    index, caught = open_index(storage, DATASET, scan.rows)
    # The bench's worker is this output's only writer: every unmarked file is its own killed predecessor's.
    everything = CleanRule(frozenset(), datetime.max.replace(tzinfo=UTC), 0.0)
    clean_leftovers(storage, DATASET, worker, everything, index.knows, caught.strays)
    buffer, token, sequence = ShardBuffer(256, 5.0), new_run_token(), 0
    outstanding = [0] * len(replicas)  # this worker's view, as its GenerateClient keeps it
    slots = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()

    def commit() -> None:
        nonlocal sequence
        sequence += 1
        shard_id = new_shard_id(worker, sequence, token)
        index.fold(shard_id, commit_shard(storage, DATASET, shard_id, worker, buffer.take()))

    def record(row: dict[str, Any] | None, error: dict[str, Any] | None) -> None:
        if row is not None:
            buffer.add_row(row, loop.time())
        else:
            buffer.add_error(error, loop.time())
        if buffer.is_due(loop.time()):
            commit()

    async def generate(prompt: Any) -> None:
        try:
            choice = min(range(len(replicas)), key=lambda r: (outstanding[r], (r - worker) % len(replicas)))
            outstanding[choice] += 1
            length = int(min(np.random.default_rng(prompt.line).lognormal(np.log(470), 1.5) + 1, 10240))
            job = replicas[choice].engine.submit(Job(200, length, arrival=0.0), enforce_queue_limit=False)
            await job.handle
            outstanding[choice] -= 1
            replicas[choice].completed += 1
            record({"sample_id": prompt.sample_id, "dataset": DATASET, "line": prompt.line, "sample_index": 0,
                    "prompt_ids": [1], "output_ids": [2] * 4, "prompt_tokens": 200, "completion_tokens": length,
                    "finish_reason": "stop", "latency_s": 0.0}, None)
            stats["generated"] += 1
        finally:
            slots.release()

    def wanted(line: int) -> bool:
        return scan.owns(line) and not index.ledger.is_done(Slot(line))

    pending: set[asyncio.Task[None]] = set()
    try:
        for item in read_prompts(source, "jsonl", wanted=wanted):
            if not isinstance(item, Prompt):
                record(None, item.as_record(DATASET))
                continue
            first = scan.duplicates.first_of(item.line, id_hash(item.sample_id))
            if first is not None:
                record(None, duplicate_error(item.line, item.sample_id, first).as_record(DATASET))
                continue
            await slots.acquire()
            task = asyncio.create_task(generate(item))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
        if len(buffer):
            commit()
    finally:
        for task in pending:
            task.cancel()


async def split_simulation(folder: Path, prompts: int, workers: int, replicas: int, kills: int,
                           time_scale: float) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "runner" / "sim"))
    from tokenmill_runner.source.prompts import belongs_to_worker
    from tokenmill_runner.source.reader import read_prompts
    from tokenmill_runner.store.ledger import DatasetLedger
    from tokenmill_runner.store.markers import marker_keys, read_markers
    from tokenmill_runner.store.storage import LocalStorage
    from tokenmill_sim.capacity import CapacityModel, SchedulerParams
    from tokenmill_sim.engine import Engine, SimClock

    source = folder / "split.jsonl"
    write_split_source(source, prompts)
    storage = LocalStorage(folder / "split-out")
    clock = SimClock(time_scale)
    pool = [SimReplica(Engine(CapacityModel(SchedulerParams(max_running_requests=64)), clock))
            for _ in range(replicas)]
    for replica in pool:
        replica.engine.start()
    concurrency = max(8, int(replicas * 64 * 1.5) // workers)
    stats: Counter[str] = Counter()
    started = time.perf_counter()

    def launch(worker: int) -> asyncio.Task[None]:
        return asyncio.create_task(_split_worker(worker, workers, pool, storage, str(source), concurrency, stats))

    tasks = {worker: launch(worker) for worker in range(workers)}
    killed: list[int] = []
    while stats["generated"] < 0.3 * prompts and not all(t.done() for t in tasks.values()):
        await asyncio.sleep(0.01)
    for worker in random.Random(8).sample(range(workers), kills):  # a kill: in flight and uncommitted are lost
        tasks[worker].cancel()
        killed.append(worker)
    await asyncio.gather(*(tasks[w] for w in killed), return_exceptions=True)
    for worker in killed:
        tasks[worker] = launch(worker)
    await asyncio.gather(*tasks.values())
    elapsed = time.perf_counter() - started
    simulated = clock.now()
    for replica in pool:
        await replica.engine.stop()

    owner = {item.line: next(w for w in range(workers) if belongs_to_worker(item, w, workers))
             for item in read_prompts(str(source), "jsonl")}
    outcomes: Counter[int] = Counter()
    foreign = 0
    for marker in read_markers(storage, DATASET):
        lines = marker["samples"]["line"] + marker["failed"]["line"]
        outcomes.update(lines)
        foreign += sum(1 for line in lines if owner[line] != marker["worker"])
    ledger = DatasetLedger(DATASET, prompts).fold_all(read_markers(storage, DATASET))
    per_replica = [replica.completed for replica in pool]
    return {
        "prompts": prompts, "workers": workers, "replicas": replicas, "killed_and_restarted": len(killed),
        "markers": len(marker_keys(storage, DATASET)), "rows": ledger.completed, "errors": ledger.failed,
        "errors_by_reason": ledger.final_failures(),
        "gap": sum(1 for line in range(1, prompts + 1) if outcomes[line] == 0),
        "overlap": sum(1 for count in outcomes.values() if count > 1),
        "lines_in_another_workers_marker": foreign,
        "requests_per_replica_min_max": [min(per_replica), max(per_replica)],
        "wall_s": round(elapsed, 2), "sim_clock_s": round(simulated, 1),
        # Regenerated after the kills: the killed workers' in-flight requests and uncommitted buffers.
        "generated_requests": stats["generated"],
    }


def child_split(folder: str, prompts: int, workers: int, replicas: int, kills: int, time_scale: float) -> dict:
    return asyncio.run(split_simulation(Path(folder), prompts, workers, replicas, kills, time_scale))


def child(args: list[str]) -> None:
    kind, rest = args[0], args[1:]
    if kind == "synth":
        _synth_part(rest[0], rest[1] or None, int(rest[2]), json.loads(rest[3]))
        return
    if kind == "operator":
        answer = child_operator(rest[0], rest[1] or None, int(rest[2]), int(rest[3]), rest[4] == "cold")
    elif kind == "runner":
        answer = child_runner(rest[0], rest[1] or None, rest[2], int(rest[3]), int(rest[4]))
    elif kind == "split":
        answer = child_split(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[4]), float(rest[5]))
    else:
        raise SystemExit(f"unknown child {kind}")
    print(json.dumps(answer, default=str))


# --- the parent ----------------------------------------------------------------------------------------------------

def start_moto() -> tuple[subprocess.Popen, str]:
    import socket

    sys.path.insert(0, str(REPO))
    from tests import s3_server

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = s3_server.spawn(port)
    endpoint = f"http://127.0.0.1:{port}"
    from tokenmill_runner.store.storage import s3_client

    for _ in range(200):
        try:
            s3_client(endpoint).create_bucket(Bucket="bench")
            return process, endpoint
        except Exception:  # noqa: BLE001 - not listening yet
            time.sleep(0.1)
    raise SystemExit("moto server did not start")


READERS = ("operator-cold", "operator-1", "operator-10", "runner-first-start", "runner-resume", "report", "split")


def measure_output(uri: str, endpoint: str | None, samples: int, source: Path, first_start: bool,
                   only: frozenset[str] = frozenset(READERS), reuse: bool = False) -> dict[str, Any]:
    """Synthesise the output (unless `reuse` and it is there already) and measure the readers in `only`."""
    from tokenmill_runner.store.storage import open_storage

    result: dict[str, Any] = {}
    if reuse and open_storage(uri, endpoint).exists("run.json"):
        result["reused"] = True  # an earlier run's output (its steady passes' markers included)
    else:
        result["synth_s"] = round(synthesize(uri, endpoint, samples), 1)
    args = (uri, endpoint or "", str(samples))
    if "operator-cold" in only:
        result["operator_cold"] = run_child("operator", *args, "1", "cold")
    if "operator-1" in only:
        result["operator_1"] = run_child("operator", *args, "1", "warm")
    if "operator-10" in only:
        result["operator_10"] = run_child("operator", *args, "10", "warm")
    # A resume needs the counting pass cached: a fresh output gets its first start even when only the resume is asked
    if first_start and ("runner-first-start" in only or ("runner-resume" in only and "synth_s" in result)):
        result["runner_first_start"] = run_child("runner", uri, endpoint or "", str(source), "0", "1")
    if "runner-resume" in only:
        result["runner_resume"] = run_child("runner", uri, endpoint or "", str(source), "0", "1")
    if "report" in only:
        result["report"] = run_report(uri, endpoint)
    return result


def copy_scan_cache(local_out: Path, uri: str, endpoint: str) -> None:
    """The S3 output's runner reads the same local source: reuse the scan the local run cached (same key)."""
    from tokenmill_runner.store.storage import open_storage

    target = open_storage(uri, endpoint)
    for path in (local_out / DATASET / "scans").glob("*.scan"):
        target.put(f"{DATASET}/scans/{path.name}", path.read_bytes())


def _pass_s(entry: dict[str, Any], key: str, measure: str = "seconds") -> float:
    return max(item.get(measure, 0.0) for item in entry[key])


def _calls(entry: dict[str, Any], key: str) -> str:
    counted = Counter()
    for item in entry[key]:
        counted.update(item["calls"])
    per = {op: round(n / len(entry[key]), 1) for op, n in counted.items()}
    return " ".join(f"{op.replace('ListObjectsV2', 'LIST').replace('GetObject', 'GET').replace('HeadObject', 'HEAD')}"
                    f"={n:g}" for op, n in sorted(per.items())) or "-"


def _slowest(entry: dict[str, Any], measure: str = "seconds") -> float:
    return max(_pass_s(entry, k, measure) for k in ("first", "steady"))


TABLE: list[tuple[str, Any, str]] = [  # label, what to read from one size's measurements, target
    ("operator cold (no checkpoint): slowest pass s", lambda m: _pass_s(m["operator_cold"], "first"), "<= 2 s"),
    ("  its passes", lambda m: len(m["operator_cold"]["first"]), "once per output"),
    ("  all of them s", lambda m: sum(p["seconds"] for p in m["operator_cold"]["first"]), ""),
    ("operator restart: first pass s", lambda m: _pass_s(m["operator_1"], "first"), "<= 2 s"),
    ("operator steady pass (1 % new) s", lambda m: _pass_s(m["operator_1"], "steady"), "<= 2 s"),
    ("  its CPU s", lambda m: _pass_s(m["operator_1"], "steady", "cpu_seconds"), ""),
    ("operator full listing before a run ends: slowest s", lambda m: _pass_s(m["operator_1"], "full_listing"),
     "<= 2 s"),
    ("  its passes", lambda m: len(m["operator_1"]["full_listing"]), "once a run"),
    ("operator periodic full listing: slowest s", lambda m: _pass_s(m["operator_1"], "sweep"), "<= 2 s"),
    ("  its passes", lambda m: len(m["operator_1"]["sweep"]), "every 10 min"),
    ("operator 1 resource peak RSS MiB", lambda m: m["operator_1"]["peak_rss_mib"], "<= 256"),
    ("operator 10 resources: slowest pass s", lambda m: _slowest(m["operator_10"]), "<= 2 s"),
    ("  most CPU in one pass s", lambda m: _slowest(m["operator_10"], "cpu_seconds"), ""),
    ("operator 10 resources peak RSS MiB", lambda m: m["operator_10"]["peak_rss_mib"], "<= 256"),
    ("runner first start (counting pass) s", lambda m: m["runner_first_start"]["startup"]["seconds"],
     "once per source"),
    ("runner resume start-up s", lambda m: m["runner_resume"]["startup"]["seconds"], "<= 60 s"),
    ("runner skip to first unsettled line s", lambda m: m["runner_resume"]["to_first_unsettled_s"], ""),
    ("runner resume peak RSS MiB", lambda m: m["runner_resume"]["peak_rss_mib"], "ratio <= 1.10"),
    ("report s", lambda m: m["report"]["seconds"], ""),
    ("report peak RSS MiB", lambda m: m["report"]["peak_rss_mib"], "ratio <= 1.10"),
]


def print_table(results: dict[str, Any]) -> None:
    sizes = results["sizes"]
    print("\nscale: " + " vs ".join(f"{n:,} samples ({markers_of(n):,} markers)" for n in sizes))
    for backend, by_size in results["backends"].items():
        measured = [(size, by_size[str(size)]) for size in sizes if str(size) in by_size]
        print(f"\n[{backend}]{'':30}" + "".join(f" {size:>12,}" for size, _ in measured) + "   ratio  target")
        for label, read, target in TABLE:
            values = []
            for _, entry in measured:
                try:
                    values.append(read(entry))
                except KeyError:  # a reader this run did not measure (--only)
                    values.append(None)
            if all(v is None for v in values):
                continue
            cells = "".join(f" {v:>12,.2f}" if v is not None else f" {'-':>12}" for v in values)
            x, y = values[0], values[-1]
            ratio = f"{y / x:>7.2f}" if len(values) > 1 and x and y is not None else f"{'':>7}"
            print(f"  {label:<38}{cells} {ratio}  {target}")
        large = measured[-1][1] if measured else {}
        if backend == "s3" and "operator_1" in large:
            print(f"  S3 calls per operator pass at {measured[-1][0]:,}: restart {_calls(large['operator_1'], 'first')}; "
                  f"steady {_calls(large['operator_1'], 'steady')} ({len(large['operator_1']['steady'])} passes); "
                  f"full listing {_calls(large['operator_1'], 'full_listing')} "
                  f"({len(large['operator_1']['full_listing'])} passes); periodic full listing "
                  f"{_calls(large['operator_1'], 'sweep')} ({len(large['operator_1']['sweep'])} passes)")
    if "split" not in results:
        return
    split = results["split"]
    print(f"\nsplit: {split['workers']} workers x {split['replicas']} replicas, {split['prompts']:,} prompts, "
          f"{split['killed_and_restarted']} killed and restarted: gap {split['gap']}, overlap {split['overlap']}, "
          f"lines in another worker's marker {split['lines_in_another_workers_marker']}; {split['rows']:,} rows + "
          f"{split['errors']:,} errors {split['errors_by_reason']}; requests per replica "
          f"{split['requests_per_replica_min_max']}; {split['wall_s']} s wall ({split['sim_clock_s']:,.0f} s on the replicas' clock)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--small", type=int, default=200_000)
    parser.add_argument("--split-prompts", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=100)
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=20_000.0)
    parser.add_argument("--backends", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    parser.add_argument("--workdir", help="where to build the outputs (default: a temporary folder, removed)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --workdir: measure the outputs (and sources) an earlier run left there instead of "
                             "synthesising them again (the earlier steady passes' markers stay in them)")
    parser.add_argument("--only", type=lambda text: frozenset(text.split(",")), default=frozenset(READERS),
                        help=f"comma-separated readers to measure, of {','.join(READERS)} (default: all)")
    parser.add_argument("--sizes", nargs="+", choices=["small", "large"], default=["small", "large"],
                        help="which of the two outputs to build and measure (default: both)")
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--quick", action="store_true", help="20k and 2k samples, 4,000 prompts to split: a smoke test")
    args = parser.parse_args()
    if not args.only <= set(READERS):
        parser.error(f"--only: unknown readers {sorted(args.only - set(READERS))}")
    if args.reuse and not args.workdir:
        parser.error("--reuse needs --workdir")
    if args.quick:
        args.samples, args.small, args.split_prompts = 20_000, 2_000, 4_000
    os.environ.update(S3_ENV)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tokenmill-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    moto, endpoint = start_moto() if "s3" in args.backends else (None, None)
    sizes = [n for n, name in ((args.small, "small"), (args.samples, "large")) if name in args.sizes]
    results: dict[str, Any] = {"sizes": sizes, "per_marker": PER_MARKER, "backends": {b: {} for b in args.backends}}
    try:
        for samples in sizes:
            folder = workdir / f"n{samples}"
            folder.mkdir(exist_ok=True)
            source = folder / "prompts.jsonl"
            if not (args.reuse and source.exists()):  # rewritten, it would miss the scan cached for it (its mtime)
                write_source(source, samples)
            for backend in args.backends:
                print(f"measuring {backend} at {samples:,} samples ...", flush=True)
                if backend == "local":
                    uri = str(folder / "out")
                    results["backends"][backend][str(samples)] = measure_output(
                        uri, None, samples, source, True, args.only, args.reuse)
                else:
                    # moto keeps its objects in its process: an S3 output is never there to reuse
                    uri = f"s3://bench/n{samples}/"
                    if "local" in args.backends:
                        copy_scan_cache(folder / "out", uri, endpoint)
                    results["backends"][backend][str(samples)] = measure_output(
                        uri, endpoint, samples, source, "local" not in args.backends, args.only)
            if not args.workdir:
                source.unlink()
        if "split" in args.only:
            print("split simulation ...", flush=True)
            results["split"] = run_child("split", str(workdir), str(args.split_prompts), str(args.workers),
                                         str(args.replicas), str(args.kills), str(args.time_scale))
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2:])
    else:
        main()
