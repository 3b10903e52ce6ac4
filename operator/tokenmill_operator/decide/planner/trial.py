"""A measured trial for long jobs: the plan's closest candidates each run a few minutes on the GPUs, and the job
continues on the one measured fastest. Pure: plain functions over plain data. The operator (its wiring,
`spec.server.trial`, is to come) scrapes SGLang's /metrics, restarts the server in each layout and hands the samples
in; nothing here talks to Kubernetes or HTTP.

The rules (docs/planning.md, "4d. A measured trial"):

1. Which candidates (`select`): the runnable candidates whose predicted ETA interval overlaps the best one's (the
   plan cannot tell them apart), best first, at most `max_candidates`, and only as many as the trial budget pays
   for: each switch costs a restart (the plan's start-up model, with the weights already on the node) plus a
   measuring time, and one more restart is kept back for continuing on a winner that is not the last one measured;
   all of it within `budget_share` (5 %) of the job's predicted ETA. None when not even one alternative fits: the
   job is too short for a trial to pay.
2. Steady state (`steady_state`) on (time, gen_throughput, num_running_reqs, num_queue_reqs) samples: the warm-up
   ends once the batch has filled (requests queued, or running at the cap) and the running count has stopped rising
   (within RISE_TOLERANCE over SETTLE_S); from there, once WINDOW_S of filled samples are in and the last window's
   throughput has a coefficient of variation under CV_MAX and a change between its halves' means under CHANGE_MAX,
   the steady throughput is the stretch's mean with a Student-t interval whose sample count is corrected for the
   samples' lag-1 autocorrelation. Otherwise "not yet", with the reason.
3. The stopping rule (`should_stop`): a candidate is measured until its interval is disjoint from every other
   measured candidate's and its throughput at least RESOLUTION (3 %) from theirs (ranked), or, for the first one, narrower than PRECISION; or until its time budget is spent,
   when it is ranked on what is there and flagged. `conclude` picks the measured fastest (flagged when its interval
   overlaps the runner-up's) and decides whether to continue on it with verify.decide: its remaining ETA plus one
   more restart (none when it is the one running) against staying, with decide's margin (5 % of the remaining time,
   at least 10 minutes). When the ranking against the running layout is flagged, the comparison takes the winner's
   low end against the running one's high end: an unresolved difference never pays a restart.
4. The sample: each candidate is sent its own rows first, drawn from every dataset in proportion to the job's
   predicted output tokens (tokenmill_runner/source/stratified.py: the runner draws them, since only it counts the
   rows); `sample_prompts` sizes it to keep the batch full for the measuring time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tokenmill_runner.spec.config import MAX_TRIAL_PROMPTS

from .plan import ServerPlan
from .startup import StartupPlan
from .verify import Decision, ReplanMode, decide, layout_name

# Selection.
BUDGET_SHARE = 0.05  # of the job's predicted ETA
MAX_CANDIDATES = 3  # the running layout included
MEASURE_S = 300.0  # each candidate's measuring time (warm-up included), "a few minutes"
MIN_MEASURE_S = 120.0  # below this a measurement cannot reach a steady window: no trial
# Steady state.
SETTLE_S = 30.0  # the running count stays within RISE_TOLERANCE this long before the warm-up is over
RISE_TOLERANCE = 0.05
CAP_SHARE = 0.95  # running at or above this share of the cap counts as full
WINDOW_S = 60.0  # the window whose stability is tested
MIN_SAMPLES = 6
CV_MAX = 0.10  # coefficient of variation of the window's throughput samples
CHANGE_MAX = 0.05  # relative change between the means of the window's halves (a trend)
FILLED_SHARE = 0.9  # of the window's samples with the batch full (a draining batch is not steady)
# The interval's level. The stopping rule looks at it after every scrape, and each look is another chance for
# noise to part two intervals: 99 %, not 95 %, keeps that from ranking candidates 2 % apart (tests/unit/test_trial.py).
CONFIDENCE = 0.99
# Stopping.
PRECISION = 0.02  # relative half-width at which the first candidate is measured well enough
# The smallest relative difference a trial ranks, disjoint intervals or not: the interval holds the gauge's noise,
# not the spread between the candidates' different prompt samples nor the batch's mix still moving toward the job's
# in the first minutes. Below it a switch would not pay anyway: decide's margin alone is 5 % of the remaining time.
RESOLUTION = 0.03
# Nor is a candidate ranked on less than this much steady time (one window is a minute of noisy gauges).
MIN_RANK_S = 90.0

Stop = Literal["continue", "ranked", "precise", "budget"]


# --------------------------------------------------------------------------------------------------------------
# 1. Which candidates.


@dataclass(frozen=True)
class Option:
    """One layout as the trial sees it: its predicted ETA and interval (seconds, whole job)."""

    name: str
    eta_s: float
    eta_low_s: float
    eta_high_s: float
    running: bool = False  # the plan's pick: the layout the server starts in

    def overlaps(self, other: Option) -> bool:
        return self.eta_low_s <= other.eta_high_s and other.eta_low_s <= self.eta_high_s


@dataclass(frozen=True)
class TrialPlan:
    """The candidates to measure, in order (the running layout first), and what the trial may spend."""

    candidates: tuple[str, ...]  # empty: no trial
    measure_s: float  # each candidate's time budget
    restart_s: float
    budget_s: float
    reason: str

    @property
    def worthwhile(self) -> bool:
        return len(self.candidates) > 1

    @property
    def cost_s(self) -> float:
        """Worst case of what the trial adds: a restart and a measurement per alternative, one restart more."""
        switches = max(0, len(self.candidates) - 1)
        return switches * (self.restart_s + self.measure_s) + (self.restart_s if switches else 0.0)


def restart_seconds(startup: StartupPlan | None) -> float:
    """A restart in another layout on the same nodes: the load (with CUDA graphs and warm-up), plus the copy only
    when every start copies (no cache: the weights are not kept on the node)."""
    if startup is None:
        return 0.0
    every_start = "on every start" in startup.source or "in every pod" in startup.source
    return float(startup.load_seconds + (startup.copy_seconds if every_start else 0))


def options(plan: ServerPlan) -> list[Option]:
    """The plan's runnable candidates the spec allows (and the chosen one), with their ETA intervals; a candidate
    without an interval has its point as both ends."""
    found = []
    for c in plan.candidates:
        p = c.prediction
        if p is None or not (c.choosable or c.chosen):
            continue
        low = p.interval.eta_seconds_low if p.interval is not None else p.eta_seconds
        high = p.interval.eta_seconds_high if p.interval is not None else p.eta_seconds
        found.append(Option(layout_name(c.replicas, c.tensor_parallel, c.attention_data_parallel, c.kv_cache_dtype),
                            float(p.eta_seconds), float(min(low, p.eta_seconds)), float(max(high, p.eta_seconds)),
                            running=c.chosen))
    return found


def select(choices: Sequence[Option], restart_s: float, budget_share: float = BUDGET_SHARE,
           max_candidates: int = MAX_CANDIDATES, measure_s: float = MEASURE_S,
           min_measure_s: float = MIN_MEASURE_S) -> TrialPlan:
    """Rule 1. The running option (else the best predicted) first, then the alternatives whose ETA interval overlaps
    the best one's, by predicted ETA, as many as the budget pays for. When the full measuring time does not fit for
    one alternative, a shorter one down to `min_measure_s` is taken."""
    if not choices:
        return TrialPlan((), measure_s, restart_s, 0.0, "no runnable candidate")
    best = min(choices, key=lambda o: o.eta_s)
    first = next((o for o in choices if o.running), best)
    budget = budget_share * first.eta_s
    close = sorted((o for o in choices if o is not first and o.overlaps(best)), key=lambda o: o.eta_s)
    if not close:
        return TrialPlan((first.name,), measure_s, restart_s, budget,
                         "no other candidate's predicted ETA interval overlaps the best one's")
    wanted = close[:max(0, max_candidates - 1)]
    if not wanted:
        return TrialPlan((first.name,), measure_s, restart_s, budget, f"max_candidates {max_candidates}: no alternative")

    def cost(n: int, measure: float) -> float:
        return n * (restart_s + measure) + restart_s

    n = len(wanted)
    while n > 0 and cost(n, measure_s) > budget:
        n -= 1
    measure = measure_s
    if n == 0:
        # One alternative with a shorter measurement, if that still reaches a steady window.
        measure = budget - 2 * restart_s
        if measure < min_measure_s:
            return TrialPlan((first.name,), measure_s, restart_s, budget,
                             f"too short for a trial: one switch costs {cost(1, min_measure_s):,.0f} s (restart "
                             f"{restart_s:,.0f} s twice + {min_measure_s:,.0f} s measuring), the budget is "
                             f"{budget_share:.0%} of {first.eta_s:,.0f} s = {budget:,.0f} s")
        n = 1
    picked = (first.name, *(o.name for o in wanted[:n]))
    return TrialPlan(picked, measure, restart_s, budget,
                     f"{n} alternative(s) within the best's interval; {cost(n, measure):,.0f} s of at most "
                     f"{budget:,.0f} s ({budget_share:.0%} of the predicted {first.eta_s:,.0f} s)")


def plan_trial(plan: ServerPlan, budget_share: float = BUDGET_SHARE, max_candidates: int = MAX_CANDIDATES,
               measure_s: float = MEASURE_S) -> TrialPlan:
    """select() on a ServerPlan: its candidates and its start-up model's restart."""
    return select(options(plan), restart_seconds(plan.startup), budget_share, max_candidates, measure_s)


