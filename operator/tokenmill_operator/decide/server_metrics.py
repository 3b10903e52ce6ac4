"""SGLang's /metrics read as the plan's check needs it: one scrape of a replica becomes a (batch, step) sample, and
the scrapes of a run's first minutes make its verification window. Pure: the text comes from the edge
(`sglang_metrics.read_metrics`), the window lives in the operator's memory between passes (`gather.OutputIndex`).

What is read (scheduler gauges, SGLang 0.5.23 observability/metrics_collector.py; the same names in every supported
release, docs/metrics.md): `sglang:num_running_reqs` (the batch), `sglang:gen_throughput` (decode tokens/s, computed
every --decode-log-interval steps), `sglang:num_queue_reqs`, `sglang:num_used_tokens` (KV tokens held), and the
counter `sglang:num_retracted_requests_total` where the release has it. Each scheduler that reports (attn_tp_rank 0:
one per DP attention group) has its own series; a replica's figures are their sums. All groups step together, so
the replica's step is its running requests over its tokens per second: step = running / gen_throughput.

A group is its `dp_rank` label (0.5.23 observability/metrics_collector.py:1382-1392, 0.5.9
managers/scheduler_metrics_mixin.py:114-122: set whenever the scheduler has a DP rank; none without DP). With
--enable-metrics-for-all-schedulers every attention-TP rank of a group writes the same group's figures (0.5.23
metrics_collector.py:1361-1367, managers/scheduler_components/metrics_reporter.py:1072-1080: its own batch.reqs),
so one series per group is kept, its lowest `tp_rank`'s; under priority scheduling the total is the series with
priority="" (metrics_collector.py:1417-1429), the per-priority ones are skipped. A multi-node replica's groups are
on the nodes their schedulers run on, each node's /metrics serving its own (names.reporting_node_ranks): `combine`
adds the parts.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import datetime

from tokenmill_runner.facts.refit import StepSample

from .planner.trial import MetricPoint

RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
THROUGHPUT = "sglang:gen_throughput"
USED_TOKENS = "sglang:num_used_tokens"
RETRACTED = "sglang:num_retracted_requests_total"
WANTED = (RUNNING, QUEUED, THROUGHPUT, USED_TOKENS, RETRACTED)
# A scrape longer than this many lines is cut there (SGLang's /metrics is a few thousand lines with histograms).
MAX_LINES = 100_000
# Samples one window keeps (one per replica per pass: at a 15 s resync, ten minutes are 40 per replica).
MAX_SAMPLES = 4096
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Scrape:
    """One replica's scheduler figures at one moment (summed over its DP attention groups)."""

    running: float
    queued: float
    gen_throughput: float
    used_tokens: float
    retracted_total: float | None = None  # None: the release has no such counter
    groups: int = 1  # DP attention groups (distinct dp_rank) whose running requests it holds

    def sample(self) -> StepSample | None:
        """The (batch, step) pair of this scrape; None while nothing runs or no throughput is reported yet."""
        if self.running < 1 or self.gen_throughput <= 0:
            return None
        return StepSample(batch=self.running, context_tokens=self.used_tokens / self.running,
                          step_seconds=self.running / self.gen_throughput)


