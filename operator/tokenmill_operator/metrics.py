"""The operator's Prometheus gauges, one series set per DatasetGeneration (names: docs/metrics.md).

They are set from the status each reconcile pass computes, so dashboards and alerts work from the operator alone.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.exposition import generate_latest

from .decide.planner import ServerPlan
from .decide.progress import parse_time
from .decide.status import CONDITION_TYPES, DatasetGenerationStatus, Progress

logger = logging.getLogger(__name__)

PHASES = ("Pending", "Queued", "StartingServer", "Generating", "Reporting", "Succeeded", "Failed", "Suspended")
REGISTRY = CollectorRegistry()
KEY = ("dsgen", "namespace")
PER_DATASET = (*KEY, "dataset")


def _gauge(name: str, text: str, labels: tuple[str, ...]) -> Gauge:
    return Gauge(name, text, labels, registry=REGISTRY)


COMPLETED = _gauge("tokenmill_dsgen_samples_completed", "Committed samples with an output", PER_DATASET)
FAILED = _gauge("tokenmill_dsgen_samples_failed", "Samples recorded as failed", PER_DATASET)
GIVEN_UP = _gauge("tokenmill_dsgen_samples_given_up", "Failed samples given up for a server-side reason (retryable)",
                  PER_DATASET)
TOTAL = _gauge("tokenmill_dsgen_samples_total", "Samples to process", PER_DATASET)
REMAINING = _gauge("tokenmill_dsgen_samples_remaining", "Samples not yet committed", PER_DATASET)
TOKENS = _gauge("tokenmill_dsgen_generated_tokens", "Committed output tokens", PER_DATASET)
TOKENS_PER_S = _gauge("tokenmill_dsgen_tokens_per_second", "Committed tokens/s, last 10 minutes", PER_DATASET)
ETA = _gauge("tokenmill_dsgen_eta_seconds", "Seconds until everything is committed", PER_DATASET)
PREDICTED = _gauge("tokenmill_dsgen_predicted_tokens_per_second",
                   "Output tokens/s the server plan predicts for the job (status.serverPlan.prediction)", KEY)
PREDICTED_RUNNING = _gauge("tokenmill_dsgen_predicted_running_requests",
                           "Requests the server plan predicts running at once over all replicas (the batch its KV "
                           "cache holds), to set beside SGLang's sglang:num_running_reqs", KEY)
PLAN_MEMORY = _gauge("tokenmill_dsgen_plan_memory_mib",
                     "MiB per GPU as the server plan splits it: weights, kv cache, and each use outside "
                     "--mem-fraction-static (status.serverPlan.memorySplit)", (*KEY, "use"))
TRUNCATED = _gauge("tokenmill_dsgen_truncated_fraction", "Share of samples that hit maxNewTokens", PER_DATASET)
TRUNCATED_LIMIT = _gauge("tokenmill_dsgen_truncated_fraction_threshold", "spec.validation.maxTruncatedFraction", KEY)
ERRORS = _gauge("tokenmill_dsgen_error_fraction", "Failed / processed samples", PER_DATASET)
ERRORS_LIMIT = _gauge("tokenmill_dsgen_error_fraction_threshold", "spec.validation.maxErrorFraction", KEY)
PHASE = _gauge("tokenmill_dsgen_phase", "1 for the current phase", (*KEY, "phase"))
CONDITION = _gauge("tokenmill_dsgen_condition", "1 for each condition's current status",
                   (*KEY, "condition", "status"))
LAST_COMMIT = _gauge("tokenmill_dsgen_last_commit_timestamp_seconds", "Unix time of the newest commit", KEY)
INFO = _gauge("tokenmill_dsgen_info", "Model and report verdict", (*KEY, "model", "verdict"))
RECONCILE_ERRORS = Counter("tokenmill_operator_reconcile_errors", "Reconcile passes that raised", registry=REGISTRY)

_PER_RESOURCE = (COMPLETED, FAILED, GIVEN_UP, TOTAL, REMAINING, TOKENS, TOKENS_PER_S, ETA, TRUNCATED, TRUNCATED_LIMIT,
                 ERRORS, ERRORS_LIMIT, PHASE, CONDITION, LAST_COMMIT, INFO, PREDICTED, PREDICTED_RUNNING, PLAN_MEMORY)


Series = set[tuple[Gauge, tuple[str, ...]]]


def _set(touched: Series, metric: Gauge, value: float, **labels: str) -> None:
    metric.labels(**labels).set(value)
    touched.add((metric, tuple(labels[name] for name in metric._labelnames)))  # noqa: SLF001


def _progress(touched: Series, key: dict[str, str], dataset: str, progress: Progress) -> None:
    labels = {**key, "dataset": dataset}
    processed = progress.completed + progress.failed
    for metric, value in (
        (COMPLETED, progress.completed), (FAILED, progress.failed), (GIVEN_UP, progress.given_up),
        (TOTAL, progress.total),
        (REMAINING, max(progress.total - processed, 0)), (TOKENS, progress.generated_tokens),
        (TOKENS_PER_S, progress.tokens_per_second), (ERRORS, progress.failed / processed if processed else 0.0),
        (TRUNCATED, progress.truncated / progress.completed if progress.completed else 0.0),
    ):
        _set(touched, metric, value, **labels)
    if progress.eta_seconds is not None:
        _set(touched, ETA, progress.eta_seconds, **labels)


def publish(name: str, namespace: str, status: DatasetGenerationStatus, validation: dict[str, Any],
            model: str) -> None:
    """Set every series of one resource from its new status, then drop its series that no longer apply (a
    dataset, a condition status or an ETA that went away). Never remove-then-set: a scrape in between would see
    the resource vanish, resetting alerts' `for:` timers and `delta()`."""
    touched: Series = set()
    key = {"dsgen": name, "namespace": namespace}
    _progress(touched, key, "", status.progress)
    for dataset in status.datasets:
        _progress(touched, key, dataset.name, dataset)
    _set(touched, TRUNCATED_LIMIT, float(validation["max_truncated_fraction"]), **key)
    _set(touched, ERRORS_LIMIT, float(validation["max_error_fraction"]), **key)
    for phase in PHASES:
        _set(touched, PHASE, 1 if status.phase == phase else 0, **key, phase=phase)
    for condition in status.conditions:
        if condition.type in CONDITION_TYPES:
            _set(touched, CONDITION, 1, **key, condition=condition.type, status=condition.status)
    if status.last_commit_time:
        _set(touched, LAST_COMMIT, parse_time(status.last_commit_time).timestamp(), **key)
    _set(touched, INFO, 1, **key, model=model, verdict=status.report.verdict if status.report else "")
    plan = status.server_plan
    if plan is not None:
        _plan(touched, key, plan)
    for metric, labels in _series_of(name, namespace) - touched:
        metric.remove(*labels)


