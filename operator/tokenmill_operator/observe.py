"""Progress from the runner's commit index: counts, rates and ETA as status wants them. Pure.

Counts come from each dataset's ledger (a slot counts once, by its final outcome); rates from the index's ring of
recent commits (their own commit times), so they survive operator restarts (a checkpoint keeps the ring). This is
the operator's one use of the runner's ledger (which outcome is final, which failure reasons a retry can fix):
keep it here.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any

from tokenmill_runner.store.commit_index import Commit, DatasetIndex, parse_time, rates
from tokenmill_runner.store.ledger import RETRYABLE_REASONS
from tokenmill_runner.progress import eta_seconds, format_duration
from tokenmill_runner.spec.resource import DatasetGenerationSpec

from .facts import ProgressFacts
from .status import DatasetProgress, Progress

__all__ = ["given_up", "parse_time", "progress_facts", "progress_of", "foreign_run"]


def given_up(reasons: Counter[str] | dict[str, int]) -> int:
    """Failures a retry can fix: the servers failed these samples, not their input."""
    return sum(count for reason, count in reasons.items() if reason in RETRYABLE_REASONS)


def _totals(indexes: list[DatasetIndex]) -> tuple[int, Counter[str], int, int]:
    """(completed, final failures by reason, tokens, truncated) over the datasets."""
    completed = tokens = truncated = 0
    reasons: Counter[str] = Counter()
    for index in indexes:
        ledger = index.ledger
        completed += ledger.completed
        tokens += ledger.completion_tokens
        truncated += ledger.truncated
        reasons.update(ledger.final_failures())
    return completed, reasons, tokens, truncated


def progress_of(indexes: list[DatasetIndex], total: int, now: datetime, started: datetime | None,
                name: str | None = None) -> Progress:
    completed, reasons, tokens, truncated = _totals(indexes)
    failed = reasons.total()
    recent: list[Commit] = [commit for index in indexes for commit in index.recent]
    rate = rates(recent, now, started)
    eta = eta_seconds(total - completed - failed, rate.samples_per_s)
    share = (completed + failed) / total if total else 0.0
    fields = dict(
        completed=completed, failed=failed, total=total, generated_tokens=tokens, truncated=truncated,
        tokens_per_second=int(round(rate.tokens_per_s)), samples_per_second=f"{rate.samples_per_s:.3f}",
        eta_seconds=int(eta) if eta is not None else None, eta=format_duration(eta) if eta is not None else "",
        display=f"{completed + failed}/{total} ({share:.1%})",
        given_up=given_up(reasons), failed_by_reason=dict(sorted(reasons.items())),
    )
    return DatasetProgress(name=name, **fields) if name is not None else Progress(**fields)


def progress_facts(indexes: dict[str, DatasetIndex], totals: dict[str, int], now: datetime,
                   started: datetime | None) -> ProgressFacts:
    """Progress per dataset and overall; `totals` come from run.json (rows per dataset source)."""
    chosen = {name: [indexes[name]] if name in indexes else [] for name in totals}
    datasets = [progress_of(chosen[name], totals[name], now, started, name) for name in totals]
    every = [index for name in totals for index in chosen[name]]
    overall = progress_of(every, sum(totals.values()), now, started)
    last = max((index.last_commit for index in every if index.last_commit is not None), default=None)
    return ProgressFacts(overall=overall, datasets=datasets, last_commit_time=last)


def foreign_run(run: dict[str, Any] | None, spec: DatasetGenerationSpec) -> str | None:
    """Why the output's run.json belongs to another model's run, or None. (The model path is compared: the runner
    sees the tokenizer at a mounted path when it is on a PVC, so the recorded tokenizer differs on purpose.)"""
    recorded = (((run or {}).get("spec") or {}).get("model") or {}).get("path")
    if recorded is None or recorded == spec.model.path:
        return None
    return (f"{spec.output.uri} already holds a run of model {recorded!r} (its run.json), not of "
            f"{spec.model.path!r}: two models' outputs must not mix. Give this DatasetGeneration its own output.uri "
            "(a new resource), or point it back at that model")
