"""The simulator's scheduler model (tokenmill_sim/capacity.py) and prefix cache (radix.py), pure.

SGLang facts the assertions rest on (the module docstring cites each): admission by estimate, prompt +
min(max_new_tokens, 4096) against the free pool minus min(remaining, 4096) x new_token_ratio of the running requests
(0.5.9 managers/schedule_policy.py:445-467, 734-745); new_token_ratio 0.7 -> 0.098 over 600 steps (0.5.9
managers/scheduler.py:811-823, environ.py:225-229); retraction of the requests with the fewest generated tokens
when the next decode step does not fit, back to the end of the queue (0.5.9 managers/schedule_batch.py:1847-1904,
managers/scheduler.py:2254-2255); cached_tokens = the prompt's prefix (all but its last token) found in the radix cache
(0.5.9 managers/schedule_batch.py:895-901).
"""

from __future__ import annotations

import random
import time

import pytest

from tokenmill_sim.capacity import CLIP_MAX_NEW_TOKENS, CapacityModel, Job, LinearStepTime, SchedulerParams
from tokenmill_sim.profiles import PROFILES
from tokenmill_sim.radix import PrefixCache

STEP = LinearStepTime()


def drain(model: CapacityModel, check=None) -> list[Job]:
    done: list[Job] = []
    while (when := model.next_event_time()) is not None:
        done += model.advance_to(when)
        if check is not None:
            check(model)
    return done


def concurrency_peak(jobs: list[Job]) -> int:
    events = sorted([(j.admitted_at, 1) for j in jobs] + [(j.finished_at, -1) for j in jobs])
    level = peak = 0
    for _, delta in events:  # ends sort before starts at the same instant: a slot is reused at its step boundary
        level += delta
        peak = max(peak, level)
    return peak


def test_never_more_than_max_running_requests() -> None:
    model = CapacityModel(SchedulerParams(max_running_requests=8))
    rng = random.Random(1)
    jobs: list[Job] = []
    done: list[Job] = []
    now = 0.0
    for _ in range(300):
        now += rng.expovariate(20.0)
        done += model.advance_to(now)
        assert model.running <= 8
        job = Job(rng.randrange(10, 2000), rng.randrange(1, 400), now)
        model.submit(job)
        jobs.append(job)
    done += drain(model)
    assert sorted(map(id, done)) == sorted(map(id, jobs))
    assert concurrency_peak(jobs) == 8
    for job in jobs:
        assert job.arrival <= job.admitted_at < job.first_token_at <= job.finished_at


def test_makespan_of_equal_requests_matches_the_step_arithmetic() -> None:
    step = LinearStepTime(step_ms=20.0, step_ms_per_request=0.05, prefill_ms_per_1k_tokens=30.0)
    model = CapacityModel(SchedulerParams(max_running_requests=16), step)
    jobs = [Job(1000, 100, 0.0) for _ in range(32)]
    for job in jobs:
        model.submit(job)
    drain(model)
    batch = 100 * step.decode_seconds(16) + step.prefill_seconds(16 * 1000)
    assert max(j.finished_at for j in jobs) == pytest.approx(2 * batch)
    first, second = jobs[:16], jobs[16:]
    assert all(j.finished_at == pytest.approx(batch) for j in first)
    assert all(j.admitted_at == pytest.approx(batch) for j in second)  # they waited one full batch
    ttft = step.decode_seconds(16) + step.prefill_seconds(16 * 1000)
    assert all(j.first_token_at - j.arrival == pytest.approx(ttft) for j in first)
    assert model.generated_tokens == 32 * 100


def test_admission_reserves_the_estimate_not_the_true_length() -> None:
    # Nothing running: each newcomer reserves prompt + min(max_new_tokens, 4096) in full, and the first that does
    # not fit stops admission. 3000 - 550 * 5 = 250 < 550: five join although each will use only 100 tokens.
    model = CapacityModel(SchedulerParams(max_running_requests=100, max_total_tokens=3000))
    jobs = [Job(500, 50, 0.0, max_new_tokens=50) for _ in range(9)]
    for job in jobs:
        model.submit(job)
    model.advance_to(0.0)
    assert model.running == 5 and model.queued == 4
    assert model.used_tokens() == 5 * (500 + 1)  # prompts plus the first token of each (step 0 has begun)
    # The clip: max_new_tokens far above 4096 reserves 4096.
    clipped = CapacityModel(SchedulerParams(max_total_tokens=10_000))
    for _ in range(3):
        clipped.submit(Job(100, 10, 0.0, max_new_tokens=100_000))
    clipped.advance_to(0.0)
    assert clipped.running == 2 and 2 * (100 + CLIP_MAX_NEW_TOKENS) < 10_000 < 3 * (100 + CLIP_MAX_NEW_TOKENS)


