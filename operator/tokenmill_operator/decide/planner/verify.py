"""A plan checked against the running server in its first minutes, its constants refitted, and the decision to
switch layouts. Pure: the operator scrapes SGLang's /metrics and hands the samples in; what it writes (a
condition, an Event, the cluster's ConfigMap of measured constants) is built here as data.

- Verify: the server's median batch (num_running_reqs) and step time (running / gen_throughput) over the window,
  beside the plan's batch and its step at that batch: `PlanVerified` when both are within TOLERANCE, else
  `PlanOff` with the numbers. Retractions and queued requests are shown with them.
- Refit: facts/refit.py on the window's graph steps.
- Re-plan: the remaining work's ETA on the current layout and on each alternative, both with the refitted
  constants. A switch pays the restart (the plan's own start-up model: copy, load, warm-up), so it is proposed only
  when the gain beats that cost plus MARGIN (a share of the remaining time, at least MARGIN_FLOOR_S): under
  `spec.server.replan` auto the operator switches, under suggest (the default) it records a condition and an Event,
  under off nothing. Nothing is lost or generated twice across a switch: committed samples stay committed and the
  runner resumes from the ledger (DESIGN.md "Exactly once"); only the in-flight requests are sent again.
- Persist: the refitted multipliers per cluster, keyed by GPU product, interconnect, SGLang release and model
  architecture, so later plans on that cluster start from measurements.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from tokenmill_runner.facts.refit import Refit, StepSample
from tokenmill_runner.spec.resource import DatasetGenerationSpec

from .plan import ServerPlan

TOLERANCE = 0.15
MARGIN = 0.05
MARGIN_FLOOR_S = 600.0
# The window: the first minutes of generation, after the warm-up.
WINDOW_S = 600.0
CONFIGMAP_NAME = "tokenmill-measured-constants"

ReplanMode = Literal["auto", "suggest", "off"]
# A server layout as the re-plan compares them: (replicas, tensor parallel, DP attention groups, KV cache dtype).
LayoutKey = tuple[int, int, int, str]


@dataclass(frozen=True)
class Verification:
    verified: bool
    predicted_batch: float
    observed_batch: float
    predicted_step_s: float
    observed_step_s: float
    retractions: int
    queued: float
    context_tokens: float | None = None  # the KV tokens per request the step was compared at (None: the plan's)

    def condition(self) -> dict[str, Any]:
        kind = "PlanVerified" if self.verified else "PlanOff"
        at = f" at {self.context_tokens:,.0f} KV tokens a request" if self.context_tokens is not None else ""
        return {"type": kind, "status": "True", "reason": kind,
                "message": (f"batch predicted {self.predicted_batch:,.0f}, observed {self.observed_batch:,.0f}; "
                            f"step{at} predicted {self.predicted_step_s * 1e3:,.1f} ms, observed "
                            f"{self.observed_step_s * 1e3:,.1f} ms; retractions {self.retractions:,}, queued "
                            f"{self.queued:,.0f} (tolerance {TOLERANCE:.0%})")}


@dataclass(frozen=True)
class PredictedStep:
    """The plan's decode step at its batch, at `held` KV tokens per request, and how it grows per KV token more
    (0: not known, the step is taken as it is)."""

    seconds: float
    held: float = 0.0
    per_token: float = 0.0

    @property
    def scales(self) -> bool:
        return self.per_token > 0 and self.held > 0

    def at(self, context_tokens: float) -> float:
        if not self.scales or context_tokens <= 0:
            return self.seconds
        return max(self.seconds + self.per_token * (context_tokens - self.held), self.seconds * 0.05)


def verify(samples: Sequence[StepSample], predicted_batch: float, predicted: PredictedStep, retractions: int = 0,
           queued: float = 0.0, window_batch_share: float = 0.5) -> Verification:
    """Compare the window's steady part (the samples at or above `window_batch_share` of the largest batch, past the
    ramp) with the plan: its batch, and its step at the context the server reported (a run's first minutes hold
    younger requests than the job's average, so a step compared at the plan's context would look fast)."""
    if not samples:
        raise ValueError("no samples in the verification window")
    top = max(s.batch for s in samples)
    steady = [s for s in samples if s.batch >= window_batch_share * top]
    batch = statistics.median(s.batch for s in steady)
    step = statistics.median(s.step_seconds for s in steady)
    context = statistics.median(s.context_tokens for s in steady)
    predicted_step = predicted.at(context)
    ok = abs(batch / predicted_batch - 1) <= TOLERANCE and abs(step / predicted_step - 1) <= TOLERANCE
    return Verification(ok, predicted_batch, batch, predicted_step, step, retractions, queued,
                        context if predicted.scales else None)


@dataclass(frozen=True)
class Decision:
    action: Literal["stay", "switch", "suggest"]
    current_eta_s: float
    best_eta_s: float
    best: str
    restart_s: float
    margin_s: float
    layout: LayoutKey | None = None  # the best other layout's key (replan_decision sets it): what a switch runs

    @property
    def gain_s(self) -> float:
        return self.current_eta_s - self.best_eta_s

    def condition(self) -> dict[str, Any] | None:
        if self.action == "stay":
            return None
        return {"type": "ReplanSuggested" if self.action == "suggest" else "Replanned", "status": "True",
                "reason": "FasterLayoutMeasured",
                "message": (f"{self.best}: remaining ETA {self.best_eta_s / 3600:,.2f} h against "
                            f"{self.current_eta_s / 3600:,.2f} h now; gain {self.gain_s / 3600:,.2f} h beats the "
                            f"restart {self.restart_s / 60:,.0f} min + margin {self.margin_s / 60:,.0f} min")}


def switch_mode(mode: ReplanMode, switched_generation: int | None, generation: int) -> ReplanMode:
    """The mode the re-plan runs in: auto switches at most once per spec generation, so a generation the operator
    already switched (status.layoutOverride) only suggests. Without this a second measurement on the new layout
    could switch back, and two layouts predicted within the noise of each other would flap, each switch paying a
    restart."""
    return "suggest" if mode == "auto" and switched_generation == generation else mode


def decide(current_eta_s: float, alternatives: dict[str, float], restart_s: float, mode: ReplanMode) -> Decision:
    """Switch (or suggest) only when the best alternative's remaining ETA plus the restart and the margin is below
    the current remaining ETA."""
    best = min(alternatives, key=alternatives.__getitem__) if alternatives else ""
    best_eta = alternatives.get(best, current_eta_s)
    margin = max(MARGIN * current_eta_s, MARGIN_FLOOR_S)
    wins = bool(best) and current_eta_s - best_eta > restart_s + margin
    action: Literal["stay", "switch", "suggest"] = "stay"
    if wins and mode != "off":
        action = "switch" if mode == "auto" else "suggest"
    return Decision(action, current_eta_s, best_eta, best, restart_s, margin)


def layout_name(replicas: int, tensor_parallel: int, attention_data_parallel: int, kv_cache_dtype: str) -> str:
    dp = f" + DP attention {attention_data_parallel}" if attention_data_parallel > 1 else ""
    kv = f", KV {kv_cache_dtype}" if kv_cache_dtype != "auto" else ""
    return f"{replicas} x TP {tensor_parallel}{dp}{kv}"


def replan_decision(running: ServerPlan, replanned: ServerPlan, remaining_share: float,
                    mode: ReplanMode) -> Decision | None:
    """decide() on the remaining work: every layout's generation time in `replanned` (the plan made again with the
    measured constants) times the share of the samples still to do, the running layout against the others, the
    restart being the running plan's own start-up (copy, load, warm-up). Only layouts the spec allows as it stands
    are offered (never one that needs another KV cache dtype). None when the running layout is not among the
    re-planned ones."""
    def key(replicas: int, tp: int, dp: int, kv: str) -> LayoutKey:
        return replicas, tp, dp, kv

    current = key(running.replicas, running.tensor_parallel, running.attention_data_parallel, running.kv_cache_dtype)
    times: dict[LayoutKey, float] = {}
    for c in replanned.candidates:
        running_layout = key(c.replicas, c.tensor_parallel, c.attention_data_parallel, c.kv_cache_dtype) == current
        if c.prediction is not None and (c.choosable or running_layout):
            seconds = c.prediction.generation_seconds or c.prediction.eta_seconds
            times[key(c.replicas, c.tensor_parallel, c.attention_data_parallel, c.kv_cache_dtype)] = (
                seconds * max(0.0, min(1.0, remaining_share)))
    if current not in times:
        return None
    keys = {layout_name(*k): k for k in times if k != current}
    alternatives = {name: times[k] for name, k in keys.items()}
    restart = float(running.startup.seconds) if running.startup is not None else 0.0
    found = decide(times[current], alternatives, restart, mode)
    return replace(found, layout=keys.get(found.best))


def running_layout(plan: ServerPlan) -> LayoutKey:
    return plan.replicas, plan.tensor_parallel, plan.attention_data_parallel, plan.kv_cache_dtype


def pinned_spec(spec: DatasetGenerationSpec, layout: LayoutKey) -> DatasetGenerationSpec:
    """The spec with its server fixed to `layout`: planned, it gives that layout's full settings (memory fraction,
    max running requests, graph batch, chunk) the way the spec's own choice gets them, from the same code."""
    replicas, tp, dp, kv = layout
    server = spec.server.model_copy(update={"replicas": replicas, "tensor_parallel": tp,
                                            "attention_data_parallel": dp, "kv_cache_dtype": kv})
    return spec.model_copy(update={"server": server})


