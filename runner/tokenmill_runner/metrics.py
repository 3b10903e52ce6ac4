"""The runner's Prometheus metrics (names and labels: docs/metrics.md), in a registry of their own."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, float("inf"))
LENGTH_BUCKETS = (32, 64, 100, 128, 256, 300, 500, 512, 1000, 1024, 2048, 4096, 5000, 8192, 10240, 16384, 32768,
                  65536, float("inf"))
BASE = ("dsgen", "namespace")
# Answers `answered` holds back at most (per dataset) before it publishes them itself: a bound on memory at 10M
# samples with no scrape, ~100 KB, and batches large enough that their publishing costs little per answer.
HELD_ANSWERS = 4096


class _Published:
    """A metric that `answered` feeds: before it is collected (a scrape, a test's read) it publishes what
    `answered` holds back, so a reader sees every answer counted as though each had been counted at once."""

    before_collect: Callable[[], None] | None = None

    def collect(self) -> Iterable[Metric]:
        if self.before_collect is not None:
            self.before_collect()
        return super().collect()  # type: ignore[misc]


class _Counter(_Published, Counter):
    pass


class _Histogram(_Published, Histogram):
    pass


class _Answers:
    """One dataset's answers not yet in its series."""

    __slots__ = ("retried", "ok", "failed", "tokens", "latencies", "lengths")

    def __init__(self) -> None:
        self.retried = self.ok = self.failed = self.tokens = 0
        self.latencies: list[float] = []
        self.lengths: list[int] = []


def _observe_all(histogram: Any, values: list[float] | list[int]) -> None:
    """`histogram.observe` of each value, counted per bucket at once (each observe takes a lock and walks the
    buckets; the runner answers thousands of requests a second)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets, total = getattr(histogram, "_buckets", None), getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:  # another prometheus_client's internals: one by one
        for value in values:
            histogram.observe(value)
        return
    histogram._raise_if_not_observable()  # noqa: SLF001 - as observe does
    total.inc(sum(values))
    # observe counts a value in the first bucket whose bound is at least the value
    for index, count in enumerate(np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds))):
        if count:
            buckets[index].inc(int(count))


@dataclass
class RunnerMetrics:
    registry: CollectorRegistry
    requests: Counter
    generated_tokens: Counter
    committed_samples: Counter
    failed_samples: Counter
    in_flight: Gauge
    latency: Histogram
    completion_tokens: Histogram
    last_commit: Gauge
    remaining: Gauge
    replica_live: Gauge
    outage_seconds: Gauge
    labels: dict[str, str]
    _children: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False, repr=False)
    _answers: dict[str, tuple[Any, ...]] = field(default_factory=dict, init=False, repr=False)
    # answered() on the loop, publishing in the scrape's thread: what is held back changes hands under the lock
    _pending: dict[str, _Answers] = field(default_factory=dict, init=False, repr=False)
    _pending_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        for metric in (self.requests, self.generated_tokens, self.latency, self.completion_tokens):
            if isinstance(metric, _Published):
                metric.before_collect = self.publish

    @classmethod
    def create(cls, dsgen: str, namespace: str, worker: int) -> RunnerMetrics:
        registry = CollectorRegistry()
        per_dataset = (*BASE, "dataset", "worker")
        return cls(
            registry=registry,
            requests=_Counter("tokenmill_runner_requests", "/generate attempts by outcome",
                             (*per_dataset, "outcome"), registry=registry),
            generated_tokens=_Counter("tokenmill_runner_generated_tokens", "Output tokens received", per_dataset,
                                     registry=registry),
            committed_samples=Counter("tokenmill_runner_committed_samples", "Samples in committed shards",
                                      per_dataset, registry=registry),
            failed_samples=Counter("tokenmill_runner_failed_samples", "Samples recorded as errors, by reason",
                                   (*per_dataset, "reason"), registry=registry),
            in_flight=Gauge("tokenmill_runner_in_flight_requests", "Requests sent and not yet answered",
                            (*BASE, "worker"), registry=registry),
            latency=_Histogram("tokenmill_runner_request_latency_seconds", "Latency of successful requests",
                              per_dataset, buckets=LATENCY_BUCKETS, registry=registry),
            completion_tokens=_Histogram("tokenmill_runner_completion_tokens", "Output tokens per generated sample",
                                        per_dataset, buckets=LENGTH_BUCKETS, registry=registry),
            last_commit=Gauge("tokenmill_runner_last_commit_timestamp_seconds", "Unix time of the last commit",
                              per_dataset, registry=registry),
            remaining=Gauge("tokenmill_runner_samples_remaining", "Samples this worker still has to process",
                            per_dataset, registry=registry),
            replica_live=Gauge("tokenmill_runner_replica_live", "1 while the SGLang replica takes requests, 0 while "
                               "it is out of rotation and probed on /health", (*BASE, "worker", "replica"),
                               registry=registry),
            outage_seconds=Gauge("tokenmill_runner_outage_seconds", "Seconds since no replica has been live (0 "
                                 "while one is); the run stops at spec.runner.outageBudgetSeconds",
                                 (*BASE, "worker"), registry=registry),
            labels={"dsgen": dsgen, "namespace": namespace, "worker": str(worker)},
        )

    def _of(self, dataset: str) -> dict[str, str]:
        return {**self.labels, "dataset": dataset}

    def _child(self, metric: Any, dataset: str | None, **extra: str) -> Any:
        """The metric's series for these labels, looked up once (prometheus_client's `labels()` costs microseconds,
        and some series change on every request)."""
        key = (id(metric), dataset, *extra.values())
        child = self._children.get(key)
        if child is None:
            labels = self.labels if dataset is None else self._of(dataset)
            child = self._children[key] = metric.labels(**labels, **extra)
        return child

    def answered(self, dataset: str, attempts: int, ok: bool, tokens: int, latency_s: float) -> None:
        """One sample's requests: held as plain numbers (once per sample on the runner's loop) until the series are
        collected (`publish`)."""
        if dataset not in self._answers:  # the series exist from the first answer on, as when counted at once
            self._answer_series(dataset)
        with self._pending_lock:
            pending = self._pending.get(dataset)
            if pending is None:
                pending = self._pending[dataset] = _Answers()
            pending.retried += attempts - 1
            if ok:
                pending.ok += 1
                pending.tokens += tokens
                pending.latencies.append(latency_s)
                pending.lengths.append(tokens)
            else:
                pending.failed += 1
            held = len(pending.latencies)
        if held >= HELD_ANSWERS:  # nobody scraping (a local run): published anyway, so memory stays flat
            self.publish()

    def publish(self) -> None:
        """Add the answers held back to their series (before any of them is collected)."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for dataset, answers in pending.items():
            series = self._answers[dataset]
            if answers.retried:
                series[0].inc(answers.retried)
            if answers.ok:
                series[1].inc(answers.ok)
                series[3].inc(answers.tokens)
                _observe_all(series[4], answers.latencies)
                _observe_all(series[5], answers.lengths)
            if answers.failed:
                series[2].inc(answers.failed)

    def _answer_series(self, dataset: str) -> tuple[Any, ...]:
        """The series `answered` updates for one dataset (retried, ok, failed requests; tokens; latency; lengths)."""
        series = (*(self._child(self.requests, dataset, outcome=outcome) for outcome in ("retried", "ok", "failed")),
                  self._child(self.generated_tokens, dataset), self._child(self.latency, dataset),
                  self._child(self.completion_tokens, dataset))
        self._answers[dataset] = series
        return series

    def committed(self, dataset: str, rows: int, reasons: list[str]) -> None:
        self._child(self.committed_samples, dataset).inc(rows)
        for reason in reasons:
            self._child(self.failed_samples, dataset, reason=reason).inc()
        self._child(self.last_commit, dataset).set(time.time())

    def set_in_flight(self, count: int) -> None:
        self._child(self.in_flight, None).set(count)

    def count_in_flight(self, read: Callable[[], int]) -> None:
        """The in-flight gauge reads `read()` when scraped (two updates per request cost more than a scrape)."""
        self._child(self.in_flight, None).set_function(read)

    def replica_state(self, url: str, live: bool) -> None:
        self.replica_live.labels(**self.labels, replica=url).set(1 if live else 0)

    def outage(self, seconds: float) -> None:
        self.outage_seconds.labels(**self.labels).set(seconds)

    def set_remaining(self, dataset: str, count: int) -> None:
        self.remaining.labels(**self._of(dataset)).set(max(count, 0))

    def serve(self, port: int, address: str = "127.0.0.1") -> None:
        """Unauthenticated, like every /metrics: bound to this machine unless told otherwise (the runner Job binds
        0.0.0.0, and its NetworkPolicy admits only the scraper)."""
        start_http_server(port, addr=address, registry=self.registry)
        logger.info("metrics on %s:%d/metrics", address, port)
