"""Progress from commit markers: counts, rates and ETA as status wants them. Pure.

Rates come from the markers' own commit times over a recent window, so they survive operator restarts and need
no state between timer ticks.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from tokenmill_runner.ledger import effective_failures
from tokenmill_runner.progress import eta_seconds, format_duration

from .lifecycle import ProgressFacts
from .status import DatasetProgress, Progress

RATE_WINDOW = timedelta(minutes=10)


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _counts(markers: list[dict[str, Any]]) -> tuple[int, int, int, int]:
    """(completed, failed, tokens, truncated); failed counts final failures (a retried line counts once)."""
    completed = tokens = truncated = 0
    for marker in markers:
        completed += len(marker["samples"]["sample_id"])
        tokens += sum(marker["samples"]["completion_tokens"])
        truncated += sum(1 for reason in marker["samples"].get("finish_reason", []) if reason == "length")
    return completed, len(effective_failures(markers)), tokens, truncated


def _rates(markers: list[dict[str, Any]], now: datetime, started: datetime | None) -> tuple[float, float]:
    """(samples/s, tokens/s) committed within the window, or since the start when the run is younger."""
    since = now - RATE_WINDOW
    recent = [m for m in markers if parse_time(m["committed_at"]) >= since]
    span = RATE_WINDOW.total_seconds()
    if started is not None and started > since:
        span = max((now - started).total_seconds(), 1.0)
    completed, failed, tokens, _ = _counts(recent)
    return (completed + failed) / span, tokens / span


def progress_of(markers: list[dict[str, Any]], total: int, now: datetime, started: datetime | None,
                name: str | None = None) -> Progress:
    completed, failed, tokens, truncated = _counts(markers)
    samples_per_s, tokens_per_s = _rates(markers, now, started)
    eta = eta_seconds(total - completed - failed, samples_per_s)
    share = (completed + failed) / total if total else 0.0
    fields = dict(
        completed=completed, failed=failed, total=total, generated_tokens=tokens, truncated=truncated,
        tokens_per_second=int(round(tokens_per_s)), samples_per_second=f"{samples_per_s:.3f}",
        eta_seconds=int(eta) if eta is not None else None, eta=format_duration(eta) if eta is not None else "",
        display=f"{completed + failed}/{total} ({share:.1%})",
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
