#!/usr/bin/env python3
"""Makespan / lower bound on the simulator: the real runner (`tokenmill run`, a child process) against tokenmill's
SGLang simulator (in this process), FCFS against longest-expected-first, side by side in one run. Not a test.

bench_ordering.py measures the order alone on an ideal engine; this one measures what a user gets: the runner's
window, its refill of freed slots over HTTP, and the simulator's scheduler (SGLang's admission, step times that grow
with the batch, prefill). Makespan and lower bound are simulated seconds read from the simulator's own clock (first
admission to last completion), so the machine's speed does not enter.

The rows are single-turn conversations regenerated with `mode: all-turns` ([user, earlier answer]): the answer's
length is the ordering key and is not part of the prompt the server sees, so every pass asks the same prompts with
the same seeds and the simulator draws the same lengths (checked). Passes:
- FCFS: every earlier answer the same length, so ties keep the source's order;
- LEF rho: earlier answers whose lengths correlate with the new ones at corr(ln old, ln new) = rho (bench_ordering.py
  says why 0.8 is assumed), built from the lengths the FCFS pass measured;
- known: earlier answers exactly as long as the new ones (the order's best case).
Lower bound: every token costs at least the full batch's step time / slots, and the longest sample runs alone at
least, so max(total tokens x step(slots) / slots, longest x step(1)).

    .venv/bin/python hack/bench/bench_ordering_sim.py [--samples 1000] [--slots 64] [--time-scale 40]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import MODEL, REPO  # noqa: E402

sys.path.insert(0, str(REPO / "runner" / "sim"))

from tokenmill_runner.store.markers import read_markers  # noqa: E402
from tokenmill_runner.store.storage import LocalStorage  # noqa: E402
from tokenmill_sim import capacity  # noqa: E402
from tokenmill_sim.config import SimConfig  # noqa: E402
from tokenmill_sim.server import SimServer  # noqa: E402

MAX_NEW_TOKENS = 10240  # the seeds' cap
CHARS_PER_WORD = 5  # "word " — the runner reads an answer's length in characters (ordering.py)


@dataclass
class Timeline:
    """First admission and last completion of the simulator's jobs, in simulated seconds."""

    first: float = math.inf
    last: float = 0.0
    finished: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.first, self.last, self.finished = math.inf, 0.0, []

    def record(self, jobs: list[capacity.Job]) -> None:
        for job in jobs:
            if job.admitted_at is not None:
                self.first = min(self.first, job.admitted_at)
            if job.finished_at is not None:
                self.last = max(self.last, job.finished_at)
                self.finished.append(job.output_tokens)

    @property
    def makespan(self) -> float:
        return self.last - self.first


def watch(timeline: Timeline) -> None:
    """Record every job the simulator's model finishes (the engine's one call that hands jobs out)."""
    advance = capacity.CapacityModel.advance_to

    def recording(self: capacity.CapacityModel, now: float) -> list[capacity.Job]:
        done = advance(self, now)
        timeline.record(done)
        return done

    capacity.CapacityModel.advance_to = recording  # type: ignore[method-assign]


