#!/usr/bin/env python3
"""Where the runner's CPU goes per sample, stage by stage (issue 44). Not a test.

One simulator process at a high time scale (its CPU is not counted), the real runner (`prepare` + `Runner.run`) in
this process, with each stage's functions wrapped in a per-thread CPU clock (`time.thread_time`, so time spent in
other threads or waiting is not counted twice): reading the source, rendering and tokenizing, encoding request
bodies, decoding and checking answers, building rows, writing shards and markers, folding commits, progress and
metrics. What is left of the process's CPU (`time.process_time`) is the event loop and the HTTP client.

    .venv/bin/python hack/bench/profile_runner.py [--samples 3000] [--samples-per-prompt 1] [--concurrency 64]
    .venv/bin/python hack/bench/profile_runner.py --cprofile out.prof   # and the cProfile of the same run
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import logging
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import start_simulator, write_workload  # noqa: E402

from tokenmill_runner.cli import stream_settings  # noqa: E402
from tokenmill_runner.generate import client as client_module  # noqa: E402
from tokenmill_runner.generate import pipeline as pipeline_module  # noqa: E402
from tokenmill_runner.generate import results as results_module  # noqa: E402
from tokenmill_runner.prepare import prepare  # noqa: E402
from tokenmill_runner.spec.config import RunnerConfig  # noqa: E402
from tokenmill_runner.spec.resource import load_spec_file  # noqa: E402

SPENT: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
_depth: dict[int, int] = defaultdict(int)  # per thread: a stage inside another is counted once, by the outer one


def timed(stage: str, function: Callable[..., Any]) -> Callable[..., Any]:
    import threading

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        thread = threading.get_ident()
        _depth[thread] += 1
        started = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            _depth[thread] -= 1
            if _depth[thread] == 0:
                SPENT[stage] += time.thread_time() - started
                CALLS[stage] += 1
    return wrapper


def patch(owner: Any, name: str, stage: str) -> None:
    setattr(owner, name, timed(stage, getattr(owner, name)))


class TimedOrjson:
    """The client's orjson: dumps counted as request encoding, loads as answer decoding."""

    def __init__(self, real: Any) -> None:
        self.JSONDecodeError = real.JSONDecodeError
        self.dumps = timed("encode request JSON", real.dumps)
        self.loads = timed("decode answer JSON", real.loads)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def instrument() -> None:
    from tokenmill_runner import metrics, progress
    from tokenmill_runner.render.pretokenize import PromptEncoder
    from tokenmill_runner.store import commit_index, shards

    # pyarrow imports pandas (where it is installed: this venv, not the runner's image) on its first array, ~1 s
    # of CPU once per process: a start-up cost, not a sample's.
    shards.encode_rows([{"sample_id": "warm-up", "prompt_ids": [1], "output_ids": [2]}])
    patch(pipeline_module, "_take", "read source rows")
    patch(PromptEncoder, "encode_batch", "render + tokenize")
    client_module.orjson = TimedOrjson(client_module.orjson)  # type: ignore[assignment]
    patch(client_module.GenerateClient, "request_body", "encode request JSON")
    patch(client_module, "parse_generation", "check answer")
    patch(results_module, "parse_generation", "check answer")
    patch(pipeline_module, "pending_row", "build row")
    patch(pipeline_module, "finish_rows", "shard: row fields from output ids")
    patch(shards, "rows_table", "shard: rows to Arrow")
    patch(shards, "_encode_table", "shard: encode Parquet")
    patch(shards, "count_table", "shard: token counts")
    patch(shards, "build_marker", "shard: build marker")
    patch(shards, "_write_step", "shard: write files")
    patch(shards, "put_record", "shard: write marker")
    patch(commit_index.DatasetIndex, "fold", "commit bookkeeping (fold)")
    patch(pipeline_module, "take_checkpoint", "commit bookkeeping (checkpoint)")
    patch(pipeline_module.Runner, "_record_row", "record row (buffer, counts)")
    patch(pipeline_module.Runner, "snapshot", "progress")
    patch(progress.ThroughputMeter, "record", "progress")
    for name in ("answered", "committed", "set_in_flight", "set_remaining"):
        patch(metrics.RunnerMetrics, name, "metrics")


def count_collections() -> None:
    """The cyclic garbage collector's time, as a stage of its own (it runs inside whatever allocates)."""
    import gc

    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.thread_time())
        elif started:
            spent = time.thread_time() - started.pop()
            SPENT[f"garbage collection (gen {info['generation']})"] += spent
            CALLS[f"garbage collection (gen {info['generation']})"] += 1  # also inside the stage it interrupted

    gc.callbacks.append(callback)


def run(spec_path: Path, url: str, concurrency: int, profile: str | None) -> tuple[float, float, int]:
    resource = load_spec_file(spec_path)
    spec = resource.spec.model_copy(update={"runner": resource.spec.runner.model_copy(
        update={"concurrency": concurrency})})
    config = RunnerConfig(spec=spec, servers=[url], output_uri=spec.output.uri, progress_log_s=3600)

    async def go() -> tuple[float, float, int]:
        runner = await prepare(config, api_key=None)
        SPENT.clear()
        CALLS.clear()
        profiler = cProfile.Profile(time.thread_time) if profile else None  # the loop thread's CPU
        wall, cpu = time.perf_counter(), time.process_time()
        if profiler:
            profiler.enable()
        with stream_settings():  # as `tokenmill run` does
            summary = await runner.run()
        if profiler:
            profiler.disable()
            profiler.dump_stats(profile)
        return time.perf_counter() - wall, time.process_time() - cpu, summary.datasets[0].generated

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3000, help="samples in all (prompts x samples per prompt)")
    parser.add_argument("--samples-per-prompt", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--time-scale", type=float, default=20000.0)
    parser.add_argument("--cprofile", help="write a cProfile of the run's loop thread here, stages not wrapped")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not args.cprofile:
        instrument()
        count_collections()
    simulator, url = start_simulator(max_running=args.concurrency, time_scale=args.time_scale)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prompts = args.samples // args.samples_per_prompt
            spec_path = write_workload(Path(tmp), prompts, args.max_new_tokens, args.samples_per_prompt)
            wall, cpu, generated = run(spec_path, url, args.concurrency, args.cprofile)
    finally:
        simulator.terminate()
        simulator.wait()
    per = 1000.0 / generated
    print(f"{generated} samples ({args.samples_per_prompt} per prompt), concurrency {args.concurrency}, "
          f"{wall:.1f} s wall, {generated / wall:.0f} samples/s, {cpu / generated * 1000:.3f} ms CPU per sample")
    print(f"{'stage':<36}{'ms CPU / sample':>16}{'share':>8}{'calls':>9}")
    for stage, spent in sorted(SPENT.items(), key=lambda item: -item[1]):
        print(f"{stage:<36}{spent * per:>16.3f}{spent / cpu:>8.1%}{CALLS[stage]:>9}")
    rest = cpu - sum(SPENT.values())
    print(f"{'event loop + HTTP client (the rest)':<36}{rest * per:>16.3f}{rest / cpu:>8.1%}")


if __name__ == "__main__":
    main()