def test_running_requests_are_counted_at_the_decaying_ratio() -> None:
    params = SchedulerParams(max_running_requests=100, max_total_tokens=20_000, admission_check_steps=1)
    model = CapacityModel(params, LinearStepTime(prefill_ms_per_1k_tokens=0.0))
    model.submit(Job(100, 5000, 0.0, max_new_tokens=8000))
    decay = (0.7 - 0.7 * 0.14) / 600
    model.advance_to(0.0)
    assert model.new_token_ratio == pytest.approx(0.7 - decay)  # step 0 has begun
    dt = STEP.decode_seconds(1)
    model.advance_to(99.5 * dt)  # 100 steps begun
    assert model.new_token_ratio == pytest.approx(0.7 - 100 * decay)
    # A newcomer joins once 20000 - used - ratio * 4096 exceeds its own prompt + 4096.
    model.submit(Job(100, 10, model.boundary, max_new_tokens=8000))
    budget = 20_000 - model.used_tokens() - model.new_token_ratio * CLIP_MAX_NEW_TOKENS
    model.advance_to(model.boundary)
    assert model.running == (2 if 100 + CLIP_MAX_NEW_TOKENS < budget else 1) == 2
    model.advance_to(10_000.0)
    assert model.running == 0 and model.new_token_ratio == pytest.approx(0.7), "an idle server resets it"


def test_retraction_when_decode_outgrows_the_pool() -> None:
    # Long max_new_tokens, estimated at a falling ratio, admit more requests than the pool holds once they grow:
    # SGLang then retracts the requests with the fewest generated tokens, requeues them and re-prefills them later.
    params = SchedulerParams(max_running_requests=64, max_total_tokens=12_000)
    model = CapacityModel(params)
    rng = random.Random(7)
    jobs = [Job(rng.randrange(50, 400), rng.randrange(1500, 3500), 0.0, max_new_tokens=8000) for _ in range(24)]
    for job in jobs:
        model.submit(job)
    seen_retractions = []

    def check(m: CapacityModel) -> None:
        assert m.used_tokens() <= params.max_total_tokens, "the pool is never overcommitted"
        running = [j for j in jobs if j.state == "running"]
        assert m.expected_tokens() == sum(j.estimate(j.generated_at(m.step)) for j in running)
        if m.last_retracted and m.retracted_total not in [r[0] for r in seen_retractions]:
            seen_retractions.append((m.retracted_total, m.new_token_ratio))

    done = drain(model, check)
    assert sorted(map(id, done)) == sorted(map(id, jobs))
    assert model.retracted_total > 0 and sum(j.retractions for j in jobs) == model.retracted_total
    assert model.generated_tokens == sum(j.output_tokens for j in jobs), "retracted tokens are kept, not redone"
    retracted = [j for j in jobs if j.retractions]
    assert all(j.first_token_at < j.finished_at for j in retracted)
    assert all(0.0 < ratio <= 1.0 for _, ratio in seen_retractions)


def test_retraction_takes_the_youngest_and_requeues_it_at_the_back() -> None:
    # Two running requests with different progress outgrow a small pool: the one with fewer generated tokens goes.
    params = SchedulerParams(max_running_requests=8, max_total_tokens=1000, admission_check_steps=1)
    model = CapacityModel(params, LinearStepTime(prefill_ms_per_1k_tokens=0.0))
    old = Job(10, 900, 0.0, max_new_tokens=900)
    model.submit(old)
    model.advance_to(0.0)
    model.new_token_ratio = 0.0  # as after a long decay: the newcomer is let in on its own estimate only
    young = Job(10, 500, model.boundary, max_new_tokens=10)
    model.submit(young)
    waiting = Job(10, 5, model.boundary, max_new_tokens=5)
    model.submit(waiting)
    drain(model)
    assert young.retractions >= 1 and old.retractions == 0
    assert young.finished_at > waiting.admitted_at, "requeued behind the request that was waiting"
    assert young.output_tokens == 500 and model.generated_tokens == 900 + 500 + 5


def test_an_arrival_waits_for_the_next_step_boundary() -> None:
    step = LinearStepTime(prefill_ms_per_1k_tokens=0.0)
    model = CapacityModel(SchedulerParams(max_running_requests=4), step)
    long = Job(10, 1000, 0.0)
    model.submit(long)
    dt = step.decode_seconds(1)
    arrival = 10.5 * dt  # in the middle of step 10
    model.advance_to(arrival)
    late = Job(10, 5, arrival)
    model.submit(late)
    drain(model)
    assert late.admitted_at == pytest.approx(11 * dt)
    assert late.finished_at == pytest.approx(11 * dt + 5 * step.decode_seconds(2))


def test_cancel_frees_the_slot_and_skips_the_queue() -> None:
    step = LinearStepTime(prefill_ms_per_1k_tokens=0.0)
    model = CapacityModel(SchedulerParams(max_running_requests=1), step)
    first, queued, third = Job(10, 10_000, 0.0), Job(10, 10, 0.0), Job(10, 10, 0.0)
    for job in (first, queued, third):
        model.submit(job)
    model.advance_to(1.0)
    model.cancel(queued)
    model.cancel(first)
    assert model.running == 0 and model.queued == 1 and model.used_tokens() == 0
    done = drain(model)
    assert done == [third] and third.admitted_at == pytest.approx(model.boundary - 10 * step.decode_seconds(1))
    assert third.admitted_at < 2.0