def switched_plan(running: ServerPlan, pinned: ServerPlan, replan: Decision,
                  replanned: ServerPlan | None = None) -> ServerPlan | None:
    """The plan the server switches to: `pinned` (the spec pinned to the re-plan's best layout, planned with the
    measured constants), its arithmetic led by why it was chosen. None when it is not that layout after all (the
    pinned spec planned something else): the running plan stays rather than a layout no one compared. With
    `replanned` (the spec's own re-plan on the same constants) its candidates are the ones compared, the chosen one
    marked, instead of the pinned plan's, whose other layouts all read "spec.server.tensorParallel is ...": a field
    the user never set."""
    if replan.action != "switch" or replan.layout is None or running_layout(pinned) != replan.layout:
        return None
    why = (f"switched by the operator (spec.server.replan auto) from {layout_name(*running_layout(running))} to "
           f"{replan.best}: on the measured constants the remaining work takes {replan.best_eta_s:,.0f} s instead "
           f"of {replan.current_eta_s:,.0f} s; the gain {replan.gain_s:,.0f} s beats the restart "
           f"{replan.restart_s:,.0f} s + margin {replan.margin_s:,.0f} s")
    candidates = pinned.candidates if replanned is None else [
        c.model_copy(update={"chosen": (c.replicas, c.tensor_parallel, c.attention_data_parallel, c.kv_cache_dtype)
                             == replan.layout}) for c in replanned.candidates]
    # The spec's own fixed fields, not the pinned ones: the layout is the operator's choice, said in reasoning.
    return pinned.model_copy(update={"reasoning": [why, *pinned.reasoning], "overrides": running.overrides,
                                     "candidates": candidates})