def write_pass(folder: Path, answers: list[int]) -> Path:
    """A source of len(answers) [user, assistant] rows, the assistant's answer `answers[i]` tokens long."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "rows.jsonl").open("w") as handle:
        for i, tokens in enumerate(answers):
            answer = "word " * max(1, round(tokens * 4 / CHARS_PER_WORD))
            handle.write(json.dumps({"sample_id": f"r{i:05d}", "messages": [
                {"role": "user", "content": f"Question {i}: explain the number {i} in as many words as it takes."},
                {"role": "assistant", "content": answer}]}) + "\n")
    spec = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "tail"},
            "spec": {"model": {"path": str(MODEL)}, "sampling": {"maxNewTokens": MAX_NEW_TOKENS},
                     "datasets": [{"name": "tail", "source": str(folder / "rows.jsonl"), "mode": "all-turns"}],
                     "runner": {"concurrency": 0, "shardMaxSamples": 256, "shardMaxSeconds": 30},
                     "output": {"uri": str(folder / "out")}}}
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_pass(spec: Path, url: str, slots: int) -> dict[int, int]:
    document = yaml.safe_load(spec.read_text())
    document["spec"]["runner"]["concurrency"] = slots
    spec.write_text(yaml.safe_dump(document))
    done = subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "-q", "run", str(spec), "--server", url],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"tokenmill run failed ({done.returncode}): {done.stderr[-2000:]}")
    storage = LocalStorage(spec.parent / "out")
    lengths: dict[int, int] = {}
    for marker in read_markers(storage, "tail"):
        lengths.update(zip(marker["samples"]["line"], marker["samples"]["completion_tokens"], strict=True))
    return lengths


def correlated(new: list[int], rho: float, rng: random.Random) -> list[int]:
    """Earlier answers with corr(ln old, ln new) = rho and the new lengths' log mean and spread."""
    logs = [math.log(n) for n in new]
    mu = sum(logs) / len(logs)
    sigma = math.sqrt(sum((x - mu) ** 2 for x in logs) / len(logs)) or 1.0
    noise = math.sqrt(1 - rho * rho)
    return [max(1, round(math.exp(mu + sigma * (rho * (x - mu) / sigma + noise * rng.gauss(0, 1))))) for x in logs]


def lower_bound(outputs: list[int], slots: int, step: capacity.LinearStepTime) -> float:
    return max(sum(outputs) * step.decode_seconds(slots) / slots, max(outputs) * step.decode_seconds(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=40.0)
    parser.add_argument("--profile", default="glaive", help="the simulator's length profile (glaive: the seeds')")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    timeline = Timeline()
    watch(timeline)
    config = SimConfig(model_path=str(MODEL), max_running_requests=args.slots, time_scale=args.time_scale,
                       profile=args.profile)
    step = capacity.LinearStepTime(config.step_ms, config.step_ms_per_request, config.prefill_ms_per_1k_tokens)
    rng = random.Random(args.seed)
    print(f"{args.samples:,} samples, {args.slots} slots (the simulator's --max-running-requests and the runner's "
          f"concurrency), profile {args.profile}, maxNewTokens {MAX_NEW_TOKENS:,}; simulated seconds")
    with SimServer(config) as server, tempfile.TemporaryDirectory(prefix="tokenmill-tail-") as tmp:
        results: list[tuple[str, float]] = []
        truth: dict[int, int] | None = None
        passes: list[tuple[str, float | None]] = [("FCFS", None), ("LEF rho 0.5", 0.5), ("LEF rho 0.8", 0.8),
                                                  ("LEF rho 0.95", 0.95), ("LEF known", 1.0)]
        for name, rho in passes:
            if truth is None:
                answers = [1] * args.samples
            else:
                new = [truth[line] for line in range(1, args.samples + 1)]
                answers = new if rho == 1.0 else correlated(new, rho, rng)
            timeline.reset()
            lengths = run_pass(write_pass(Path(tmp) / name.replace(" ", "-"), answers), server.url, args.slots)
            if truth is None:
                truth = lengths
            elif lengths != truth:
                raise SystemExit(f"{name}: the simulator drew other lengths than the FCFS pass; the passes differ in "
                                 "more than their order")
            results.append((name, timeline.makespan))
        outputs = list(truth.values())
        bound = lower_bound(outputs, args.slots, step)
        print(f"total {sum(outputs):,} output tokens, longest {max(outputs):,}, lower bound {bound:,.0f} s")
        fcfs = results[0][1]
        for name, seconds in results:
            print(f"{name:>13}: makespan {seconds:8,.0f} s  {seconds / bound:5.3f} x lower bound  "
                  f"{seconds / fcfs:5.3f} x FCFS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
