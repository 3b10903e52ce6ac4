#!/usr/bin/env python3
"""Peak RSS of `tokenmill run` as the input grows: prompts are streamed, so memory must stay flat.

Each size runs the real CLI in a child process against a simulator process (tiny outputs, high time scale) and
reads the child's peak RSS from wait4(), the whole run included (the counting pass, generation, commits, the
report). Not a test. The default sizes take about 75 minutes on two cores (2M prompts: ~65 min); the goal is the
largest within x1.10 of the smallest.

    .venv/bin/python hack/bench/bench_memory.py [--sizes 20000 200000 2000000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import MODEL, start_simulator  # noqa: E402


def write_inputs(folder: Path, samples: int) -> Path:
    prompts = folder / "prompts.jsonl"
    with prompts.open("w") as handle:
        for i in range(samples):
            handle.write(json.dumps({"sample_id": f"m{i:07d}", "messages": [
                {"role": "user", "content": f"Prompt number {i}: say something short about the number {i}."}]}) + "\n")
    spec = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "mem"},
            "spec": {"model": {"path": str(MODEL)}, "sampling": {"maxNewTokens": 8},
                     "datasets": [{"name": "mem", "source": str(prompts)}],
                     "runner": {"concurrency": 256, "shardMaxSamples": 2048, "shardMaxSeconds": 30},
                     "output": {"uri": str(folder / "out")}}}
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def peak_rss_mib(spec: Path, url: str) -> tuple[float, float]:
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "tokenmill_runner.cli", "-q", "run", str(spec),
                                "--server", url], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"tokenmill run failed for {spec}")
    return usage.ru_maxrss / 1024, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000, 200000, 2000000])
    args = parser.parse_args()
    simulator, url = start_simulator(max_running=256, time_scale=100000.0)
    results = []
    try:
        for size in args.sizes:
            with tempfile.TemporaryDirectory() as tmp:
                rss, seconds = peak_rss_mib(write_inputs(Path(tmp), size), url)
                results.append((size, rss, seconds))
                print(f"{size:>8} prompts: peak RSS {rss:7.1f} MiB, {seconds:6.1f} s", flush=True)
    finally:
        simulator.terminate()
        simulator.wait()
    small, small_rss, _ = results[0]
    for large, large_rss, _ in results[1:]:
        print(f"peak RSS ratio {large}/{small} prompts: {large_rss / small_rss:.3f}x "
              f"({(large_rss - small_rss) * 1024 * 1024 / (large - small):.1f} bytes per extra prompt)")


if __name__ == "__main__":
    main()
