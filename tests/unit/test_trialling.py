"""The measured trial's state machine over status.trial (operator/tokenmill_operator/decide/trialling.py): which candidate
runs next, when a measurement ends, how it concludes, and that a restarted operator resumes from the status alone."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenmill_operator.decide.planner import model_facts, plan_server
from tokenmill_operator.decide.planner.trial import MetricPoint
from tokenmill_operator.decide.planner.verify import running_layout
from tokenmill_operator.decide.status import DatasetGenerationStatus, TrialStatus
from tokenmill_operator.decide.trialling import (
    advance,
    begin,
    remaining_tokens,
    replan_may_switch,
    trial_override,
    trial_plan,
)
from tokenmill_runner.spec.resource import parse_document

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def seeds_plan(limit: int):
    data = json.loads((MODELS / "kimi-k2.5.json").read_text())
    spec = parse_document({
        "apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "trial"},
        "spec": {"model": {"path": "s3://models/kimi-k2.5/", "cache": {"mode": "nodeLocal"}},
                 "server": {"image": "lmsysorg/sglang:v0.5.23", "gpuProduct": "RTX-PRO-6000", "trial": "auto"},
                 "sampling": {"maxNewTokens": 10240},
                 "datasets": [{"name": f"B{i}", "source": f"s3://p/b{i}.jsonl", "limit": limit} for i in range(1, 9)],
                 "output": {"uri": "s3://out/run/"}}}).spec
    return plan_server(spec, model_facts(data["config"], data["weight_bytes"]))


def steady(rate: float, until: float = 300.0, seed: int = 0, noise: float = 0.01) -> list[MetricPoint]:
    """A candidate past its warm-up from the first scrape: the batch full (requests queued), the rate flat."""
    rng = random.Random(seed)
    return [MetricPoint(t, rate * (1 + rng.uniform(-noise, noise)), 100.0, 20.0) for t in range(0, int(until) + 1, 5)]


def until_stop(trial: TrialStatus, running, points: list[MetricPoint]):
    """advance() scrape by scrape, as the operator's passes call it, until the step moves on."""
    for i in range(1, len(points) + 1):
        step = advance(trial, running, points[:i], remaining_tokens=1e9)
        if step.trial.current != trial.current or step.trial.phase != trial.phase:
            return step
    return step


def test_a_long_job_begins_measuring_the_plans_pick_and_a_short_one_is_skipped():
    step = begin(seeds_plan(11_000), generation=3)
    trial = step.trial
    assert trial.phase == "Measuring" and trial.generation == 3 and trial.current == 0
    assert [c.layout for c in trial.candidates][0] == "1 x TP 8 + DP attention 4" and len(trial.candidates) == 3
    assert [c.state for c in trial.candidates] == ["Measuring", "Pending", "Pending"]
    assert step.switch_to is None and step.condition is not None and step.condition[:2] == ("Unknown", "Measuring")
    short = begin(seeds_plan(100), generation=3)
    assert short.trial.phase == "Skipped" and short.condition is not None
    assert short.condition[:2] == ("False", "NotWorthwhile") and "too short" in short.condition[2]
    assert advance(short.trial, (1, 8, 4, "auto"), steady(1000), 1e9).trial == short.trial  # nothing more to do


def test_each_candidate_is_measured_until_the_rule_stops_it_then_the_next_is_switched_to():
    plan = seeds_plan(11_000)
    trial = begin(plan, generation=1).trial
    first = trial.candidates[0]
    early = advance(trial, first.key, steady(1000, until=20), 1e9)
    assert early.switch_to is None and early.trial.current == 0 and early.condition[0] == "Unknown"
    step = until_stop(trial, first.key, steady(1000))
    assert step.trial.current == 1 and step.switch_to == step.trial.candidates[1]
    measured = step.trial.candidates[0]
    assert measured.state == "Measured" and measured.stop == "precise" and not measured.flagged
    assert abs(measured.tokens_per_second - 1000) < 10 and measured.tokens_per_second_low < 1000
    assert step.trial.candidates[1].state == "Measuring" and step.event is None
    # The server does not run the candidate's layout yet: nothing is measured, the switch is asked again.
    waiting = advance(step.trial, first.key, steady(1300), 1e9)
    assert waiting.trial == step.trial and waiting.switch_to == step.trial.candidates[1]


def test_the_trial_concludes_on_the_measured_fastest_with_one_event():
    trial = begin(seeds_plan(11_000), generation=1).trial
    rates = {0: 1000.0, 1: 1300.0, 2: 1100.0}
    for index in range(3):
        step = until_stop(trial, trial.candidates[index].key, steady(rates[index], seed=index))
        trial = step.trial
    assert trial.phase == "Done" and trial.winner == trial.candidates[1].layout
    assert trial.continued_on == trial.winner
    assert step.switch_to == trial.candidates[1]  # the last one measured is not the winner: one more restart
    assert step.condition is not None and step.condition[:2] == ("True", "FastestMeasured")
    assert step.event is not None and step.event.reason == "Trialled" and "1,299" in step.event.message
    assert [c.stop for c in trial.candidates] == ["precise", "ranked", "ranked"]
    again = advance(trial, trial.candidates[1].key, steady(1300), 1e9)
    assert again.event is None and again.switch_to is None  # concluded once


