"""The runner's answers, held back and published at collection, read as though each had been counted at once."""

from __future__ import annotations

import random

from prometheus_client import generate_latest

from tokenmill_runner.metrics import RunnerMetrics


def _exposition(metrics: RunnerMetrics) -> list[str]:
    return [line for line in generate_latest(metrics.registry).decode().splitlines() if "_created" not in line]


def test_answers_published_at_collection_read_as_counted_one_by_one() -> None:
    batched, direct = RunnerMetrics.create("d", "n", 0), RunnerMetrics.create("d", "n", 0)
    rng = random.Random(0)
    for number in range(3000):
        dataset = "x" if number % 3 else "y"
        ok = rng.random() < 0.9
        attempts = rng.choice([1, 1, 2, 3])
        tokens = rng.choice([0, 1, 32, 33, 64, 100, 5000, 10 ** 6]) if ok else 0
        latency = rng.choice([0.0, 1.0, 2.5, 3600.0, 5000.0, float(rng.randrange(100))]) if ok else 0.0
        batched.answered(dataset, attempts, ok, tokens, latency)
        series = direct._answers.get(dataset) or direct._answer_series(dataset)  # noqa: SLF001 - the old way
        if attempts > 1:
            series[0].inc(attempts - 1)
        if ok:
            series[1].inc()
            series[3].inc(tokens)
            series[4].observe(latency)
            series[5].observe(tokens)
        else:
            series[2].inc()
        if number in (0, 1500):  # a scrape in the middle publishes what was held back
            assert _exposition(batched) == _exposition(direct)
    assert _exposition(batched) == _exposition(direct)
    labels = {"dsgen": "d", "namespace": "n", "dataset": "x", "worker": "0"}
    assert batched.registry.get_sample_value("tokenmill_runner_completion_tokens_count", labels) == \
        direct.registry.get_sample_value("tokenmill_runner_completion_tokens_count", labels)


def test_answers_held_back_stay_bounded_without_a_scrape() -> None:
    from tokenmill_runner.metrics import HELD_ANSWERS

    metrics = RunnerMetrics.create("d", "n", 0)
    for _ in range(3 * HELD_ANSWERS + 5):
        metrics.answered("x", 1, True, 8, 0.5)
    held = metrics._pending.get("x")  # noqa: SLF001 - what a run that nobody scrapes would grow
    assert held is None or len(held.latencies) < HELD_ANSWERS
    labels = {"dsgen": "d", "namespace": "n", "dataset": "x", "worker": "0"}
    assert metrics.registry.get_sample_value("tokenmill_runner_completion_tokens_count", labels) == 3 * HELD_ANSWERS + 5
