"""What an export leaves out on request: the filters of `tokenmill export`. Pure.

Per unit: finish reason, truncated or not, reasoning present. Per prompt: overlap with evaluation sets (the lines
report/mix.py finds, resolved by the exporter before it reads a row). Per dataset: names, and the validation
report's findings. The report's findings are per dataset (validation.py `dataset_findings`: truncation share, reasoning share,
error share, ...), not per sample; the per-sample facts behind them (finish reason, end of reasoning) are the unit
filters, so `--exclude-findings` leaves out whole datasets and the unit filters do the per-sample part.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from ..report.mix import NGRAM
from ..report.validation import LEVELS
from .units import GenerationUnit

FinishReason = Literal["stop", "length"]


class FilterError(ValueError):
    """A filter that cannot be applied to this run (e.g. a dataset it does not have)."""


@dataclass(frozen=True)
class ExportFilters:
    datasets: tuple[str, ...] | None = None  # None: every dataset of the run
    finish_reason: FinishReason | None = None
    exclude_truncated: bool = False
    require_reasoning: bool = False
    exclude_findings: str | None = None  # "warn" or "fail": leave out datasets with a finding at that level or worse
    eval_files: tuple[str, ...] = ()  # leave out prompts sharing a run of `ngram` words with these evaluation files
    ngram: int = NGRAM

    def __post_init__(self) -> None:
        if self.exclude_findings is not None and self.exclude_findings not in LEVELS[1:]:
            raise FilterError(f"--exclude-findings must be one of {', '.join(LEVELS[1:])}, "
                              f"got {self.exclude_findings!r}")
        if self.ngram < 1:
            raise FilterError(f"--ngram must be at least 1, got {self.ngram}")

    @property
    def per_unit(self) -> bool:
        """Whether a unit's own facts decide (not only its dataset or its prompt)."""
        return bool(self.finish_reason or self.exclude_truncated or self.require_reasoning)

    def rejection(self, unit: GenerationUnit) -> str | None:
        """The first filter that leaves this unit out (its name, counted in the manifest), or None."""
        if self.finish_reason is not None and unit.finish_reason != self.finish_reason:
            return "finish_reason"
        if self.exclude_truncated and unit.truncated:
            return "truncated"
        if self.require_reasoning and not unit.has_reasoning:
            return "no_reasoning"
        return None

    def as_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["datasets"] = list(self.datasets) if self.datasets is not None else None
        values["eval_files"] = list(self.eval_files)
        return values


def select_datasets(available: list[str], wanted: tuple[str, ...] | None) -> list[str]:
    if wanted is None:
        return list(available)
    unknown = [name for name in wanted if name not in available]
    if unknown:
        raise FilterError(f"--dataset {', '.join(unknown)}: not in this run (it has {', '.join(available) or 'none'})")
    return [name for name in available if name in wanted]


def excluded_by_findings(findings: list[dict[str, Any]], level: str | None) -> dict[str, list[str]]:
    """{dataset: messages of its findings at `level` or worse}, from the report's findings."""
    if level is None:
        return {}
    floor = LEVELS.index(level)
    excluded: dict[str, list[str]] = {}
    for finding in findings:
        if finding.get("dataset") and LEVELS.index(finding["level"]) >= floor:
            excluded.setdefault(finding["dataset"], []).append(finding["message"])
    return excluded
