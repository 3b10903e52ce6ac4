#!/usr/bin/env python3
"""The simulator's scheduler model (tokenmill_sim/capacity.py): CPU per 10,000 requests, and the admission estimate
kept as running sums against the same model recomputing it over every running request, side by side in one run.

Workloads: the seeds' function-calling lengths (the glaive profile, max_new_tokens 10240) on 256 slots with a pool
that never binds (slot-bound, the default), and on a pool that does (KV-bound: admission by estimate, retractions).
Reported: wall seconds, requests per CPU second, wake-ups, retractions, and the speed ratio. Not a test.

    .venv/bin/python hack/bench/bench_sim_capacity.py [--requests 20000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runner"))
sys.path.insert(0, str(REPO / "runner" / "sim"))

from tokenmill_sim.capacity import CapacityModel, Job, SchedulerParams  # noqa: E402
from tokenmill_sim.profiles import PROFILES  # noqa: E402


class RecomputingModel(CapacityModel):
    """The same model with the admission estimate summed over the running requests at every admission."""

    def expected_tokens(self) -> int:
        step = self.step
        return sum(job.estimate(job.generated_at(step)) for job in self._running)  # noqa: SLF001


def jobs(count: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [Job(rng.randrange(100, 1500), min(10240, PROFILES["glaive"].draw(rng)), 0.0, max_new_tokens=10240)
            for _ in range(count)]


def run(model: CapacityModel, work: list[Job]) -> tuple[float, int]:
    started = time.process_time()
    for job in work:
        model.submit(job)
    wakeups = 0
    while (when := model.next_event_time()) is not None:
        model.advance_to(when)
        wakeups += 1
    return time.process_time() - started, wakeups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    count = parser.parse_args().requests
    pools = {"slot-bound (pool 4M tokens)": 4_000_000, "KV-bound (pool 100k tokens)": 100_000}
    print(f"{count} requests, 256 slots, glaive lengths capped at 10240")
    print(f"{'workload':32} {'model':12} {'CPU s':>7} {'req/CPU s':>10} {'wake-ups':>9} {'retracted':>9}")
    for name, pool in pools.items():
        cpu = {}
        for label, cls in (("sums", CapacityModel), ("recompute", RecomputingModel)):
            model = cls(SchedulerParams(max_running_requests=256, max_total_tokens=pool))
            seconds, wakeups = run(model, jobs(count, 3))
            cpu[label] = seconds
            print(f"{name:32} {label:12} {seconds:7.2f} {count / seconds:10.0f} {wakeups:9d} "
                  f"{model.retracted_total:9d}")
        print(f"{'':32} {'ratio':12} {cpu['recompute'] / cpu['sums']:7.1f}x faster with running sums")


if __name__ == "__main__":
    main()
