"""Progress from commit markers: counts, rates and ETA as status wants them. Pure.

Rates come from the markers' own commit times over a recent window, so they survive operator restarts and need
no state between timer ticks. This is the operator's one use of the runner's ledger (which outcome is final, which
failure reasons a retry can fix): keep it here.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from typing import Any

from tokenmill_runner.ledger import RETRYABLE_REASONS, effective_failures
from tokenmill_runner.progress import eta_seconds, format_duration
from tokenmill_runner.spec import DatasetGenerationSpec

from .facts import ProgressFacts
from .status import DatasetProgress, Progress

RATE_WINDOW = timedelta(minutes=10)


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def failure_reasons(markers: list[dict[str, Any]]) -> Counter[str]:
    """Final failures by reason (a line retried successfully no longer counts; a line failed twice counts once)."""
    return Counter(effective_failures(markers).values())


def given_up(reasons: Counter[str]) -> int:
    """Failures a retry can fix: the servers failed these samples, not their input."""
    return sum(count for reason, count in reasons.items() if reason in RETRYABLE_REASONS)


def _counts(markers: list[dict[str, Any]]) -> tuple[int, Counter[str], int, int]:
    """(completed, failures by reason, tokens, truncated)."""
    completed = tokens = truncated = 0
    for marker in markers:
        completed += len(marker["samples"]["sample_id"])
        tokens += sum(marker["samples"]["completion_tokens"])
        truncated += sum(1 for reason in marker["samples"].get("finish_reason", []) if reason == "length")
    return completed, failure_reasons(markers), tokens, truncated


def _rates(markers: list[dict[str, Any]], now: datetime, started: datetime | None) -> tuple[float, float]:
    """(samples/s, tokens/s) committed within the window, or since the start when the run is younger."""
    since = now - RATE_WINDOW
    recent = [m for m in markers if parse_time(m["committed_at"]) >= since]
    span = RATE_WINDOW.total_seconds()
    if started is not None and started > since:
        span = max((now - started).total_seconds(), 1.0)
    completed, reasons, tokens, _ = _counts(recent)
    return (completed + reasons.total()) / span, tokens / span


def progress_of(markers: list[dict[str, Any]], total: int, now: datetime, started: datetime | None,
                name: str | None = None) -> Progress:
    completed, reasons, tokens, truncated = _counts(markers)
    failed = reasons.total()
    samples_per_s, tokens_per_s = _rates(markers, now, started)
    eta = eta_seconds(total - completed - failed, samples_per_s)
    share = (completed + failed) / total if total else 0.0
    fields = dict(
        completed=completed, failed=failed, total=total, generated_tokens=tokens, truncated=truncated,
        tokens_per_second=int(round(tokens_per_s)), samples_per_second=f"{samples_per_s:.3f}",
        eta_seconds=int(eta) if eta is not None else None, eta=format_duration(eta) if eta is not None else "",
        display=f"{completed + failed}/{total} ({share:.1%})",
        given_up=given_up(reasons), failed_by_reason=dict(sorted(reasons.items())),
    )
    return DatasetProgress(name=name, **fields) if name is not None else Progress(**fields)


def progress_facts(markers: dict[str, list[dict[str, Any]]], totals: dict[str, int], now: datetime,
                   started: datetime | None) -> ProgressFacts:
    """Progress per dataset and overall; `totals` come from run.json (rows per dataset source)."""
    datasets = [progress_of(markers.get(name, []), totals.get(name, 0), now, started, name) for name in totals]
    every = [m for name in totals for m in markers.get(name, [])]
    overall = progress_of(every, sum(totals.values()), now, started)
    times = [parse_time(m["committed_at"]) for m in every]
    return ProgressFacts(overall=overall, datasets=datasets, last_commit_time=max(times, default=None))


def foreign_run(run: dict[str, Any] | None, spec: DatasetGenerationSpec) -> str | None:
    """Why the output's run.json belongs to another model's run, or None. (The model path is compared: the runner
    sees the tokenizer at a mounted path when it is on a PVC, so the recorded tokenizer differs on purpose.)"""
    recorded = (((run or {}).get("spec") or {}).get("model") or {}).get("path")
    if recorded is None or recorded == spec.model.path:
        return None
    return (f"{spec.output.uri} already holds a run of model {recorded!r} (its run.json), not of "
            f"{spec.model.path!r}: two models' outputs must not mix. Give this DatasetGeneration its own output.uri "
            "(a new resource), or point it back at that model")
