"""The job as the planner sees it: the seeds' output-length shape, the tail's weight in the KV cache, and the job
time of continuous batching with its draining tail (DESIGN.md "Throughput: the tail decides the makespan")."""

from __future__ import annotations

import statistics

from tokenmill_runner.facts.workload import DatasetLoad, Workload, job_time, simulate


def seeds_like(samples: int = 10000, cap: int = 10240) -> Workload:
    return Workload((DatasetLoad("B1_glaive", samples, True, cap),))


def test_output_lengths_have_the_seeds_shape():
    # DESIGN.md: median ~470, mean ~1360, p90 ~3700, 3 % at the 10,240 cap.
    lengths = sorted(seeds_like().datasets[0].output_lengths())
    assert abs(statistics.median(lengths) - 470) < 15
    assert abs(lengths[int(0.9 * len(lengths))] - 3700) < 150
    assert 1250 < statistics.mean(lengths) < 1450
    assert 0.02 < seeds_like().datasets[0].capped_share() < 0.04
    # A larger cap keeps the shape and cuts less.
    assert DatasetLoad("B5", 1, True, 32768).capped_share() < 0.01


def test_running_requests_hold_more_than_the_average_request():
    work = seeds_like()
    mean = work.datasets[0].mean_output()
    assert work.held > 512 + mean  # the long tail runs longest, so it dominates what the batch holds
    fixed = Workload((DatasetLoad("d", 100, True, 4096, prompt_tokens=1000, output_tokens=1000),))
    assert fixed.held == 1500


def test_continuous_batching_keeps_the_makespan_near_the_lower_bound():
    # DESIGN.md's model: step 20 ms + 0.05 ms per running request, continuous batching in input order: makespan /
    # lower bound 1.03-1.17 for 64-1024 slots. The simulation here must land in that band, not batch-and-wait's.
    work = seeds_like()
    requests = work.requests(4000)
    for slots, worst in ((64, 1.10), (256, 1.20)):
        seconds = simulate(requests, slots, lambda b: 0.020 + 0.00005 * b, lambda tokens, prompt: 0.0)
        full_batch = sum(o for _, o in requests) / (slots / (0.020 + 0.00005 * slots))
        longest = max(o for _, o in requests) * 0.020
        assert 1.0 <= seconds / max(full_batch, longest) <= worst


def test_a_larger_job_scales_at_the_steady_rate_and_replicas_share_it():
    work, larger = seeds_like(4000), seeds_like(40000)
    def step(b: int) -> float:
        return 0.020 + 0.00005 * b
    small = job_time(work, 1, 128, step, lambda t, p: 0.0)
    big = job_time(larger, 1, 128, step, lambda t, p: 0.0)
    two = job_time(larger, 2, 128, step, lambda t, p: 0.0)
    assert 9 < big.seconds / small.seconds < 10.5
    assert two.seconds < 0.55 * big.seconds


def test_prefill_costs_time():
    work = seeds_like(2000)
    free = job_time(work, 1, 128, lambda b: 0.03, lambda t, p: 0.0)
    costly = job_time(work, 1, 128, lambda b: 0.03, lambda t, p: 0.05)
    assert costly.seconds > free.seconds
