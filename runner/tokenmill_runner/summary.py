"""The closing summary of a run, per dataset: what the pipeline reports when it ends, and its lines. Pure."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class DatasetSummary:
    name: str
    rows: int
    skipped: int
    generated: int
    failed: dict[str, int]
    completion_tokens: int
    truncated: int
    median_completion: float | None
    mean_completion: float | None
    max_completion: int | None


@dataclass(frozen=True)
class RunSummary:
    output_uri: str
    datasets: list[DatasetSummary]
    elapsed_s: float
    retries: int
    interrupted: bool
    concurrency: int
    context_length: int


def iter_summary_lines(summary: RunSummary) -> Iterator[str]:
    header = f"{'dataset':<20} {'rows':>7} {'done before':>11} {'generated':>9} {'failed':>6} " \
             f"{'tokens':>11} {'median':>7} {'mean':>7} {'max':>6} {'truncated':>9}"
    yield header
    for d in summary.datasets:
        median = f"{d.median_completion:.0f}" if d.median_completion is not None else "-"
        mean = f"{d.mean_completion:.0f}" if d.mean_completion is not None else "-"
        yield (f"{d.name:<20} {d.rows:>7} {d.skipped:>11} {d.generated:>9} {sum(d.failed.values()):>6} "
               f"{d.completion_tokens:>11,} {median:>7} {mean:>7} {d.max_completion or '-':>6} {d.truncated:>9}")
        for reason, count in sorted(d.failed.items()):
            yield f"    failed: {reason}: {count}"
    yield (f"{summary.retries} retries, concurrency {summary.concurrency}, context length "
           f"{summary.context_length}, {summary.elapsed_s:.1f}s")
    yield f"output: {summary.output_uri}"