def test_a_request_that_can_never_fit_is_refused() -> None:
    model = CapacityModel(SchedulerParams(max_total_tokens=1000))
    with pytest.raises(ValueError, match="never be admitted"):
        model.submit(Job(900, 10, 0.0, max_new_tokens=200))


def test_the_model_jumps_between_events() -> None:
    lengths = random.Random(2)
    model = CapacityModel(SchedulerParams(max_running_requests=256))
    # Lengths as the server sees them: cut at a max_new_tokens of 10240.
    jobs = [Job(200, min(10240, PROFILES["glaive"].draw(lengths)), 0.0, max_new_tokens=10240)
            for _ in range(20_000)]
    started = time.perf_counter()
    for job in jobs:
        model.submit(job)
    calls = 0
    while (when := model.next_event_time()) is not None:
        model.advance_to(when)
        calls += 1
    elapsed = time.perf_counter() - started
    assert calls <= 2 * len(jobs), "one wake-up per completion, not per step"
    assert model.completed == len(jobs) and model.generated_tokens == sum(j.steps for j in jobs)
    # Full batches until the tail: throughput close to 256 slots' worth.
    ideal = sum(j.steps for j in jobs) / 256 * STEP.decode_seconds(256)
    assert max(j.finished_at for j in jobs) < 1.5 * ideal + 10
    print(f"20000 requests in {elapsed:.2f} s of CPU, {calls} wake-ups")


def test_gauges_describe_the_batch() -> None:
    model = CapacityModel(SchedulerParams(max_running_requests=4))
    for _ in range(6):
        model.submit(Job(100, 1000, 0.0))
    model.advance_to(1.0)
    assert model.running == 4 and model.queued == 2
    assert model.decode_throughput() == pytest.approx(4 / STEP.decode_seconds(4))
    assert model.used_tokens() == 4 * 100 + 4 * model.step


def test_step_time_is_a_parameter() -> None:
    class Doubling:
        depends_on_kv = True

        def decode_seconds(self, running: int, kv_tokens: int) -> float:
            return 0.01 * (1 + kv_tokens / 1000)

        def prefill_seconds(self, tokens: int) -> float:
            return 0.0

    model = CapacityModel(SchedulerParams(max_running_requests=1, max_stretch_steps=8), Doubling())
    job = Job(1000, 64, 0.0)
    model.submit(job)
    drain(model)
    # The step time is read again every 8 steps as the KV grows from 1000 tokens: slower than at the start.
    assert job.finished_at > 64 * 0.01 * 2.0 and job.finished_at < 64 * 0.01 * (1 + 1064 / 1000)


# ---- prefix cache -------------------------------------------------------------------------------------------------
def test_prefix_hits_are_token_exact_and_leave_the_last_token() -> None:
    system = list(range(100, 400))
    model = CapacityModel(SchedulerParams(), prefix_cache=PrefixCache(10_000))
    first = Job(310, 5, 0.0, prompt_ids=system + list(range(10)))
    second = Job(305, 5, 0.0, prompt_ids=system + [7, 7, 7, 7, 7])
    again = Job(310, 5, 0.0, prompt_ids=system + list(range(10)))
    for job in (first, second, again):
        model.submit(job)
    drain(model)
    assert (first.cached_tokens, second.cached_tokens, again.cached_tokens) == (0, 300, 309)


def test_input_logprobs_from_a_position_reuse_no_prefix_past_it() -> None:
    # A hidden-state capture asks logprob_start_len 0 (facts/hidden_states.capture_request): 0.5.23 matches no cached
    # prefix past that position (managers/schedule_batch.py:1766-1785), so it prefills in full, and pays for it.
    system = list(range(100, 400))
    model = CapacityModel(SchedulerParams(), prefix_cache=PrefixCache(10_000))
    first = Job(310, 5, 0.0, prompt_ids=system + list(range(10)))
    capture = Job(310, 5, 0.0, prompt_ids=system + list(range(10)), match_limit=0)
    partly = Job(310, 5, 0.0, prompt_ids=system + list(range(10)), match_limit=120)
    for job in (first, capture, partly):
        model.submit(job)
    drain(model)
    assert (capture.cached_tokens, partly.cached_tokens) == (0, 120)


def test_the_prefix_cache_stays_within_its_capacity_and_evicts_the_oldest() -> None:
    cache = PrefixCache(1000)
    for i in range(30):
        cache.insert([i] * 100)
    assert cache.tokens <= 1000
    assert cache.match([29] * 100) == 100 and cache.match([0] * 100) == 0
    cache.insert([1, 2, 3, 4])
    cache.insert([1, 2, 9])
    assert cache.match([1, 2, 3, 4, 5]) == 4 and cache.match([1, 2, 9]) == 3 and cache.match([1, 5]) == 1