def test_the_last_one_measured_winning_needs_no_restart_and_a_restart_that_does_not_pay_is_not_made():
    plan = seeds_plan(11_000)
    trial = begin(plan, generation=1).trial.model_copy()
    trial = trial.model_copy(update={"candidates": trial.candidates[:2]})
    first = until_stop(trial, trial.candidates[0].key, steady(1000)).trial
    done = until_stop(first, first.candidates[1].key, steady(1200, seed=1))
    assert done.trial.continued_on == first.candidates[1].layout and done.switch_to is None
    # With almost nothing left to generate, going back to a faster first candidate does not pay its restart.
    fast_first = until_stop(trial, trial.candidates[0].key, steady(1200)).trial
    points = steady(1000, seed=1)
    for i in range(1, len(points) + 1):
        stay = advance(fast_first, fast_first.candidates[1].key, points[:i], remaining_tokens=1e5)
        if stay.trial.phase == "Done":
            break
    assert stay.trial.winner == trial.candidates[0].layout and stay.trial.continued_on == trial.candidates[1].layout
    assert stay.switch_to is None and stay.condition is not None and stay.condition[1] == "SwitchDoesNotPay"


def test_nothing_steady_is_measured_to_its_budget_and_the_run_stays():
    trial = begin(seeds_plan(11_000), generation=1).trial
    trial = trial.model_copy(update={"candidates": trial.candidates[:2]})
    draining = [MetricPoint(t, 1000.0, 100.0, 0.0) for t in range(0, trial.measure_seconds + 10, 5)]  # never full
    first = until_stop(trial, trial.candidates[0].key, draining).trial
    assert first.candidates[0].stop == "budget" and first.candidates[0].flagged
    assert first.candidates[0].tokens_per_second is None
    done = until_stop(first, first.candidates[1].key, draining)
    assert done.trial.phase == "Done" and done.condition is not None and done.condition[:2] == ("False",
                                                                                                 "NoSteadyState")
    assert done.switch_to is None and done.trial.continued_on == first.candidates[1].layout


def test_a_restarted_operator_resumes_from_the_status_alone():
    """The status is written and read back as the API server would keep it; the new operator has no scrapes of
    the current candidate and measures it again from its next one, the finished measurements kept."""
    trial = begin(seeds_plan(11_000), generation=1).trial
    trial = until_stop(trial, trial.candidates[0].key, steady(1000)).trial
    partway = advance(trial, trial.candidates[1].key, steady(1300, until=40), 1e9).trial
    stored = DatasetGenerationStatus(trial=partway).model_dump(mode="json", by_alias=True, exclude_none=True)
    resumed = DatasetGenerationStatus.model_validate(json.loads(json.dumps(stored))).trial
    assert resumed == partway and resumed.current == 1 and resumed.candidates[0].tokens_per_second is not None
    step = until_stop(resumed, resumed.candidates[1].key, steady(1300, seed=5))
    assert step.trial.current == 2 and step.trial.candidates[1].stop == "ranked"
    assert step.trial.candidates[0] == partway.candidates[0]


def test_a_trial_step_is_a_layout_switch_the_runner_job_hash_sees():
    plan = seeds_plan(11_000)
    trial = begin(plan, generation=4).trial
    nxt = trial.candidates[1]
    override = trial_override(trial, plan, nxt, "trial step", "2026-01-01T00:00:00Z")
    assert override.generation == 4 and override.to_layout == nxt.layout
    assert override.from_layout == trial.candidates[0].layout and override.token.startswith("4:")
    back = trial_override(trial, plan, trial.candidates[0], "back", "2026-01-01T00:00:00Z")
    assert back.token != override.token  # going back to the plan's pick is a new Job too
    pinned = trial_plan(plan, plan, nxt, "candidate 2 of 3")
    assert pinned.reasoning[0].startswith("run by the operator's measured trial")
    assert [c.chosen for c in pinned.candidates].count(True) == 1
    assert trial_plan(pinned, plan, nxt, "again").reasoning[1:] == pinned.reasoning[1:]
    assert running_layout(plan) == trial.candidates[0].key
    assert remaining_tokens(plan, 0.5) > 0 and remaining_tokens(plan, 0.0) == 0
    assert not replan_may_switch(trial) and replan_may_switch(None)


def test_the_trial_series_sums_the_replicas_scales_the_clock_and_starts_again_per_candidate():
    from datetime import UTC, datetime, timedelta

    from tokenmill_operator.decide.server_metrics import Scrape, TrialScrapes

    series, t0 = TrialScrapes(), datetime(2026, 1, 1, tzinfo=UTC)
    one = Scrape(running=10, queued=2, gen_throughput=100, used_tokens=0)
    series.add((1, 0), t0, [one, one], clock_scale=5)
    points = series.add((1, 0), t0 + timedelta(seconds=2), [one, one], clock_scale=5)
    assert [(p.t, p.gen_throughput, p.running, p.queued) for p in points] == [(0, 200, 20, 4), (10, 200, 20, 4)]
    assert len(series.add((1, 0), t0 + timedelta(seconds=3), [one, None])) == 2  # a replica unread: no point
    assert series.add((1, 1), t0 + timedelta(seconds=4), [one])[0].t == 0  # the next candidate starts afresh
