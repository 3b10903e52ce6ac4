#!/usr/bin/env python3
"""The ledger and the counting pass, side by side with what they replaced. Not a test.

- counting pass: the old count (lines only) vs the new scan (parse, worker split, repeated ids spooled to bucket
  files), with the stream's own parse as the reference cost;
- ledger: folding a dataset's markers into the byte-per-slot ledger vs the old index (a set of id hashes and a
  dict of failures), time and memory held (tracemalloc).

    .venv/bin/python hack/bench/bench_ledger.py [--rows 200000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from tokenmill_runner.source.prompts import id_hash
from tokenmill_runner.source.reader import read_jsonl, read_prompts
from tokenmill_runner.source.scan import scan_source
from tokenmill_runner.store.ledger import DatasetLedger, ShardContent, build_marker


def write_source(path: Path, rows: int) -> None:
    with path.open("wb") as handle:
        for i in range(rows):
            sample = i - rows // 2 if i % 100 == 99 and i > rows // 2 else i  # 0.5 % ids repeated far apart
            handle.write(orjson.dumps({"sample_id": f"m{sample:07d}", "messages": [
                {"role": "user", "content": f"Prompt number {i}: say something short about the number {i}."}]}))
            handle.write(b"\n")


def markers(rows: int, per_shard: int = 256) -> list[dict[str, Any]]:
    built = []
    for start in range(1, rows + 1, per_shard):
        lines = range(start, min(start + per_shard, rows + 1))
        samples = [{"sample_id": f"m{line:07d}", "line": line, "sample_index": 0, "completion_tokens": 500,
                    "finish_reason": "stop"} for line in lines if line % 50]
        failures = [{"line": line, "sample_index": 0, "sample_id": f"m{line:07d}", "reason": "retries_exhausted"}
                    for line in lines if not line % 50]
        built.append(build_marker("d", f"w000-b-{start:07d}", 0, ShardContent(samples, failures), 0))
    return built


def old_index(all_markers: list[dict[str, Any]]) -> tuple[set[int], dict[int, str]]:
    """What the runner kept before: every committed id's hash in a set, final failures by line in a dict."""
    ids: set[int] = set()
    failed: dict[int, str] = {}
    generated: set[int] = set()
    for marker in all_markers:
        ids.update(id_hash(sample_id) for sample_id in marker["samples"]["sample_id"])
        failed.update(zip(marker["failed"]["line"], marker["failed"]["reason"], strict=True))
        generated.update(marker["samples"]["line"])
    return ids, {line: reason for line, reason in failed.items() if line not in generated}


def measure(work: Callable[[], Any]) -> tuple[float, int, Any]:
    tracemalloc.start()
    started = time.perf_counter()
    result = work()
    seconds = time.perf_counter() - started
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return seconds, held, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "p.jsonl"
        write_source(source, args.rows)
        timings = {}
        for name, work in [("count lines (old)", lambda: sum(1 for _ in read_jsonl(str(source)))),
                           ("scan (new)", lambda: scan_source(str(source), "jsonl")),
                           ("parse every row (the stream)", lambda: sum(1 for _ in read_prompts(str(source), "jsonl")))]:
            started = time.perf_counter()
            result = work()
            timings[name] = time.perf_counter() - started
            if name == "scan (new)":
                print(f"scan: {result.rows} rows, {len(result.duplicates)} repeated ids")
        for name, seconds in timings.items():
            print(f"{name:<30} {seconds:7.2f} s  {args.rows / seconds:>10,.0f} rows/s")
        print(f"scan / count lines: {timings['scan (new)'] / timings['count lines (old)']:.1f}x; "
              f"scan / parse: {timings['scan (new)'] / timings['parse every row (the stream)']:.2f}x")

    built = markers(args.rows)
    old_s, old_bytes, _ = measure(lambda: old_index(built))
    new_s, new_bytes, ledger = measure(lambda: DatasetLedger("d", args.rows).fold_all(built))
    print(f"fold {len(built)} markers, {args.rows} slots: ledger {new_s:.2f} s holding {new_bytes / 2**20:.1f} MiB "
          f"({new_bytes / args.rows:.1f} B/slot); old index {old_s:.2f} s holding {old_bytes / 2**20:.1f} MiB "
          f"({old_bytes / args.rows:.1f} B/slot); memory ratio old/new {old_bytes / max(new_bytes, 1):.0f}x, "
          f"time ratio old/new {old_s / new_s:.2f}x")
    assert ledger.completed + ledger.failed == args.rows


if __name__ == "__main__":
    main()