# --------------------------------------------------------------------------------------------------------------
# The cluster's measured constants.


def constants_key(gpu_product: str, interconnect: str, sglang_version: str, architecture: str) -> str:
    """A ConfigMap data key (alphanumerics, '-', '_', '.') for one hardware and software combination."""
    raw = f"{gpu_product}.{interconnect or 'single'}.{sglang_version}.{architecture}"
    return re.sub(r"[^A-Za-z0-9._-]", "-", raw)[:253]


def constants_entry(result: Refit) -> str:
    return json.dumps({"expertSpeed": round(result.expert_speed, 4),
                       "collectiveScale": round(result.collective_scale, 4),
                       "dpScale": round(result.dp_scale, 4), "samples": result.samples,
                       "fitted": list(result.fitted)}, sort_keys=True)


def plan_constants_key(plan: ServerPlan, architecture: str | None) -> str:
    """The ConfigMap key of the hardware and software a plan runs on."""
    return constants_key(plan.gpu_product or "unknown-gpu", plan.interconnect, plan.sglang_version or "unknown",
                         architecture or "unknown")


def combined(stored: Refit | None, measured: Refit) -> Refit:
    """`measured` (multipliers on the constants the plan used) as multipliers on the published fit: the plan
    started from `stored` when there was one."""
    if stored is None:
        return measured
    return replace(measured, expert_speed=stored.expert_speed * measured.expert_speed,
                   collective_scale=stored.collective_scale * measured.collective_scale,
                   dp_scale=stored.dp_scale * measured.dp_scale,
                   fitted=tuple(dict.fromkeys((*stored.fitted, *measured.fitted))))


MAX_ENTRY_BYTES = 4096


def read_constants(data: dict[str, str] | None, key: str) -> Refit | None:
    """The stored multipliers for `key`, or None; an entry that is not what constants_entry wrote is ignored
    (the ConfigMap is the operator's, but a person may edit it)."""
    raw = (data or {}).get(key)
    if raw is None or len(raw) > MAX_ENTRY_BYTES:
        return None
    try:
        entry = json.loads(raw)
        values = [float(entry[name]) for name in ("expertSpeed", "collectiveScale", "dpScale")]
    except (ValueError, KeyError, TypeError):
        return None
    if not all(0.05 <= v <= 20 for v in values):
        return None
    expert, collective, dp = values
    return Refit(expert, collective, dp, samples=int(entry.get("samples", 0)), error_before=0.0, error_after=0.0,
                 fitted=tuple(str(n) for n in entry.get("fitted", ())))
