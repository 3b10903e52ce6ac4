#!/usr/bin/env python3
"""What counting loss tokens with every commit costs, against the runner's own CPU, measured in one run.

`tokenmill run` (in this process, against the simulator in its own process at a high time scale, as
bench_runner.py runs it) commits a workload; its process CPU time is the runner's cost, counting included. Then,
side by side, the counting's own work is timed again over that run's committed shards: what commit_shard adds to
each commit (store/token_counts.py: count_table over the shard's Arrow table, which the commit builds anyway for the
Parquet file, encode_counts, and the put of the counts file), and what a reader then pays to merge them
(dataset_frequencies). Reported: CPU per committed token and the share of the runner's CPU. Not a test.

    .venv/bin/python hack/bench/bench_token_freq.py [--samples 2000] [--max-new-tokens 1024]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_runner import run_tokenmill, start_simulator, write_workload  # noqa: E402

from tokenmill_runner.store.markers import markers_in_commit_order  # noqa: E402
from tokenmill_runner.store.shards import ROW_SCHEMA, decode_rows  # noqa: E402
from tokenmill_runner.store.storage import LocalStorage  # noqa: E402
from tokenmill_runner.store.token_counts import count_table, counts_name, dataset_frequencies, encode_counts  # noqa: E402


def counting_cpu(out: Path, scratch: Path) -> tuple[float, int, int]:
    """(CPU seconds of the counting work over every committed shard, committed tokens, shards)."""
    storage, sink = LocalStorage(out), LocalStorage(scratch)
    tables = []
    for marker in markers_in_commit_order(storage, "bench"):
        if marker.get("data"):
            rows = decode_rows(storage.get(f"bench/{marker['data']}"))
            tables.append((marker["shard_id"], pa.Table.from_pylist(rows, schema=ROW_SCHEMA)))
    tokens = 0
    started = time.process_time()
    for shard_id, table in tables:
        counts = count_table(table)
        sink.put(f"bench/{counts_name(shard_id)}", encode_counts("bench", shard_id, table.num_rows, counts))
        tokens += counts.tokens
    return time.process_time() - started, tokens, len(tables)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--time-scale", type=float, default=20000.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    simulator, url = start_simulator(max_running=args.concurrency, time_scale=args.time_scale)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            spec = write_workload(Path(tmp), args.samples, args.max_new_tokens)
            _, runner_cpu, generated = run_tokenmill(spec, url, args.concurrency)
            assert generated == args.samples, generated
            count_cpu, tokens, shards = counting_cpu(Path(tmp) / "out", Path(tmp) / "scratch")
            started = time.process_time()
            merged = dataset_frequencies(LocalStorage(Path(tmp) / "out"), "bench")
            read_cpu = time.process_time() - started
            assert merged.total == tokens, (merged.total, tokens)
    finally:
        simulator.terminate()
        simulator.wait()
    print(f"workload: {args.samples} samples, {tokens:,} committed loss tokens in {shards} shards, max_new_tokens "
          f"{args.max_new_tokens}, simulator time scale {args.time_scale:g}x, {os.cpu_count()} CPUs")
    print(f"{'':<34} {'CPU s':>8} {'ns / token':>11} {'of the runner':>14}")
    print(f"{'tokenmill run (counting included)':<34} {runner_cpu:>8.2f} {runner_cpu / tokens * 1e9:>11.1f} "
          f"{'100.00 %':>14}")
    print(f"{'counting at commit (per shard)':<34} {count_cpu:>8.3f} {count_cpu / tokens * 1e9:>11.1f} "
          f"{count_cpu / runner_cpu:>13.2%}")
    print(f"{'merging the counts (a reader)':<34} {read_cpu:>8.3f} {read_cpu / tokens * 1e9:>11.1f} "
          f"{read_cpu / runner_cpu:>13.2%}")
    print(f"goal: counting under 2 % of the runner's CPU: {'met' if count_cpu / runner_cpu < 0.02 else 'NOT met'}")


if __name__ == "__main__":
    main()
