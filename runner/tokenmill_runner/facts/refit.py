"""The hardware constants a plan rests on, refitted from what the running server shows. Pure.

A plan's step time (throughput.py) has three parts fitted on public records that say least about an unseen
cluster: how fast the routed experts are read (the MoE kernel's memory efficiency), what a collective costs on this
link (latency and bytes alike: `collective_scale`), and DP attention's per-layer overhead. In a run's first minutes
the server reports its batch and generation throughput (SGLang /metrics: num_running_reqs, gen_throughput, token
usage), so each scrape is a (batch, context, step seconds) pair: step = running / gen_throughput. The batch ramps up
from the first admissions, so the pairs span small batches (few experts touched) and full ones.

With the step memory-bound (the decode regime of these models), the step is linear in the three multipliers:

    step = dense + fixed + experts(B) / e + collectives(B) x c + dp x d

with `dense` (attention and dense weights, the KV cache) and `fixed` (floors) kept from the plan's calibration.
A least-squares fit in relative error, with a weak pull towards the plan's own values (RIDGE) so that a part the
pairs cannot tell apart stays where the plan had it, gives (1/e, c, d). Parts the layout does not have (no DP
attention, one GPU) are not fitted. Eager steps (a DP group past its CUDA graph) and compute-bound pairs are left
out: they follow other costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .throughput import Calibration, StepModel

RIDGE = 1e-8
# A fit needs batches that differ: fewer distinct batches than this leave the plan's constants alone.
MIN_DISTINCT_BATCHES = 4


@dataclass(frozen=True)
class StepSample:
    """One observation: the replica's running requests, their mean KV tokens and the decode step's seconds."""

    batch: float
    context_tokens: float
    step_seconds: float


@dataclass(frozen=True)
class Refit:
    """The refitted multipliers of the plan's calibration, and how well the refitted model explains the samples."""

    expert_speed: float  # the experts are read this many times as fast as the plan assumed
    collective_scale: float  # collectives cost this many times the plan's
    dp_scale: float  # DP attention's overhead is this many times the plan's
    samples: int
    error_before: float  # mean absolute relative error of the plan's step model on the samples
    error_after: float  # ... of the refitted one
    fitted: tuple[str, ...]  # the parts the samples could move

    def calibration(self, base: Calibration) -> Calibration:
        return replace(base,
                       moe_memory_efficiency=base.moe_memory_efficiency * self.expert_speed,
                       quantized_moe_memory_efficiency=base.quantized_moe_memory_efficiency * self.expert_speed,
                       collective_scale=base.collective_scale * self.collective_scale,
                       dp_attention_layer_s=base.dp_attention_layer_s * self.dp_scale)


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for the small normal equations."""
    n = len(vector)
    a = [row[:] + [vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            raise ValueError("singular refit")
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def _error(step: StepModel, samples: Sequence[StepSample]) -> float:
    return sum(abs(step.step_seconds(s.batch, s.context_tokens) / s.step_seconds - 1) for s in samples) / len(samples)


def refit(step: StepModel, samples: Sequence[StepSample]) -> Refit:
    """The multipliers that best explain `samples` (graph decode steps) for the plan's step model."""
    usable = [s for s in samples if s.step_seconds > 0 and s.batch >= 1]
    parts = [step.parts(s.batch, s.context_tokens) for s in usable]
    kept = [(s, p) for s, p in zip(usable, parts, strict=True) if p.dense + p.experts >= p.compute]
    names = ["experts", "collectives", "dp"]
    present = [n for n in names if any(getattr(p, n) > 0 for _, p in kept)]
    if len({round(s.batch) for s, _ in kept}) < MIN_DISTINCT_BATCHES or not present:
        error = _error(step, usable) if usable else 0.0
        return Refit(1.0, 1.0, 1.0, len(usable), error, error, ())
    # Relative residuals: every pair weighs the same whatever its step length.
    rows = [[getattr(p, n) / s.step_seconds for n in present] for s, p in kept]
    targets = [1.0 - (p.dense + p.fixed) / s.step_seconds for s, p in kept]
    k = len(present)
    normal = [[sum(r[i] * r[j] for r in rows) + (RIDGE * len(rows) if i == j else 0.0) for j in range(k)]
              for i in range(k)]
    right = [sum(r[i] * t for r, t in zip(rows, targets, strict=True)) + RIDGE * len(rows) for i in range(k)]
    solved = dict(zip(present, (max(x, 0.05) for x in _solve(normal, right)), strict=True))
    fitted = Refit(expert_speed=1.0 / solved.get("experts", 1.0), collective_scale=solved.get("collectives", 1.0),
                   dp_scale=solved.get("dp", 1.0), samples=len(usable), error_before=_error(step, usable),
                   error_after=0.0, fitted=tuple(present))
    after = replace(step, calibration=fitted.calibration(step.calibration))
    error_after = _error(after, usable)
    if error_after > fitted.error_before + 1e-9:
        # The fit explains the pairs worse than the plan (a multiplier held at its floor, pairs the model's
        # parts cannot tell apart): the plan's constants stay, rather than worse ones kept for the cluster.
        return Refit(1.0, 1.0, 1.0, len(usable), fitted.error_before, fitted.error_before, ())
    return replace(fitted, error_after=error_after)


def refitted(step: StepModel, result: Refit) -> StepModel:
    """The plan's step model with the refitted constants."""
    return replace(step, calibration=result.calibration(step.calibration))


def relative_gap(predicted: float, observed: float) -> float:
    """observed / predicted - 1 (0 when nothing is predicted)."""
    return observed / predicted - 1 if predicted else math.inf
