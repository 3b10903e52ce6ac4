"""One simulated server as a /metrics scraper sees it: a closed-loop run of the capacity model (tokenmill's runner
keeps `inflight` requests outstanding, ramping it up over `ramp_s` as a runner does at start), read every `interval`
seconds as (time, gen_throughput, num_running_reqs, num_queue_reqs). Pure.

gen_throughput is what SGLang's gauge shows: the tokens generated since the last reading over the time since, here
times a seeded relative noise (`noise`: the standard deviation of that factor), since the real gauge is taken over a
few dozen steps whose lengths vary. The step model is the caller's "true" one, which the plan does not see.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from .capacity import CapacityModel, Job, SchedulerParams, StepTime


@dataclass(frozen=True)
class Reading:
    t: float
    gen_throughput: float
    running: int
    queued: int
    completed: int


@dataclass
class ScrapedRun:
    readings: list[Reading]
    completed: int
    generated_tokens: int
    seconds: float


def scrape(params: SchedulerParams, step_time: StepTime, jobs: Iterator[Job], inflight: int, until: float,
           interval: float = 5.0, ramp_s: float = 0.0, noise: float = 0.0, seed: int = 0) -> ScrapedRun:
    """Run `jobs` closed-loop for `until` simulated seconds and read the gauges every `interval`."""
    model = CapacityModel(params, step_time)
    rng = random.Random(seed)
    outstanding = 0
    clock = 0.0

    def target(now: float) -> int:
        if ramp_s <= 0 or now >= ramp_s:
            return inflight
        return max(1, round(inflight * now / ramp_s))

    def top_up(now: float) -> None:
        nonlocal outstanding
        while outstanding < target(now):
            job = next(jobs, None)
            if job is None:
                return
            job.arrival = now
            model.advance_to(now)
            model.submit(job)
            outstanding += 1

    readings: list[Reading] = []
    last_tokens, last_t = 0, 0.0
    top_up(0.0)
    next_read = interval
    while clock < until:
        event = model.next_event_time()
        step_to = min(next_read, until if event is None else max(event, clock))
        if ramp_s > 0 and clock < ramp_s:
            step_to = min(step_to, clock + 1.0)  # the ramp adds requests about every second
        done = model.advance_to(step_to)
        clock = step_to
        outstanding -= len(done)
        top_up(clock)
        if clock >= next_read:
            dt = clock - last_t
            rate = (model.generated_tokens - last_tokens) / dt if dt > 0 else 0.0
            rate *= max(0.0, 1.0 + rng.gauss(0.0, noise)) if noise else 1.0
            readings.append(Reading(clock, rate, model.running, model.queued, model.completed))
            last_tokens, last_t = model.generated_tokens, clock
            next_read += interval
        if event is None and outstanding == 0:
            break
    return ScrapedRun(readings, model.completed, model.generated_tokens, clock)
