"""Progress from the runner's commit index: counts, rates and ETA as status wants them. Pure.

Counts come from each dataset's ledger (a slot counts once, by its final outcome); rates from the index's ring of
recent commits (their own commit times), so they survive operator restarts (a checkpoint keeps the ring). This is
the operator's one use of the runner's ledger (which outcome is final, which failure reasons a retry can fix):
keep it here.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime

from tokenmill_runner.progress import eta_seconds, format_duration
from tokenmill_runner.spec.resource import DatasetGenerationSpec
from tokenmill_runner.store.commit_index import Commit, DatasetIndex, parse_time, rates
from tokenmill_runner.store.lease_rules import Lease, refusal
from tokenmill_runner.store.ledger import RETRYABLE_REASONS, Completeness
from tokenmill_runner.store.manifest import DatasetLayout, Owner, RunManifest

from .facts import ProgressFacts
from .status import DatasetProgress, Progress

__all__ = ["foreign_run", "given_up", "parse_time", "progress_facts", "progress_of", "would_generate"]


def given_up(reasons: Counter[str] | dict[str, int]) -> int:
    """Failures a retry can fix: the servers failed these samples, not their input."""
    return sum(count for reason, count in reasons.items() if reason in RETRYABLE_REASONS)


def _completeness(index: DatasetIndex | None, layout: DatasetLayout) -> Completeness:
    """The layout's slots (the lines the source yields: blank lines are none) and their outcomes."""
    return layout.completeness(None if index is None else index.ledger)


def progress_of(indexes: list[DatasetIndex], parts: list[Completeness], now: datetime,
                started: datetime | None) -> Progress:
    """Counts of the current layout's slots (outcomes outside it are not counted), rates from recent commits."""
    completed = sum(part.generated for part in parts)
    reasons: Counter[str] = Counter()
    for part in parts:
        reasons.update(part.failures)
    failed, total = reasons.total(), sum(part.slots for part in parts)
    tokens = sum(index.ledger.completion_tokens for index in indexes)
    truncated = sum(index.ledger.truncated for index in indexes)
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
    return Progress(**fields)


def progress_facts(indexes: dict[str, DatasetIndex], manifest: RunManifest, now: datetime,
                   started: datetime | None) -> ProgressFacts:
    """Progress per dataset and overall against the manifest's layout, and whether every slot of it is settled
    (the same `completeness` the report checks)."""
    layouts = manifest.datasets
    parts = {name: _completeness(indexes.get(name), layout) for name, layout in layouts.items()}
    chosen = {name: [indexes[name]] if name in indexes else [] for name in layouts}
    datasets = [DatasetProgress(name=name, **progress_of(chosen[name], [parts[name]], now, started).model_dump())
                for name in layouts]
    every = [index for name in layouts for index in chosen[name]]
    overall = progress_of(every, list(parts.values()), now, started)
    last = max((index.last_commit for index in every if index.last_commit is not None), default=None)
    missing = {name: part.describe_missing() for name, part in parts.items() if not part.settled}
    return ProgressFacts(overall=overall, datasets=datasets, last_commit_time=last,
                         settled=bool(layouts) and not missing, missing=missing, spec_hash=manifest.spec_hash)


def would_generate(spec: DatasetGenerationSpec, manifest: RunManifest | None) -> bool:
    """Whether a runner Job of this spec has slots to run beyond the layout the ended run recorded: given-up samples
    to retry (runner.retryFailed), a dataset it did not lay out, more samples per prompt, or a higher limit."""
    if spec.runner.retry_failed or manifest is None:
        return True
    for dataset in spec.datasets:
        layout = manifest.datasets.get(dataset.name)
        if layout is None or dataset.samples > layout.samples:
            return True
        if layout.limit is not None and (dataset.limit is None or dataset.limit > layout.limit):
            return True
    return False


def foreign_run(manifest: RunManifest | None, lease: Lease | None, spec: DatasetGenerationSpec, owner: Owner,
                unchanged_s: float) -> str | None:
    """Why the output belongs to another run, or None: its run.json records another model, or another owner holds
    its lease and is alive (the operator has not seen it unchanged for the stale period: `unchanged_s`; the
    lease's own times are the holder's clock and never trusted). (The model path is compared, not the tokenizer:
    the runner sees the tokenizer at a mounted path when it is on a PVC, so the recorded tokenizer differs on
    purpose.)"""
    recorded = (manifest.model if manifest else {}).get("path")
    if recorded is not None and recorded != spec.model.path:
        return (f"{spec.output.uri} already holds a run of model {recorded!r} (its run.json), not of "
                f"{spec.model.path!r}: two models' outputs must not mix. Give this DatasetGeneration its own "
                "output.uri (a new resource), or point it back at that model")
    why = refusal(lease, owner, "operator", unchanged_s)
    if why:
        return f"{spec.output.uri}: {why}. Give this DatasetGeneration its own output.uri"
    return None
