"""The operator's Prometheus gauges, one series set per DatasetGeneration (names: docs/metrics.md).

They are set from the status each reconcile pass computes, so dashboards and alerts work from the operator alone.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.exposition import generate_latest

from .observe import parse_time
from .status import CONDITION_TYPES, DatasetGenerationStatus, Progress

logger = logging.getLogger(__name__)

PHASES = ("Pending", "StartingServer", "Generating", "Reporting", "Succeeded", "Failed", "Suspended")
REGISTRY = CollectorRegistry()
KEY = ("dsgen", "namespace")
PER_DATASET = (*KEY, "dataset")


def _gauge(name: str, text: str, labels: tuple[str, ...]) -> Gauge:
    return Gauge(name, text, labels, registry=REGISTRY)


COMPLETED = _gauge("tokenmill_dsgen_samples_completed", "Committed samples with an output", PER_DATASET)
FAILED = _gauge("tokenmill_dsgen_samples_failed", "Samples recorded as failed", PER_DATASET)
TOTAL = _gauge("tokenmill_dsgen_samples_total", "Samples to process", PER_DATASET)
REMAINING = _gauge("tokenmill_dsgen_samples_remaining", "Samples not yet committed", PER_DATASET)
TOKENS = _gauge("tokenmill_dsgen_generated_tokens", "Committed output tokens", PER_DATASET)
TOKENS_PER_S = _gauge("tokenmill_dsgen_tokens_per_second", "Committed tokens/s, last 10 minutes", PER_DATASET)
ETA = _gauge("tokenmill_dsgen_eta_seconds", "Seconds until everything is committed", PER_DATASET)
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

_PER_RESOURCE = (COMPLETED, FAILED, TOTAL, REMAINING, TOKENS, TOKENS_PER_S, ETA, TRUNCATED, TRUNCATED_LIMIT, ERRORS,
                 ERRORS_LIMIT, PHASE, CONDITION, LAST_COMMIT, INFO)


def _progress(key: dict[str, str], dataset: str, progress: Progress) -> None:
    labels = {**key, "dataset": dataset}
    COMPLETED.labels(**labels).set(progress.completed)
    FAILED.labels(**labels).set(progress.failed)
    TOTAL.labels(**labels).set(progress.total)
    REMAINING.labels(**labels).set(max(progress.total - progress.completed - progress.failed, 0))
    TOKENS.labels(**labels).set(progress.generated_tokens)
    TOKENS_PER_S.labels(**labels).set(progress.tokens_per_second)
    if progress.eta_seconds is not None:
        ETA.labels(**labels).set(progress.eta_seconds)
    processed = progress.completed + progress.failed
    ERRORS.labels(**labels).set(progress.failed / processed if processed else 0.0)
    TRUNCATED.labels(**labels).set(progress.truncated / progress.completed if progress.completed else 0.0)


def publish(name: str, namespace: str, status: DatasetGenerationStatus, validation: dict[str, Any],
            model: str) -> None:
    """Set every series of one resource from its new status."""
    forget(name, namespace)
    key = {"dsgen": name, "namespace": namespace}
    _progress(key, "", status.progress)
    for dataset in status.datasets:
        _progress(key, dataset.name, dataset)
    TRUNCATED_LIMIT.labels(**key).set(float(validation["max_truncated_fraction"]))
    ERRORS_LIMIT.labels(**key).set(float(validation["max_error_fraction"]))
    for phase in PHASES:
        PHASE.labels(**key, phase=phase).set(1 if status.phase == phase else 0)
    conditions = {c.type: c.status for c in status.conditions}
    for type_ in CONDITION_TYPES:
        if type_ in conditions:
            CONDITION.labels(**key, condition=type_, status=conditions[type_]).set(1)
    if status.last_commit_time:
        LAST_COMMIT.labels(**key).set(parse_time(status.last_commit_time).timestamp())
    INFO.labels(**key, model=model, verdict=status.report.verdict if status.report else "").set(1)


def forget(name: str, namespace: str) -> None:
    """Drop every series of one resource (before republishing, and when it is deleted)."""
    for metric in _PER_RESOURCE:
        for labels in list(metric._metrics):  # noqa: SLF001 - prometheus_client has no public listing
            values = dict(zip(metric._labelnames, labels, strict=True))  # noqa: SLF001
            if values["dsgen"] == name and values["namespace"] == namespace:
                metric.remove(*labels)


def serve(port: int) -> None:
    start_http_server(port, registry=REGISTRY)
    logger.info("operator metrics on :%d/metrics", port)


def exposition() -> bytes:
    return generate_latest(REGISTRY)
