"""The measured trial (spec.server.trial auto) as a state machine over status.trial. Pure: the rules are
planner/trial.py's; this decides, from the status and the current candidate's scrapes, which layout the server
must run, when a candidate's measurement ends and which one the run continues on. The operator's API layer
(reconcile.py) scrapes, plans the pinned layouts and applies what is decided here.

A trial step is a forced layout switch: it goes through the same status fields as replan auto (serverPlan made for
the candidate's layout, status.layoutOverride whose token the runner Job's hash includes), so the StatefulSet rolls,
the runner Job is replaced with foreground deletion and its workers resume from the ledger: nothing generated
during the trial is lost or generated twice.

Status is the only memory: the candidates, the one being measured and every finished measurement are in
status.trial. The scrapes of the candidate being measured are kept in the operator's memory; an operator restarted
mid-trial measures that candidate again from its next scrape (its time budget counts from there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill_runner.spec.config import TrialSample

from .facts import Event
from .planner import ServerPlan
from .planner.trial import (
    MEASURE_S,
    Measurement,
    MetricPoint,
    Steady,
    conclude,
    plan_trial,
    sample_prompts,
    should_stop,
    steady_state,
)
from .planner.verify import LayoutKey, layout_name, running_layout
from .status import LayoutOverride, TrialCandidate, TrialStatus

CONDITION = "Trialled"


@dataclass(frozen=True)
class TrialStep:
    """What one pass decides: the new trial status, the layout the server must run when it is not the running one
    (None: stay), the Trialled condition (status, reason, message) and an Event (once, when the trial ends)."""

    trial: TrialStatus
    switch_to: TrialCandidate | None = None
    condition: tuple[str, str, str] | None = None
    event: Event | None = None


def _key(replicas: int, tp: int, dp: int, kv: str) -> LayoutKey:
    return replicas, tp, dp, kv


def begin(plan: ServerPlan, generation: int, measure_s: float = MEASURE_S) -> TrialStep:
    """The trial of this plan (trial.plan_trial): Measuring its candidates, the plan's pick first, or Skipped with
    why (a job too short to pay for one, no candidate the plan cannot tell apart from the best)."""
    picked = plan_trial(plan, measure_s=measure_s)
    by_name = {layout_name(c.replicas, c.tensor_parallel, c.attention_data_parallel, c.kv_cache_dtype): c
               for c in plan.candidates}
    candidates = []
    for name in picked.candidates:
        c = by_name[name]
        eta = c.prediction.eta_seconds if c.prediction is not None else 0
        candidates.append(TrialCandidate(layout=name, replicas=c.replicas, tensor_parallel=c.tensor_parallel,
                                         attention_data_parallel=c.attention_data_parallel,
                                         kv_cache_dtype=c.kv_cache_dtype, predicted_eta_seconds=eta))
    worthwhile = picked.worthwhile
    if worthwhile:
        candidates[0] = candidates[0].model_copy(update={"state": "Measuring"})
    prediction = plan.prediction
    trial = TrialStatus(generation=generation, phase="Measuring" if worthwhile else "Skipped", candidates=candidates,
                        measure_seconds=round(picked.measure_s), restart_seconds=round(picked.restart_s),
                        budget_seconds=round(picked.budget_s), reason=picked.reason,
                        sample_prompts=sample_prompts(plan, picked.candidates, picked.measure_s) if worthwhile else 0,
                        sample_output_tokens={d.name: d.mean_output_tokens for d in prediction.datasets}
                        if worthwhile and prediction is not None else {})
    if not worthwhile:
        return TrialStep(trial, condition=("False", "NotWorthwhile", f"no trial: {picked.reason}"))
    names = " -> ".join(c.layout for c in candidates)
    return TrialStep(trial, condition=("Unknown", "Measuring", f"measuring {names}: {picked.reason}"))


def _measurement(c: TrialCandidate, budget_s: float) -> Measurement:
    """A finished candidate as the rules take it back from status."""
    if c.tokens_per_second is None:
        return Measurement(c.layout, Steady(False, c.message or "no steady state"), float(c.measured_seconds or 0),
                           budget_s, c.flagged)
    steady = Steady(True, "steady", c.tokens_per_second, c.tokens_per_second_low or c.tokens_per_second,
                    c.tokens_per_second_high or c.tokens_per_second, 0.0, float(c.measured_seconds or 0))
    return Measurement(c.layout, steady, float(c.measured_seconds or 0), budget_s, c.flagged)


def _figures(m: Measurement) -> str:
    s = m.steady
    if not s.found:
        return f"{m.name}: no steady state in {m.elapsed_s:,.0f} s ({s.reason})"
    return f"{m.name}: {s.throughput:,.1f} tok/s [{s.low:,.1f}, {s.high:,.1f}] over {m.elapsed_s:,.0f} s"


def advance(trial: TrialStatus, running: LayoutKey, points: Sequence[MetricPoint], remaining_tokens: float,
            cap: float | None = None) -> TrialStep:
    """One pass of a trial: `running` is the layout the server runs (serverPlan's), `points` the scrapes of the
    current candidate so far (seconds from its first one), `remaining_tokens` the output tokens still to generate.
    The current candidate is measured until trial.should_stop; then the next one is switched to, or after the last
    the trial concludes (trial.conclude) and the run continues on its choice."""
    if trial.phase != "Measuring":
        return TrialStep(trial)
    index = trial.current
    current = trial.candidates[index]
    if running != current.key:
        # The switch this status asked for is not what serverPlan runs (it always is: both are one status write).
        return TrialStep(trial, switch_to=current)
    budget = float(trial.measure_seconds)
    elapsed = points[-1].t - points[0].t if points else 0.0
    now = Measurement(current.layout, steady_state(points, cap), elapsed, budget)
    done = [_measurement(c, budget) for c in trial.candidates[:index]]
    stop = should_stop(now, done)
    candidates = list(trial.candidates)
    if stop == "continue":
        candidates[index] = current.model_copy(update={"state": "Measuring", "message": now.steady.reason})
        message = (f"measuring {current.layout} (candidate {index + 1} of {len(candidates)}, {elapsed:,.0f} s of "
                   f"{budget:,.0f} s): {now.steady.reason}")
        return TrialStep(trial.model_copy(update={"candidates": candidates}),
                         condition=("Unknown", "Measuring", message))
    s = now.steady
    measured = current.model_copy(update={
        "state": "Measured", "stop": stop, "flagged": stop == "budget", "measured_seconds": round(elapsed),
        "message": s.reason,
        "tokens_per_second": round(s.throughput, 1) if s.found else None,
        "tokens_per_second_low": round(s.low, 1) if s.found else None,
        "tokens_per_second_high": round(s.high, 1) if s.found else None})
    candidates[index] = measured
    if index + 1 < len(candidates):
        following = candidates[index + 1].model_copy(update={"state": "Measuring"})
        candidates[index + 1] = following
        message = f"{_figures(_measurement(measured, budget))} ({stop}); switching to {following.layout}"
        return TrialStep(trial.model_copy(update={"candidates": candidates, "current": index + 1}),
                         switch_to=following, condition=("Unknown", "Measuring", message))
    measurements = [_measurement(c, budget) for c in candidates]
    result = conclude(measurements, current.layout, remaining_tokens, float(trial.restart_seconds))
    target = result.continue_on
    figures = "; ".join(_figures(m) for m in measurements)
    if not result.ranking:
        status, reason = "False", "NoSteadyState"
        outcome = f"no candidate reached a steady state: the run continues on {target}"
    elif target == result.winner:
        status, reason = "True", "FastestMeasured"
        outcome = f"{result.winner} measured fastest{' (not told apart from the runner-up)' if result.flagged else ''}"
        outcome += f": the run continues on it{'' if target == current.layout else ' (one more restart)'}"
    else:
        status, reason = "True", "SwitchDoesNotPay"
        d = result.decision
        why = (f" (remaining {d.best_eta_s / 3600:,.2f} h + restart {d.restart_s / 60:,.0f} min against "
               f"{d.current_eta_s / 3600:,.2f} h, margin {d.margin_s / 60:,.0f} min)" if d is not None else "")
        outcome = f"{result.winner} measured fastest, but switching back to it does not pay{why}: the run stays on {target}"
    message = f"{outcome}. {figures}"
    finished = trial.model_copy(update={"candidates": candidates, "phase": "Done", "winner": result.winner,
                                        "continued_on": target, "reason": message})
    switch = next((c for c in candidates if c.layout == target), None) if target != current.layout else None
    return TrialStep(finished, switch_to=switch, condition=(status, reason, message),
                     event=Event("Normal", CONDITION, f"trial: {message}"))


def trial_plan(pinned: ServerPlan, original: ServerPlan, candidate: TrialCandidate, step: str) -> ServerPlan:
    """The plan the server switches to for a trial step: `pinned` (the spec pinned to the candidate's layout), its
    arithmetic led by why, with the original plan's candidates (the chosen one marked) and its fixed fields."""
    why = f"run by the operator's measured trial (spec.server.trial auto): {step}"
    candidates = [c.model_copy(update={"chosen": _key(c.replicas, c.tensor_parallel, c.attention_data_parallel,
                                                      c.kv_cache_dtype) == candidate.key})
                  for c in original.candidates]
    reasoning = [r for r in pinned.reasoning if not r.startswith("run by the operator's measured trial")]
    return pinned.model_copy(update={"reasoning": [why, *reasoning], "overrides": original.overrides,
                                     "candidates": candidates})


def trial_override(trial: TrialStatus, running: ServerPlan, candidate: TrialCandidate, reason: str,
                   at: str) -> LayoutOverride:
    """status.layoutOverride for a trial step: what makes the runner Job's hash change (its token), so the Job is
    replaced exactly as for a replan switch. The ETAs are the plan's predictions (the trial measures, it does not
    re-plan)."""
    before = next((c for c in trial.candidates if c.key == running_layout(running)), None)
    current_eta = before.predicted_eta_seconds if before is not None else 0
    return LayoutOverride(
        generation=trial.generation, replicas=candidate.replicas, tensor_parallel=candidate.tensor_parallel,
        attention_data_parallel=candidate.attention_data_parallel, kv_cache_dtype=candidate.kv_cache_dtype,
        from_layout=layout_name(*running_layout(running)), to_layout=candidate.layout, reason=reason,
        current_eta_seconds=current_eta, new_eta_seconds=candidate.predicted_eta_seconds,
        gain_seconds=current_eta - candidate.predicted_eta_seconds, restart_seconds=trial.restart_seconds,
        margin_seconds=0, at=at)


def remaining_tokens(plan: ServerPlan, remaining_share: float) -> float:
    """Output tokens still to generate: the plan's predicted output tokens of the job times the share of samples
    not yet done."""
    prediction = plan.prediction
    if prediction is None:
        return 0.0
    total = sum(d.samples * d.mean_output_tokens for d in prediction.datasets)
    return max(0.0, remaining_share) * float(total)


def replan_may_switch(trial: TrialStatus | None) -> bool:
    """replan auto does not switch while a trial measures: a switch then would measure the wrong layout."""
    return trial is None or trial.phase != "Measuring"


def sample_of(trial: TrialStatus | None) -> TrialSample | None:
    """The stratified sample the runner Job sends first (its --trial-sample, part of its hash): the candidate being
    measured's, and after the trial that of the last one measured while the run continues on it (its Job goes on:
    no restart for a sample whose rows are done). None when the trial skipped or the run switched away."""
    if trial is None or trial.sample_prompts <= 0 or trial.phase == "Skipped" or not trial.candidates:
        return None
    index = trial.current
    if trial.phase == "Done" and trial.continued_on != trial.candidates[index].layout:
        return None
    return TrialSample(seed=str(trial.generation), candidate=index, candidates=len(trial.candidates),
                       prompts=trial.sample_prompts,
                       output_tokens={name: float(v) for name, v in trial.sample_output_tokens.items()})


def sample_token(trial: TrialStatus | None) -> str:
    """sample_of as the runner Job's hash and command line carry it (its JSON), else empty."""
    sample = sample_of(trial)
    return sample.token() if sample is not None else ""
