"""The verification loop cannot strand a run: the three wrong-plan scenarios of review-f9665d2.md (bugs 5-7), each
replayed as the review reproduced it, and the replan-auto switch that does not start.

- bug 5: right after a layout switch the StatefulSet and the runner Job are still the old layout's for a pass; no
  sample of them may enter the new layout's verification window (reconcile._window).
- bug 6: a trial whose last candidate never reaches a steady state decides on what it measured: it measures the
  candidate longer while the trial's budget allows, then goes back to the best measured one; it never says
  switching "does not pay" without figures (decide/trialling.py).
- bug 7: a candidate that does not start within its own budget is dropped and the trial moves on; the run is not
  failed ServerCannotStart (decide/lifecycle.py, decide/trialling.drop_unstarted). A replan-auto switch that does
  not start goes back to the layout it came from (reconcile._leave_switch).
"""

from __future__ import annotations

import json
import random
from datetime import timedelta

from tokenmill_operator.decide.facts import Facts, JobState, ServerState
from tokenmill_operator.decide.lifecycle import decide, switch_not_started, switch_start_budget
from tokenmill_operator.decide.planner.trial import MetricPoint
from tokenmill_operator.decide.planner.verify import running_layout
from tokenmill_operator.decide.settings import OperatorSettings
from tokenmill_operator.decide.status import DatasetGenerationStatus, TrialStatus
from tokenmill_operator.decide.trialling import advance, begin, drop_unstarted, trial_override
from tokenmill_operator.observe import gather
from tokenmill_operator.observe.gather import OutputIndex

from .test_lifecycle import T0, observed
from .test_replan_auto import NOW, PLAN, SPEC, switch_decision
from .test_trialling import seeds_plan, steady, until_stop


def scrape(running: float, step_ms: float):
    from tokenmill_operator.decide.server_metrics import Scrape

    return Scrape(running=running, queued=10, gen_throughput=running / step_ms * 1000, used_tokens=1000)


# ------------------------------------------------------------------------------------------------------ bug 5


def test_the_switched_layouts_window_opens_only_on_its_own_pods_and_job(monkeypatch):
    from tokenmill_operator.decide.facts import Context
    from tokenmill_operator.reconcile import Planning, _window

    _, switched = switch_decision(generation=3)  # 2 x TP 4 switched to 8 x TP 1
    status = switched.status
    plan = status.server_plan
    assert plan is not None and running_layout(plan) == (8, 1, 1, "auto")
    old_pods = {"batch": 300.0, "step": 50.0}
    monkeypatch.setattr(gather, "scrape_replicas",
                        lambda urls, read: [scrape(old_pods["batch"], old_pods["step"]) for _ in urls])
    context = Context(body={"metadata": {"name": "q"}}, name="q", namespace="ns", generation=3, spec=SPEC,
                      previous=status)
    index, settings, urls = OutputIndex(), OperatorSettings(), ["http://q-0"]
    # The pass right after the switch: the old StatefulSet (2 pods, ready, not rolling) and the old Job.
    old = Facts(job=JobState(active=1, hash="old-layout-job"), job_started=T0, server=ServerState(desired=2, ready=2))
    assert _window(context, index, Planning(plan), old, urls, NOW, settings, "new-layout-job") is None
    # The old Job already gone and the new StatefulSet rolling: nothing either.
    rolling = Facts(job=None, job_started=None, server=ServerState(desired=8, ready=2, rolling=True))
    assert _window(context, index, Planning(plan), rolling, urls, NOW + timedelta(minutes=5), settings,
                   "new-layout-job") is None
    # The new layout serves and its Job runs: the window opens on its figures alone.
    old_pods.update(batch=20.0, step=20.0)
    new = Facts(job=JobState(active=1, hash="new-layout-job"), job_started=NOW, server=ServerState(desired=8, ready=8))
    opened = _window(context, index, Planning(plan), new, urls, NOW + timedelta(minutes=13), settings,
                     "new-layout-job")
    assert opened is not None and opened.samples
    assert {(s.batch, round(s.step_seconds * 1000)) for s in opened.samples} == {(20.0, 20)}  # none of 300/50


