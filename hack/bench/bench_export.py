#!/usr/bin/env python3
"""`tokenmill export` speed and memory, side by side with reading the same committed shards and nothing else.

Builds a run's committed output of N samples (the commit protocol of shards.py; prompt and output lengths drawn
from the seeds' long tail: median ~470, mean ~1360 output tokens), then, each in a child process: read every shard
(the floor), and export it as specforge, speculators and hf. Reports units/s, tokens/s, the time relative to the
read floor, and peak RSS; run with two sizes to see that memory does not grow with the run. Not a test.

    .venv/bin/python hack/bench/bench_export.py [--sizes 2000 8000]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

CHILD = """
import sys
from pathlib import Path
what, run, dest = sys.argv[1], sys.argv[2], sys.argv[3]
if what == "read":
    from tokenmill_runner.store.shards import read_committed_rows
    from tokenmill_runner.store.storage import open_storage
    sum(len(r["output_ids"]) for r in read_committed_rows(open_storage(run), "bench"))
else:
    from tokenmill_runner.export.exporter import ExportRequest, export
    export(ExportRequest(run, dest, what))
"""


def build_run(folder: Path, samples: int, shard: int = 256) -> int:
    from tokenmill_runner.store.ledger import ShardContent
    from tokenmill_runner.store.shards import commit_shard
    from tokenmill_runner.store.storage import LocalStorage

    rng = random.Random(0)
    storage = LocalStorage(folder)
    tokens = 0
    rows = []
    for i in range(samples):
        output = min(int(rng.lognormvariate(6.15, 1.2)) + 1, 10240)
        prompt = rng.randint(80, 1500)
        ids = [rng.randrange(1000) for _ in range(prompt + output)]
        rows.append({"sample_id": f"b{i:07d}", "dataset": "bench", "line": i + 1, "prompt_ids": ids[:prompt],
                     "output_ids": ids[prompt:], "prompt_tokens": prompt, "completion_tokens": output,
                     "finish_reason": "length" if output == 10240 else "stop", "matched_stop": None,
                     "reasoning_end": None, "reasoning_end_token_id": None, "has_tool_call": False,
                     "max_new_tokens": 10240, "latency_s": 1.0, "attempts": 1})
        tokens += prompt + output
        if len(rows) == shard:
            commit_shard(storage, "bench", f"w000-bench-{i:07d}", 0, ShardContent(rows, []))
            rows = []
    if rows:
        commit_shard(storage, "bench", "w000-bench-last", 0, ShardContent(rows, []))
    storage.put("run.json", orjson.dumps({"spec": {"datasets": [{"name": "bench", "source": "-"}]},
                                          "tokenizer": {"vocab_size": 1000}}))
    return tokens


def measure(what: str, run: Path, dest: Path) -> tuple[float, float]:
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", CHILD, what, str(run), str(dest)])
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{what} failed")
    return time.perf_counter() - started, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000])
    args = parser.parse_args()
    print(f"{'samples':>8} {'what':<12} {'seconds':>8} {'units/s':>9} {'Mtok/s':>7} {'x read':>7} {'peak MiB':>9}")
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            tokens = build_run(run, size)
            floor = None
            for what in ("read", "specforge", "speculators", "hf"):
                seconds, peak = measure(what, run, Path(tmp) / what)
                floor = floor or seconds
                print(f"{size:>8} {what:<12} {seconds:>8.2f} {size / seconds:>9,.0f} {tokens / seconds / 1e6:>7.2f} "
                      f"{seconds / floor:>7.2f} {peak:>9.0f}")


if __name__ == "__main__":
    main()
