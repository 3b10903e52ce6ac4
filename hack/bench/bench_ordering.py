#!/usr/bin/env python3
"""Makespan / lower bound of a long-tailed job by admission order: FCFS (source order), longest-expected-first in a
bounded window alone (the runner before issue 44), the runner's whole-job order (runner/tokenmill_runner/generate/
ordering.py: the probe, the passes planned from the counting pass's length codes, the window; input order after the
probe when the key is weak), the whole job sorted by the key, and longest-first with the true lengths known, side by
side in one run. Not a test.

The engine is the planner's continuous-batching simulation (facts/workload.py `simulate`): `slots` requests run at
once, a freed slot admits the next request at once, one token per request per step, prefill free: an ideal server,
so the ratio is the order's alone. Lower bound: max(total tokens / slots, the longest request).

Lengths: the seeds' profile (log-normal, median 470, p90 3,700, cut at 10,240: DESIGN.md). Each row's earlier
answer and its regenerated one are correlated log-normals, corr(ln old, ln new) = rho. Assumed rho = 0.8: the
same prompt asks for the same kind of answer (a tool call stays short, a proof stays long), and sampling at
temperature 0.6 moves the length by a factor of ~1.5-2 either way (exp(sigma x sqrt(1 - rho^2)) = 2.2 at the
seeds' sigma 1.6); 0.5 and 0.95 show how much the result depends on it, 0.2 a key that says nearly nothing.
`kept` is the share of what sorting the whole job by the key gains over FCFS that the runner's order keeps.

    .venv/bin/python hack/bench/bench_ordering.py [--samples 10000] [--slots 64] [--seed 7]
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
from tokenmill_runner.generate.ordering import (  # noqa: E402
    Cell,
    KeyCheck,
    LongestFirst,
    ReadProgress,
    plan_passes,
    probe_size,
    window_size,
)
from tokenmill_runner.source.length_key import CODES, answer_code  # noqa: E402

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


def runner_order(pairs: list[tuple[int, int]], window: int) -> tuple[list[int], bool]:
    """The regenerated lengths in the order the runner sends them now, and whether the probe found the key weak:
    the probe (the first lines, as they come), then the passes over the length codes through the window, or the
    rest in source order when the probe's correlation is under WEAK_KEY (the ideal engine returns the probe before
    the passes start: the earliest a verdict can come)."""
    codes = [answer_code(old) for old, _ in pairs]
    probe = probe_size(len(pairs))
    order = [new for _, new in pairs[:probe]]
    check = KeyCheck(size=probe, closed=True)
    for slot, (old, new) in enumerate(pairs[:probe]):
        check.sent(slot, float(old))
        check.back(slot, new)
    weak = bool(probe) and check.weak is True
    progress = ReadProgress(probe_end=probe)
    counts = [0] * CODES
    for code in codes[probe:]:
        counts[code] += 1
    buffer: LongestFirst[int] = LongestFirst(window)
    if weak:
        buffer.in_arrival_order()
    passes = [{0: frozenset(range(CODES))}] if weak else plan_passes(
        [Cell(0, code, count, 2.0 ** code) for code, count in enumerate(counts)], window)
    for one in passes:
        progress.begin(one.get(0, frozenset()))
        for line, ((old, new), code) in enumerate(zip(pairs, codes, strict=True), start=1):
            if progress.in_pass(line, code):
                released = buffer.push(new, float(old))
                if released is not None:
                    order.append(released)
        progress.end()
    return order + list(buffer.drain()), weak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args(argv)
    window = window_size(args.slots)
    print(f"{args.samples:,} samples, {args.slots} slots, window {window:,} (the runner's for concurrency "
          f"{args.slots}); makespan / lower bound, mean of {args.trials} draws")
    header = ("rho", "FCFS", "window", "runner", "weak", "sorted", "known", "kept")
    widths = (5, 7, 8, 8, 6, 8, 7, 7)
    print(" ".join(f"{name:>{width}}" for name, width in zip(header, widths, strict=True)))
    for rho in (0.2, 0.5, 0.8, 0.95):
        rows: dict[str, list[float]] = {k: [] for k in ("fcfs", "window", "runner", "weak", "whole", "known")}
        for trial in range(args.trials):
            pairs = lengths(args.samples, rho, random.Random(args.seed * 1000 + trial))
            outputs = [new for _, new in pairs]
            bound = lower_bound(outputs, args.slots)
            rows["fcfs"].append(makespan(outputs, args.slots) / bound)
            rows["window"].append(makespan(windowed(pairs, window), args.slots) / bound)
            order, weak = runner_order(pairs, window)
            assert sorted(order) == sorted(outputs), "every request once"
            rows["runner"].append(makespan(order, args.slots) / bound)
            rows["weak"].append(float(weak))
            rows["whole"].append(makespan(windowed(pairs, len(pairs)), args.slots) / bound)
            rows["known"].append(makespan(sorted(outputs, reverse=True), args.slots) / bound)
        mean = {k: sum(v) / len(v) for k, v in rows.items()}
        gain = mean["fcfs"] - mean["whole"]
        kept = f"{(mean['fcfs'] - mean['runner']) / gain:.0%}" if gain > 1e-3 else "-"
        print(f"{rho:>5} {mean['fcfs']:>7.3f} {mean['window']:>8.3f} {mean['runner']:>8.3f} {mean['weak']:>6.2f} "
              f"{mean['whole']:>8.3f} {mean['known']:>7.3f} {kept:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