# ------------------------------------------------------------------------------------------------------ bug 6


def unsteady(until: float, seed: int = 7) -> list[MetricPoint]:
    """A batch that rises and falls for the whole budget: never a steady state."""
    rng = random.Random(seed)
    return [MetricPoint(t, 300 + 300 * rng.random(), 50 + 40 * (t // 30 % 2), 20.0) for t in range(0, int(until) + 1, 5)]


def two_candidates(budget_seconds: int) -> TrialStatus:
    trial = begin(seeds_plan(11_000), generation=1).trial
    return trial.model_copy(update={"candidates": trial.candidates[:2], "budget_seconds": budget_seconds})


def measure_all(trial: TrialStatus, index: int, points: list[MetricPoint], remaining: float = 5e8):
    return until_stop(trial, trial.candidates[index].key, points, remaining)


def test_an_unsteady_last_candidate_sends_the_run_back_to_the_best_measured_one_with_the_figures():
    trial = two_candidates(budget_seconds=600)  # no room for a second budget
    first = measure_all(trial, 0, steady(1000)).trial
    assert first.candidates[0].tokens_per_second is not None
    done = measure_all(first, 1, unsteady(first.measure_seconds + 10))
    assert done.trial.phase == "Done" and done.trial.continued_on == first.candidates[0].layout
    assert done.switch_to is not None and done.switch_to.layout == first.candidates[0].layout
    status, reason, message = done.condition
    assert (status, reason) == ("True", "BackToMeasured")
    assert "does not pay" not in message
    assert f"the run goes back to {first.candidates[0].layout}, measured fastest at 1,0" in message
    assert "no steady state in" in message  # the unmeasured one's own figures


def test_an_unsteady_candidate_is_measured_a_second_budget_when_the_trial_can_afford_it():
    trial = two_candidates(budget_seconds=5000)
    first = measure_all(trial, 0, steady(1000)).trial
    key = first.candidates[1].key
    points = unsteady(first.measure_seconds + 10)
    extended = next(step for i in range(1, len(points) + 1)
                    if (step := advance(first, key, points[:i], 5e8)).trial.candidates[1].extended)
    assert extended.trial.phase == "Measuring" and extended.switch_to is None
    assert "measured 300 s more" in extended.condition[2] and "no steady state in" in extended.condition[2]
    # Steady in its second budget: ranked on what it measured, faster, so the run stays on it.
    calm = points[:-1] + [MetricPoint(p.t + points[-1].t, p.gen_throughput, p.running, p.queued)
                          for p in steady(1300, until=first.measure_seconds, seed=3)]
    done = measure_all(extended.trial, 1, calm)
    assert done.trial.phase == "Done" and done.trial.continued_on == first.candidates[1].layout
    assert done.condition[1] == "FastestMeasured"


# ------------------------------------------------------------------------------------------------------ bug 7


def crash_looping(minutes: float, trial: TrialStatus | None, override, plan=PLAN) -> object:
    """The review's scenario: the switched layout's 8 pods crash-loop, the old Job already replaced."""
    status = DatasetGenerationStatus(phase="StartingServer", planned_generation=3, observed_generation=3,
                                     server_plan=plan, trial=trial, layout_override=override,
                                     server_starting_since=T0.isoformat().replace("+00:00", "Z"))
    return observed(generation=3, planned_generation=3, previous=status, plan=plan, job=None,
                    now=T0 + timedelta(minutes=minutes),
                    server=ServerState(desired=8, ready=0, problem_reason="CrashLoopBackOff",
                                       problem_message="CUDA out of memory"))


def test_a_candidate_that_does_not_start_is_dropped_not_the_whole_run():
    seeds = seeds_plan(11_000)
    trial = two_candidates(budget_seconds=5000).model_copy(update={"generation": 3})
    measured = measure_all(trial, 0, steady(1000)).trial  # candidate 2 is being started
    second = measured.candidates[1]
    override = trial_override(measured, seeds, second, "trial step", T0.isoformat().replace("+00:00", "Z"))
    budget = switch_start_budget(measured.restart_seconds)
    for minutes in (0, budget / 60 - 1):
        early = decide(crash_looping(minutes, measured, override, seeds))
        assert early.status.phase == "StartingServer" and early.switch_not_started is None
    late = decide(crash_looping(budget / 60 + 1, measured, override, seeds))
    assert late.status.phase != "Failed"
    assert not any(c.type == "Failed" and c.status == "True" for c in late.status.conditions)
    why = late.switch_not_started
    assert why is not None and why.startswith(f"{second.layout} did not start in ")
    assert "CrashLoopBackOff: CUDA out of memory" in why
    # Even past the run's own deadline (30 min), the switch is left, not the run failed.
    assert decide(crash_looping(31, measured, override, seeds)).status.phase != "Failed"
    step = drop_unstarted(measured, why, 5e8)
    assert step.trial.candidates[1].state == "NotStarted" and step.trial.phase == "Done"
    assert step.switch_to is not None and step.switch_to.layout == measured.candidates[0].layout
    status, reason, message = step.condition
    assert reason == "BackToMeasured" and f"{measured.candidates[1].layout} did not start" in message
    assert "dropped, " + why in message and step.event is not None and step.event.type == "Warning"


def test_a_switch_left_for_good_falls_back_to_the_runs_own_deadline():
    _, switched = switch_decision(generation=3)
    override = switched.status.layout_override
    trial = two_candidates(budget_seconds=5000).model_copy(update={"generation": 3})
    measured = measure_all(trial, 0, steady(1000)).trial
    # Switched from and back again (reverted): that layout's start is the run's own, whose deadline applies.
    reverted = override.model_copy(update={"reverted": True})
    assert switch_not_started(crash_looping(40, measured, reverted)) is None
    failed = decide(crash_looping(40, measured, reverted))  # past the run's deadline (copy + probe: 32.5 min)
    assert failed.status.phase == "Failed" and failed.switch_not_started is None


def test_a_replan_switch_that_does_not_start_returns_to_the_previous_plan(s3_endpoint: str, s3_bucket: str):
    from tokenmill_operator.decide.facts import Context
    from tokenmill_operator.reconcile import _leave_switch
    from tokenmill_runner.spec.resource import parse_document
    from tokenmill_runner.store.storage import open_storage

    from .test_replan_auto import DATA, spec_doc

    open_storage(f"s3://{s3_bucket}/qwen/", s3_endpoint).put("config.json", json.dumps(DATA["config"]).encode())
    document = spec_doc()
    document["spec"]["model"] = {"path": f"s3://{s3_bucket}/qwen/", "weightBytes": DATA["weight_bytes"]}
    document["spec"]["output"]["endpoint"] = s3_endpoint
    document["spec"]["datasets"][0]["source"] = f"s3://{s3_bucket}/b5.jsonl"
    spec = parse_document(document).spec
    _, switched = switch_decision(generation=3)
    override = switched.status.layout_override
    starting = crash_looping(31, None, override)
    decision = decide(starting)
    assert decision.switch_not_started is not None and decision.status.phase == "StartingServer"
    decision = decision.__class__(**{**decision.__dict__, "status": decision.status.model_copy(
        update={"server_plan": switched.status.server_plan, "layout_override": override})})
    context = Context(body=document, name="q", namespace="ns", generation=3, spec=spec, previous=starting.previous)
    back = _leave_switch(context, None, decision, starting, OutputIndex())
    assert running_layout(back.status.server_plan) == (2, 4, 1, "auto")
    revert = back.status.layout_override
    assert revert.reverted and (revert.from_layout, revert.to_layout) == ("8 x TP 1", "2 x TP 4")
    replanned = next(c for c in back.status.conditions if c.type == "Replanned")
    assert (replanned.status, replanned.reason) == ("False", "SwitchNotStarted")
    assert replanned.message.startswith("8 x TP 1 did not start in 00:31:00")
    assert "CrashLoopBackOff: CUDA out of memory" in replanned.message and "back to 2 x TP 4" in replanned.message
    assert [(e.type, e.reason) for e in back.events][-1] == ("Warning", "Replanned")
    assert back.status.server_plan.reasoning[0].startswith("returned by the operator to the layout it switched from")
