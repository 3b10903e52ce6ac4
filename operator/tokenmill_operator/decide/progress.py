"""Progress from the runner's commit index: counts, rates and ETA as status wants them. Pure.

Counts come from each dataset's ledger (a slot counts once, by its final outcome); rates from the index's ring of
recent commits (their own commit times), so they survive operator restarts (a checkpoint keeps the ring). This is
the operator's one use of the runner's ledger (which outcome is final, which failure reasons a retry can fix):
keep it here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from datetime import datetime

from tokenmill_runner.progress import eta_seconds, format_duration
from tokenmill_runner.spec.resource import DatasetGenerationSpec
from tokenmill_runner.store.commit_index import Commit, DatasetIndex, parse_time, rates
from tokenmill_runner.store.lease_rules import Lease, refusal
from tokenmill_runner.store.ledger import RETRYABLE_REASONS, Completeness
from tokenmill_runner.store.manifest import DatasetLayout, Owner, RunManifest

from .facts import ProgressFacts
from .status import DatasetProgress, Progress

# Committed samples of a dataset before its own mean output length is trusted over the plan's (the runner's
# admission order uses the same count, prepare.MIN_OBSERVED_ROWS).
MIN_OBSERVED = 32

__all__ = ["foreign_run", "given_up", "parse_time", "progress_facts", "progress_of", "would_generate"]


def given_up(reasons: Counter[str] | dict[str, int]) -> int:
    """Failures a retry can fix: the servers failed these samples, not their input."""
    return sum(count for reason, count in reasons.items() if reason in RETRYABLE_REASONS)


def _completeness(index: DatasetIndex | None, layout: DatasetLayout) -> Completeness:
    """The layout's slots (the lines the source yields: blank lines are none) and their outcomes."""
    return layout.completeness(None if index is None else index.ledger)


def mean_output(index: DatasetIndex | None, expected: float | None, fallback: float | None) -> float | None:
    """The output tokens a dataset's remaining samples are expected to take: its own committed mean once
    MIN_OBSERVED samples are in, else the plan's figure for it, else the mean of the whole run so far."""
    ledger = index.ledger if index is not None else None
    if ledger is not None and ledger.completed >= MIN_OBSERVED:
        return ledger.completion_tokens / ledger.completed
    return expected if expected is not None else fallback


def remaining_work(indexes: dict[str, DatasetIndex], parts: dict[str, Completeness],
                   expected: Mapping[str, float]) -> dict[str, float | None]:
    """Per dataset, the output tokens its unsettled slots are expected to generate (None: nothing to go by)."""
    done = [index.ledger for index in indexes.values() if index.ledger.completed]
    completed = sum(ledger.completed for ledger in done)
    fallback = sum(ledger.completion_tokens for ledger in done) / completed if completed else None
    work: dict[str, float | None] = {}
    for name, part in parts.items():
        left = part.slots - part.generated - sum(part.failures.values())
        per_sample = mean_output(indexes.get(name), expected.get(name), fallback)
        work[name] = 0.0 if left <= 0 else None if per_sample is None else left * per_sample
    return work


def progress_of(indexes: list[DatasetIndex], parts: list[Completeness], now: datetime,
                started: datetime | None, work: tuple[float | None, float] | None = None) -> Progress:
    """Counts of the current layout's slots (outcomes outside it are not counted), rates from recent commits.
    `work`: (output tokens left, the run's output tokens/s) to project the ETA from lengths, not sample counts."""
    completed = sum(part.generated for part in parts)
    reasons: Counter[str] = Counter()
    for part in parts:
        reasons.update(part.failures)
    failed, total = reasons.total(), sum(part.slots for part in parts)
    tokens = sum(index.ledger.completion_tokens for index in indexes)
    truncated = sum(index.ledger.truncated for index in indexes)
    recent: list[Commit] = [commit for index in indexes for commit in index.recent]
    rate = rates(recent, now, started)
    left_tokens, run_tokens_per_s = work if work is not None else (None, 0.0)
    if left_tokens is not None and run_tokens_per_s > 0:
        # Datasets run one after another and their outputs differ by 10x and more: samples/s measured on a long
        # one would put a short one's ETA far out. Tokens left at the run's token rate follow the lengths.
        eta: float | None = left_tokens / run_tokens_per_s
    else:
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
                   started: datetime | None, expected_output: Mapping[str, float] | None = None) -> ProgressFacts:
    """Progress per dataset and overall against the manifest's layout, and whether every slot of it is settled
    (the same `completeness` the report checks). ETAs are the output tokens left (`remaining_work`; the plan's
    per-dataset means in `expected_output` until a dataset has its own) at the run's recent token rate."""
    layouts = manifest.datasets
    parts = {name: _completeness(indexes.get(name), layout) for name, layout in layouts.items()}
    chosen = {name: [indexes[name]] if name in indexes else [] for name in layouts}
    every = [index for name in layouts for index in chosen[name]]
    run_rate = rates([commit for index in every for commit in index.recent], now, started).tokens_per_s
    work = remaining_work({name: indexes[name] for name in layouts if name in indexes}, parts, expected_output or {})
    datasets = [DatasetProgress(name=name, **progress_of(chosen[name], [parts[name]], now, started,
                                                         (work[name], run_rate)).model_dump())
                for name in layouts]
    left = None if any(value is None for value in work.values()) else sum(v or 0.0 for v in work.values())
    overall = progress_of(every, list(parts.values()), now, started, (left, run_rate))
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
