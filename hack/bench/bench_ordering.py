#!/usr/bin/env python3
"""Makespan / lower bound of a long-tailed job by admission order: FCFS (source order) against longest-expected-
first as the runner sends it (runner/tokenmill_runner/generate/ordering.py, its bounded window included), and
longest-first with the true lengths known, side by side in one run. Not a test.

The engine is the planner's continuous-batching simulation (facts/workload.py `simulate`): `slots` requests run at
once, a freed slot admits the next request at once, one token per request per step, prefill free: an ideal server,
so the ratio is the order's alone. Lower bound: max(total tokens / slots, the longest request).

Lengths: the seeds' profile (log-normal, median 470, p90 3,700, cut at 10,240: DESIGN.md). Each row's earlier
answer and its regenerated one are correlated log-normals, corr(ln old, ln new) = rho. Assumed rho = 0.8: the
same prompt asks for the same kind of answer (a tool call stays short, a proof stays long), and sampling at
temperature 0.6 moves the length by a factor of ~1.5-2 either way (exp(sigma x sqrt(1 - rho^2)) = 2.2 at the
seeds' sigma 1.6); 0.5 and 0.95 show how much the result depends on it. Rows without an earlier answer fall back to
the prompt's length class; the `no answers` row shows that case (prompt length uncorrelated with the output: FCFS).

    .venv/bin/python hack/bench/bench_ordering.py [--samples 1000] [--slots 64] [--seed 7]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runner"))

from tokenmill_runner.facts.workload import SEEDS_MEDIAN_OUTPUT, SEEDS_SIGMA, simulate  # noqa: E402
from tokenmill_runner.generate.ordering import LongestFirst, window_size  # noqa: E402

CAP = 10240


def lengths(samples: int, rho: float, rng: random.Random) -> list[tuple[int, int]]:
    """(earlier answer, regenerated) token lengths per row."""
    pairs = []
    mu = math.log(SEEDS_MEDIAN_OUTPUT)
    for _ in range(samples):
        z1, z2 = rng.gauss(0, 1), rng.gauss(0, 1)
        old = math.exp(mu + SEEDS_SIGMA * z1)
        new = math.exp(mu + SEEDS_SIGMA * (rho * z1 + math.sqrt(1 - rho * rho) * z2))
        pairs.append((max(1, min(CAP, round(old))), max(1, min(CAP, round(new)))))
    return pairs


def makespan(order: list[int], slots: int) -> float:
    return simulate([(0, n) for n in order], slots, lambda _: 1.0, lambda _t, _p: 0.0)


def lower_bound(outputs: list[int], slots: int) -> float:
    return max(sum(outputs) / slots, max(outputs))


def windowed(pairs: list[tuple[int, int]], window: int, key_of_old: bool = True) -> list[int]:
    """The regenerated lengths in the order the runner's window releases them (key: the earlier answer)."""
    buffer: LongestFirst[int] = LongestFirst(window)
    order = []
    for old, new in pairs:
        released = buffer.push(new, float(old) if key_of_old else 0.0)
        if released is not None:
            order.append(released)
    return order + list(buffer.drain())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args(argv)
    window = window_size(args.slots)
    print(f"{args.samples:,} samples, {args.slots} slots, window {window:,} (the runner's for concurrency "
          f"{args.slots}); makespan / lower bound, mean of {args.trials} draws")
    header = ("rho", "FCFS", "LEF window", "LEF whole", "window/4", "known", "no answers")
    print(" ".join(f"{name:>{width}}" for name, width in zip(header, (5, 6, 11, 10, 9, 6, 11), strict=True)))
    for rho in (0.5, 0.8, 0.95):
        rows: dict[str, list[float]] = {k: [] for k in ("fcfs", "window", "whole", "small", "known", "none")}
        for trial in range(args.trials):
            pairs = lengths(args.samples, rho, random.Random(args.seed * 1000 + trial))
            outputs = [new for _, new in pairs]
            bound = lower_bound(outputs, args.slots)
            rows["fcfs"].append(makespan(outputs, args.slots) / bound)
            rows["window"].append(makespan(windowed(pairs, window), args.slots) / bound)
            rows["whole"].append(makespan(windowed(pairs, len(pairs)), args.slots) / bound)
            rows["small"].append(makespan(windowed(pairs, max(1, window // 4)), args.slots) / bound)
            rows["known"].append(makespan(sorted(outputs, reverse=True), args.slots) / bound)
            rows["none"].append(makespan(windowed(pairs, window, key_of_old=False), args.slots) / bound)
        mean = {k: sum(v) / len(v) for k, v in rows.items()}
        print(f"{rho:>5} {mean['fcfs']:>6.3f} {mean['window']:>11.3f} {mean['whole']:>10.3f} {mean['small']:>9.3f} "
              f"{mean['known']:>6.3f} {mean['none']:>11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
