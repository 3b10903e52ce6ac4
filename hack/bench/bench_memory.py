#!/usr/bin/env python3
"""Peak RSS of `tokenmill run` as the input grows: prompts are streamed, so memory must stay flat. Not a test.

Per size, four processes in order, each the real CLI in a child process against one simulator process (tiny
outputs, high time scale), each's peak RSS read from wait4():
1. `tokenmill run` from scratch, stopped with SIGINT once half the samples are committed (the counting pass, half
   of the generation, its commits);
2. `tokenmill run` again, resuming it to the end;
3. `tokenmill run` again with nothing left (start-up and the skip over settled lines only);
4. `tokenmill report`.
Sizes run in the order given; the goal (issue 44) is each phase's peak within x1.10 of the smallest size's.
Peaks are read from a thin child process between this one and the CLI (tests/integration/peak_rss.py: Linux keeps
a process's peak across fork and exec, so a child of a large parent would report the parent's).

    .venv/bin/python hack/bench/bench_memory.py [--sizes 20000 200000] [--shard-max-samples 256]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import MODEL, REPO, start_simulator  # noqa: E402

PEAK_RSS = REPO / "tests" / "integration" / "peak_rss.py"
LIMIT_KB = 8 * 1024 * 1024
PHASES = ("run, stopped at 50 %", "resume to the end", "resume, nothing left", "tokenmill report")


def write_inputs(folder: Path, samples: int, shard_max_samples: int) -> Path:
    prompts = folder / "prompts.jsonl"
    with prompts.open("w") as handle:
        for i in range(samples):
            handle.write(json.dumps({"sample_id": f"m{i:07d}", "messages": [
                {"role": "user", "content": f"Prompt number {i}: say something short about the number {i}."}]}) + "\n")
    spec = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "mem"},
            "spec": {"model": {"path": str(MODEL)}, "sampling": {"maxNewTokens": 8},
                     "datasets": [{"name": "mem", "source": str(prompts)}],
                     "runner": {"concurrency": 256, "shardMaxSamples": shard_max_samples, "shardMaxSeconds": 30},
                     "output": {"uri": str(folder / "out")}}}
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def committed(out: Path) -> int:
    """Samples in the markers written so far (their names: <time>-<shard>.json; counted from the files)."""
    total = 0
    for marker in (out / "mem" / "commits").glob("*.json"):
        try:
            total += len(json.loads(marker.read_bytes())["samples"]["line"])
        except (OSError, ValueError, KeyError):
            continue
    return total


def measured(command: list[str], stop_at: tuple[Path, int] | None = None) -> tuple[float, float, int]:
    """(peak RSS MiB, seconds, exit code) of `command`; with `stop_at` (output, samples), SIGINT once that many are
    committed."""
    started = time.perf_counter()
    wrapper = subprocess.Popen([sys.executable, str(PEAK_RSS), str(LIMIT_KB), *command], stdout=subprocess.PIPE)
    if stop_at is not None:
        out, samples = stop_at
        while wrapper.poll() is None and committed(out) < samples:
            time.sleep(0.5)
        child = subprocess.run(["pgrep", "-P", str(wrapper.pid)], capture_output=True, text=True).stdout.split()
        for pid in child:
            subprocess.run(["kill", "-INT", pid], check=False)
    text, _ = wrapper.communicate()
    answer = json.loads(text.decode().strip().splitlines()[-1])
    return answer["peak_kb"] / 1024, time.perf_counter() - started, answer["code"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000, 200000])
    parser.add_argument("--shard-max-samples", type=int, default=256)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    simulator, url = start_simulator(max_running=256, time_scale=100000.0)
    cli = [sys.executable, "-m", "tokenmill_runner.cli", "-q"]
    results: dict[int, list[tuple[float, float, int]]] = {}
    try:
        for size in args.sizes:
            with tempfile.TemporaryDirectory(prefix="tokenmill-mem-") as tmp:
                spec = write_inputs(Path(tmp), size, args.shard_max_samples)
                out = Path(tmp) / "out"
                run = [*cli, "run", str(spec), "--server", url]
                phases = [measured(run, (out, size // 2)), measured(run), measured(run),
                          measured([*cli, "report", str(out)])]
                results[size] = phases
                for name, (rss, seconds, code) in zip(PHASES, phases, strict=True):
                    print(f"{size:>9,} prompts  {name:<22} peak RSS {rss:7.1f} MiB  {seconds:7.1f} s  exit {code}",
                          flush=True)
    finally:
        simulator.send_signal(signal.SIGTERM)
        simulator.wait()
    small = args.sizes[0]
    for size in args.sizes[1:]:
        for number, name in enumerate(PHASES):
            a, b = results[small][number][0], results[size][number][0]
            print(f"{name:<22} {size:,} / {small:,} prompts: x{b / a:.3f} ({(b - a) * 1024 * 1024 / (size - small):.1f} "
                  "bytes per extra prompt; goal x1.10)")
    if args.json:
        Path(args.json).write_text(json.dumps({str(size): phases for size, phases in results.items()}, indent=1))


if __name__ == "__main__":
    main()