# --------------------------------------------------------------------------------------------------------------
# 2. Steady state.


@dataclass(frozen=True)
class MetricPoint:
    """One scrape of one replica (summed over its schedulers): seconds since the candidate started serving."""

    t: float
    gen_throughput: float
    running: float
    queued: float


@dataclass(frozen=True)
class Steady:
    """The steady throughput with its interval, or why there is none yet (`found` False)."""

    found: bool
    reason: str
    throughput: float = 0.0
    low: float = 0.0
    high: float = 0.0
    start_t: float = 0.0  # the steady stretch: first and last sample times
    end_t: float = 0.0
    samples: int = 0
    cv: float = 0.0

    @property
    def half_width(self) -> float:
        """Relative half-width of the interval."""
        return (self.high - self.low) / 2 / self.throughput if self.throughput > 0 else math.inf


def _t_quantile(df: float, confidence: float = CONFIDENCE) -> float:
    """Two-sided Student-t quantile: 95 % and 99 % by table (interpolated in 1/df), other levels the normal's with
    a small-sample widening."""
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    tables = {0.95: ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (6, 2.447), (8, 2.306),
                     (10, 2.228), (15, 2.131), (20, 2.086), (30, 2.042), (60, 2.000), (120, 1.980)),
              0.99: ((1, 63.657), (2, 9.925), (3, 5.841), (4, 4.604), (5, 4.032), (6, 3.707), (8, 3.355),
                     (10, 3.169), (15, 2.947), (20, 2.845), (30, 2.750), (60, 2.660), (120, 2.617))}
    table = tables.get(confidence)
    if table is None:
        return z * (1 + 1 / max(df, 1.0))
    if df <= 1:
        return table[0][1]
    for (d0, q0), (d1, q1) in zip(table, table[1:], strict=False):
        if df <= d1:
            w = (1 / df - 1 / d0) / (1 / d1 - 1 / d0)
            return q0 + w * (q1 - q0)
    return z + (table[-1][1] - z) * 120 / df


