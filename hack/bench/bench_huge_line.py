#!/usr/bin/env python3
"""Peak RSS of `tokenmill run` with one huge JSONL line between two good rows, against the same file without it.

The line is refused as prompt_too_long before it is parsed or tokenized (runner/tokenmill_runner/source/row_size.py),
so the peak must not grow with its size; before the bound a 20 MB line peaked at 3.7 GB. Each size runs the real CLI
in a child process against one simulator process and reads the child's peak RSS from wait4(). Not a test.

    .venv/bin/python hack/bench/bench_huge_line.py [--megabytes 20 200]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import peak_rss_mib  # noqa: E402
from bench_runner import MODEL, start_simulator  # noqa: E402

WORDS = b"the quick brown fox jumps over the lazy dog " * (1024 * 1024 // 44)  # about a megabyte


def write_inputs(folder: Path, megabytes: int) -> Path:
    """Two good rows around a row of `megabytes` of words, written a megabyte at a time (a child's wait4 peak
    counts what its parent held when it forked)."""
    prompts = folder / "prompts.jsonl"
    good = [orjson.dumps({"sample_id": f"g{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]})
            for i in (1, 2)]
    with prompts.open("wb") as handle:
        handle.write(good[0] + b"\n")
        if megabytes:
            handle.write(b'{"sample_id":"huge","messages":[{"role":"user","content":"')
            for _ in range(megabytes):
                handle.write(WORDS)
            handle.write(b'"}]}\n')
        handle.write(good[1] + b"\n")
    spec = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "huge"},
            "spec": {"model": {"path": str(MODEL)}, "sampling": {"maxNewTokens": 8},
                     "datasets": [{"name": "huge", "source": str(prompts)}],
                     "output": {"uri": str(folder / "out")}}}
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=int, nargs="+", default=[20, 200])
    args = parser.parse_args()
    simulator, url = start_simulator(max_running=64, time_scale=100000.0)
    try:
        rows = []
        for megabytes in [0, *args.megabytes]:
            with tempfile.TemporaryDirectory() as tmp:
                rss, seconds = peak_rss_mib(write_inputs(Path(tmp), megabytes), url)
            rows.append((megabytes, rss, seconds))
    finally:
        simulator.terminate()
        simulator.wait()
    baseline = rows[0][1]
    print(f"{'huge line':>10} {'peak RSS':>10} {'vs none':>8} {'time':>7}")
    for megabytes, rss, seconds in rows:
        print(f"{megabytes:>7} MB {rss:>6.0f} MiB {rss / baseline:>7.2f}x {seconds:>6.1f}s")


if __name__ == "__main__":
    main()
