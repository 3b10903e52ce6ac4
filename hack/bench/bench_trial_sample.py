#!/usr/bin/env python3
"""What a trial candidate's stratified sample costs its runner before the first request: the extra pass over each
dataset's source that finds the sample's rows (rows not in it are skipped unparsed, runner/tokenmill_runner/
generate/pipeline.py `_wanted`), beside the pass the job's own stream makes (every row parsed), on the same file in
one run, JSONL and Parquet. Not a test.

    .venv/bin/python hack/bench/bench_trial_sample.py [--rows 100000] [--prompts 638] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runner"))

import orjson  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from tokenmill_runner.source.reader import read_prompts  # noqa: E402
from tokenmill_runner.source.stratified import SourceRows, first_lines  # noqa: E402


def row(i: int) -> dict:
    text = f"Question {i}: " + "explain the steps of this derivation carefully. " * 20  # ~1 KB, a typical prompt
    return {"sample_id": f"s{i:07d}", "messages": [{"role": "user", "content": text}]}


def timed(source: str, fmt: str, wanted, repeat: int) -> tuple[float, int]:
    best, count = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        count = sum(1 for _ in read_prompts(source, fmt, wanted=wanted))
        best = min(best, time.perf_counter() - start)
    return best, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--prompts", type=int, default=638, help="the sample's rows (the seeds' job: 638)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    lines = first_lines("1", 0, 3, args.prompts, {"d": 1000.0}, [SourceRows("d", args.rows)])["d"]
    with tempfile.TemporaryDirectory() as folder:
        jsonl = Path(folder) / "d.jsonl"
        jsonl.write_bytes(b"\n".join(orjson.dumps(row(i)) for i in range(args.rows)) + b"\n")
        parquet = Path(folder) / "d.parquet"
        pq.write_table(pa.Table.from_pylist([row(i) for i in range(args.rows)]), parquet, row_group_size=10_000)
        print(f"{args.rows:,} rows (~{jsonl.stat().st_size / 1e6:,.0f} MB JSONL), a sample of {len(lines):,}")
        print("| format | stream pass (every row parsed) | sample pass (its rows only) | sample / stream |")
        print("|---|---:|---:|---:|")
        for fmt, path in (("jsonl", jsonl), ("parquet", parquet)):
            stream, parsed = timed(str(path), fmt, None, args.repeat)
            sample, found = timed(str(path), fmt, lambda line: line in lines, args.repeat)
            assert parsed == args.rows and found == len(lines), (parsed, found)
            print(f"| {fmt} | {stream:.2f} s | {sample:.2f} s | {sample / stream:.2f} |")


if __name__ == "__main__":
    main()