def _filled(p: MetricPoint, cap: float | None) -> bool:
    return p.queued > 0 or (cap is not None and p.running >= CAP_SHARE * cap)


def warmup_end(points: Sequence[MetricPoint], cap: float | None = None, settle_s: float = SETTLE_S,
               rise_tolerance: float = RISE_TOLERANCE) -> int | None:
    """Index of the first sample past the warm-up: the batch full there, and the running count over the `settle_s`
    before it within `rise_tolerance` of it (it has stopped rising); None while warming up."""
    start = 0
    for i, p in enumerate(points):
        while points[start].t < p.t - settle_s:
            start += 1
        if p.t - points[0].t < settle_s or not _filled(p, cap) or p.running <= 0:
            continue
        span = [q.running for q in points[start:i + 1]]
        if (max(span) - min(span)) <= rise_tolerance * p.running and all(_filled(q, cap) for q in points[start:i + 1]):
            return i
    return None


def _cv(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else math.inf


def _halves_change(values: Sequence[float]) -> float:
    half = len(values) // 2
    a, b = statistics.fmean(values[:half]), statistics.fmean(values[half:])
    return abs(b / a - 1) if a > 0 else math.inf


def _interval(values: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """Mean and interval, the sample count reduced by the lag-1 autocorrelation (n (1 - r) / (1 + r))."""
    n, mean = len(values), statistics.fmean(values)
    sd = statistics.stdev(values) if n > 1 else 0.0
    r = 0.0
    if n > 2 and sd > 0:
        dev = [v - mean for v in values]
        r = sum(a * b for a, b in zip(dev, dev[1:], strict=False)) / sum(d * d for d in dev)
        r = max(0.0, min(0.9, r))
    n_eff = max(2.0, n * (1 - r) / (1 + r))
    half = _t_quantile(n_eff - 1, confidence) * sd / math.sqrt(n_eff)
    return mean, mean - half, mean + half


def steady_state(points: Sequence[MetricPoint], cap: float | None = None, window_s: float = WINDOW_S,
                 cv_max: float = CV_MAX, change_max: float = CHANGE_MAX, min_samples: int = MIN_SAMPLES, settle_s: float = SETTLE_S,
                 confidence: float = CONFIDENCE) -> Steady:
    """Rule 2 on one candidate's samples so far (in time order). `cap`: its max running requests, when known."""
    points = [p for p in points if p.gen_throughput > 0]
    if not points:
        return Steady(False, "no throughput reported yet")
    w = warmup_end(points, cap, settle_s)
    if w is None:
        return Steady(False, "warming up: the batch has not filled (nothing queued, running under its cap) or the "
                             "running count is still rising")
    stretch = list(points[w:])
    # A draining batch (nothing queued, running falling) at the end is not steady: cut it.
    while stretch and not _filled(stretch[-1], cap):
        stretch.pop()
    if not stretch or stretch[-1].t - stretch[0].t < window_s or len(stretch) < min_samples:
        return Steady(False, f"filled at {points[w].t:,.0f} s; waiting for {window_s:,.0f} s of steady samples")
    end = stretch[-1].t
    window = [p for p in stretch if p.t >= end - window_s]
    if len(window) < min_samples:
        return Steady(False, f"fewer than {min_samples} samples in the last {window_s:,.0f} s")
    if sum(_filled(p, cap) for p in window) < FILLED_SHARE * len(window):
        return Steady(False, "the batch is not full over the window")
    values = [p.gen_throughput for p in window]
    cv, change = _cv(values), _halves_change(values)
    if cv > cv_max or change > change_max:
        return Steady(False, f"not steady: throughput CV {cv:.1%} (at most {cv_max:.0%}), change between the "
                             f"window's halves {change:.1%} (at most {change_max:.0%})")
    # The longest steady stretch: from the warm-up's end, or the latest start past it whose stretch to now does not
    # drift (its halves within half of change_max); the last window at least.
    used = window
    for i in range(len(stretch) - len(window) + 1):
        if _halves_change([p.gen_throughput for p in stretch[i:]]) <= change_max / 2:
            used = stretch[i:]
            break
    mean, low, high = _interval([p.gen_throughput for p in used], confidence)
    return Steady(True, "steady", mean, low, high, used[0].t, used[-1].t, len(used), _cv([p.gen_throughput for p in used]))


# --------------------------------------------------------------------------------------------------------------
# 3. The stopping rule and the winner.


@dataclass(frozen=True)
class Measurement:
    """One candidate's trial so far: its name, its steady state, the seconds it has been measured (from its first
    sample) and its time budget."""

    name: str
    steady: Steady
    elapsed_s: float
    budget_s: float
    flagged: bool = False  # stopped on its budget without being ranked against the others


def _separated(a: Steady, b: Steady, resolution: float = RESOLUTION) -> bool:
    """Ranked apart: disjoint intervals and point estimates at least `resolution` apart."""
    disjoint = a.low > b.high or b.low > a.high
    return disjoint and abs(a.throughput - b.throughput) >= resolution * min(a.throughput, b.throughput)


def should_stop(current: Measurement, others: Sequence[Measurement], precision: float = PRECISION) -> Stop:
    """Rule 3 for the candidate being measured: "ranked" when its interval is disjoint from every other measured
    one's, "precise" when there is no other yet and its interval is within `precision`, "budget" when its time is
    spent (ranked on what is there, flagged), else "continue"."""
    s = current.steady
    measured = [o for o in others if o.steady.found]
    if s.found:
        if measured and s.end_t - s.start_t >= MIN_RANK_S and all(_separated(s, o.steady) for o in measured):
            return "ranked"
        if not measured and s.half_width <= precision:
            return "precise"
    if current.elapsed_s >= current.budget_s:
        return "budget"
    return "continue"


def finish(current: Measurement, stop: Stop) -> Measurement:
    """The measurement as it is kept: flagged when it stopped on its budget (should_stop says "ranked" or "precise"
    first whenever either holds)."""
    return Measurement(current.name, current.steady, current.elapsed_s, current.budget_s, stop == "budget")


def measure(name: str, points: Iterable[MetricPoint], budget_s: float, others: Sequence[Measurement] = (),
            cap: float | None = None, precision: float = PRECISION) -> tuple[Measurement, Stop]:
    """One candidate's measurement, its samples taken as they come until should_stop says stop (the operator calls
    steady_state and should_stop scrape by scrape; this is that loop over a finished series). Time is counted
    from the first sample; a series that ends first is ranked on what is there, flagged."""
    seen: list[MetricPoint] = []
    current = Measurement(name, Steady(False, "no samples"), 0.0, budget_s)
    for p in points:
        seen.append(p)
        current = Measurement(name, steady_state(seen, cap), p.t - seen[0].t, budget_s)
        stop = should_stop(current, others, precision)
        if stop != "continue":
            return finish(current, stop), stop
    return finish(current, "budget"), "budget"


@dataclass(frozen=True)
class TrialResult:
    """The ranking (fastest first), the winner, whether it is told apart from the runner-up, and the decision."""

    ranking: tuple[str, ...]
    winner: str
    flagged: bool  # the winner's interval overlaps the runner-up's: not ranked within the budget
    decision: Decision | None
    running: str
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def continue_on(self) -> str:
        return self.winner if self.decision is not None and self.decision.action != "stay" else self.running


def conclude(measurements: Sequence[Measurement], running: str, remaining_tokens: float, restart_s: float,
             mode: ReplanMode = "auto") -> TrialResult:
    """Pick the measured fastest and decide whether to continue on it (rule 3). `running`: the layout the server
    runs at the end of the trial (the last one measured); `remaining_tokens`: output tokens still to generate."""
    found = [m for m in measurements if m.steady.found]
    if not found:
        return TrialResult((), running, True, None, running, ("no candidate reached a steady state",))
    ranked = sorted(found, key=lambda m: -m.steady.throughput)
    winner = ranked[0]
    flagged = len(ranked) > 1 and not _separated(winner.steady, ranked[1].steady)
    notes = [f"{m.name}: {m.steady.throughput:,.0f} tok/s [{m.steady.low:,.0f}, {m.steady.high:,.0f}]"
             + (" (budget spent, unranked)" if m.flagged else "") for m in ranked]
    stay = next((m for m in found if m.name == running), None)
    if stay is None or winner.name == running:
        return TrialResult(tuple(m.name for m in ranked), winner.name, flagged, None, running, tuple(notes))
    unresolved = not _separated(winner.steady, stay.steady)
    stay_rate = stay.steady.high if unresolved else stay.steady.throughput
    win_rate = winner.steady.low if unresolved else winner.steady.throughput
    current = remaining_tokens / stay_rate
    alternative = remaining_tokens / max(win_rate, 1e-9)
    decision = decide(current, {winner.name: alternative}, restart_s, mode)
    if unresolved:
        notes.append(f"{winner.name} against {running}: intervals overlap, compared at the winner's low end and the "
                     "running layout's high end")
    return TrialResult(tuple(m.name for m in ranked), winner.name, flagged, decision, running, tuple(notes))


# --------------------------------------------------------------------------------------------------------------
# 4. The sample's size (the sample itself is the runner's: tokenmill_runner/source/stratified.py).


def prompts_needed(batch: float, measure_s: float, requests_per_s: float, headroom: float = 1.5) -> int:
    """Prompts that keep one candidate's batch full for its measuring time: the batch plus what completes in it,
    with headroom (a trial that runs out of prompts drains, and a draining batch is no steady state)."""
    return math.ceil(batch + headroom * measure_s * max(requests_per_s, 0.0))


def sample_prompts(plan: ServerPlan, candidates: Sequence[str], measure_s: float) -> int:
    """Rows of each candidate's sample: enough for the one among `candidates` that needs most (its batch over all
    replicas, its requests per second at its decode rate over the job's mean output), at most MAX_TRIAL_PROMPTS.
    Samples per prompt above 1 make each row more requests: headroom, not a shortfall."""
    prediction = plan.prediction
    if prediction is None or not prediction.datasets:
        return 0
    samples = sum(d.samples for d in prediction.datasets)
    mean_output = sum(d.samples * d.mean_output_tokens for d in prediction.datasets) / max(samples, 1)
    wanted = set(candidates)
    needed = 0
    for c in plan.candidates:
        p = c.prediction
        if p is None or layout_name(c.replicas, c.tensor_parallel, c.attention_data_parallel,
                                    c.kv_cache_dtype) not in wanted:
            continue
        rate = p.decode_tokens_per_second / max(mean_output, 1.0)
        needed = max(needed, prompts_needed(p.batch_per_replica * c.replicas, measure_s, rate))
    return min(needed, MAX_TRIAL_PROMPTS)