def _plan(touched: Series, key: dict[str, str], plan: ServerPlan) -> None:
    """The plan's prediction and memory split, so a wrong prediction shows in the first minutes: the predicted
    rate against the committed one (the alert), the predicted batch against SGLang's running requests."""
    if plan.prediction is not None:
        _set(touched, PREDICTED, plan.prediction.output_tokens_per_second, **key)
        _set(touched, PREDICTED_RUNNING, plan.prediction.batch_per_replica * plan.replicas, **key)
    kv_per_gpu = plan.kv_capacity_tokens // plan.attention_data_parallel * (plan.kv_bytes_per_token
                                                                             // plan.tensor_parallel)
    uses = {"weights": plan.weight_bytes_per_gpu / 2**20, "kv cache": kv_per_gpu / 2**20,
            **{term.name: term.mib for term in plan.memory_split}}
    for use, mib in uses.items():
        _set(touched, PLAN_MEMORY, mib, **key, use=use)


def _series_of(name: str, namespace: str) -> Series:
    found: Series = set()
    for metric in _PER_RESOURCE:
        for labels in list(metric._metrics):  # noqa: SLF001 - prometheus_client has no public listing
            values = dict(zip(metric._labelnames, labels, strict=True))  # noqa: SLF001
            if values["dsgen"] == name and values["namespace"] == namespace:
                found.add((metric, tuple(labels)))
    return found


def forget(name: str, namespace: str) -> None:
    """Drop every series of one resource (when it is deleted)."""
    for metric, labels in _series_of(name, namespace):
        metric.remove(*labels)


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Unauthenticated: in a pod, all interfaces (the chart's NetworkPolicy admits only the scraper); the bind
    address is the operator setting TOKENMILL_METRICS_ADDRESS."""
    start_http_server(port, addr=address, registry=REGISTRY)
    logger.info("operator metrics on %s:%d/metrics", address, port)


def exposition() -> bytes:
    return generate_latest(REGISTRY)