def _value(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _series_key(labels: str) -> tuple[str, int] | None:
    """(group, tp rank) of a series from its label set: the group is its dp_rank ("" without DP). None for a
    per-priority breakdown (priority="<int>"), which the total under priority="" already counts (0.5.23
    observability/metrics_collector.py:1417-1429)."""
    found = dict(_LABEL.findall(labels))
    if found.get("priority", ""):
        return None
    try:
        tp_rank = int(found.get("tp_rank", "0"))
    except ValueError:
        tp_rank = 0
    return found.get("dp_rank", ""), tp_rank


def parse_metrics(text: str) -> Scrape | None:
    """The replica's figures from a Prometheus text exposition (one node's, for a multi-node replica: `combine`);
    None when it has no scheduler gauges (metrics disabled, or not SGLang)."""
    # Per metric, per group: (tp rank, value) of the lowest tp rank seen.
    series: dict[str, dict[str, tuple[int, float]]] = {}
    for number, line in enumerate(text.splitlines()):
        if number >= MAX_LINES:
            break
        if not line.startswith("sglang:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in WANTED:
            continue
        labelled = "{" in line[:name_end + 1]
        close = line.rfind("}") if labelled else -1
        rest = line[close + 1:] if labelled else line[name_end:]
        fields = rest.split()
        value = _value(fields[0]) if fields else None
        if value is None:
            continue
        key = _series_key(line[name_end + 1:close]) if labelled and close > name_end else ("", 0)
        if key is None:
            continue
        group, tp_rank = key
        kept = series.setdefault(name, {})
        if group not in kept or tp_rank < kept[group][0]:
            kept[group] = (tp_rank, value)
    sums = {name: sum(value for _, value in groups.values()) for name, groups in series.items()}
    if RUNNING not in sums or THROUGHPUT not in sums:
        return None
    return Scrape(running=sums[RUNNING], queued=sums.get(QUEUED, 0.0), gen_throughput=sums[THROUGHPUT],
                  used_tokens=sums.get(USED_TOKENS, 0.0), retracted_total=sums.get(RETRACTED),
                  groups=len(series[RUNNING]))


def combine(parts: list[Scrape | None]) -> Scrape | None:
    """One replica's figures from the scrapes of its nodes that host DP attention groups (names.metrics_urls): their
    sums, each node holding its own groups. None when any part is missing: a sum over the nodes that answered
    would read as a smaller batch at the same step."""
    if not parts or any(p is None for p in parts):
        return None
    found = [p for p in parts if p is not None]
    if len(found) == 1:
        return found[0]
    retracted = [p.retracted_total for p in found if p.retracted_total is not None]
    return Scrape(running=sum(p.running for p in found), queued=sum(p.queued for p in found),
                  gen_throughput=sum(p.gen_throughput for p in found),
                  used_tokens=sum(p.used_tokens for p in found),
                  retracted_total=sum(retracted) if len(retracted) == len(found) else None,
                  groups=sum(p.groups for p in found))


@dataclass(frozen=True)
class WindowFacts:
    """What the verification window saw, as the pure decision takes it (lifecycle.py)."""

    opened: datetime  # the first scrape with running requests
    samples: tuple[StepSample, ...]
    retractions: int  # requests retracted since the window opened (all replicas)
    queued: float  # median of the queued requests per replica over the window

    def seconds(self, now: datetime) -> float:
        return (now - self.opened).total_seconds()


@dataclass
class VerificationWindow:
    """The samples of one plan's first minutes, gathered pass by pass (one per replica per pass). A new plan (its
    planned generation, or the layout the operator switched it to) starts a new window; an operator restart starts
    it again from its next scrape."""

    plan_key: Hashable = None
    opened: datetime | None = None
    samples: list[StepSample] = field(default_factory=list)
    queued: list[float] = field(default_factory=list)
    first_retracted: dict[int, float] = field(default_factory=dict)  # per replica
    last_retracted: dict[int, float] = field(default_factory=dict)

    def add(self, plan_key: Hashable, now: datetime, scrapes: dict[int, Scrape | None]) -> None:
        """Fold one pass's scrapes (by replica index; None where the replica could not be read) into the window of
        `plan_key` (what the plan is: its planned generation, and the layout it runs)."""
        if plan_key != self.plan_key:
            self.plan_key, self.opened = plan_key, None
            self.samples, self.queued = [], []
            self.first_retracted, self.last_retracted = {}, {}
        for replica, scrape in scrapes.items():
            if scrape is None:
                continue
            sample = scrape.sample()
            if sample is not None and self.opened is None:
                self.opened = now
            if self.opened is None:
                continue
            if scrape.retracted_total is not None:
                self.first_retracted.setdefault(replica, scrape.retracted_total)
                self.last_retracted[replica] = scrape.retracted_total
            if sample is not None and len(self.samples) < MAX_SAMPLES:
                self.samples.append(sample)
                self.queued.append(scrape.queued)

    def facts(self) -> WindowFacts | None:
        if self.opened is None or not self.samples:
            return None
        retracted = sum(max(0.0, self.last_retracted[r] - first) for r, first in self.first_retracted.items())
        return WindowFacts(self.opened, tuple(self.samples), int(retracted), statistics.median(self.queued))


@dataclass
class TrialScrapes:
    """The scrapes of the trial's candidate being measured (status.trial: its planned generation and index), kept
    in the operator's memory between passes as one whole-server series: a candidate's throughput is what all its
    replicas generate, so layouts with different replica counts compare. A new candidate starts a new series; an
    operator restart starts it again from its next scrape (status.trial keeps every finished measurement).

    `clock_scale` counts each wall second as that many of the trial's seconds: 1 in a cluster; the e2e tests,
    whose simulator runs faster than the wall clock, set it (TOKENMILL_TRIAL_CLOCK_SCALE) so the rules' minutes of
    settling, windows and budgets (planner/trial.py, calibrated together) pass in seconds."""

    key: tuple[int, int] | None = None
    opened: datetime | None = None
    points: list[MetricPoint] = field(default_factory=list)

    def add(self, key: tuple[int, int], now: datetime, scrapes: list[Scrape | None],
            clock_scale: float = 1.0) -> list[MetricPoint]:
        """Fold one pass's scrapes (one per replica; None where one could not be read: the pass adds no point,
        a sum over the replicas that answered would read as a slower layout)."""
        if key != self.key:
            self.key, self.opened, self.points = key, None, []
        if not scrapes or any(s is None for s in scrapes):
            return list(self.points)
        found = [s for s in scrapes if s is not None]
        if self.opened is None:
            self.opened = now
        if len(self.points) < MAX_SAMPLES:
            self.points.append(MetricPoint(t=(now - self.opened).total_seconds() * clock_scale,
                                           gen_throughput=sum(s.gen_throughput for s in found),
                                           running=sum(s.running for s in found),
                                           queued=sum(s.queued for s in found)))
        return list(self.points)
