"""What an export did: counts, the manifest (export.json), the closing summary and the progress line. Pure.

export.json is written last, after every data file: a destination without it is an unfinished export. Its schema
is `tokenmill.export/v1` (docs/export.md); bump it on breaking changes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..progress import eta_seconds, format_duration
from .formats import ExportFormat
from .roundtrip import MISMATCH_REASONS

SCHEMA = "tokenmill.export/v1"
MANIFEST = "export.json"
MISMATCHES = "mismatches.jsonl"

# Units the export refuses whatever the format: neither trainer checks these itself (SpecForge skips a row without
# a supervised token silently, speculators drops it; neither checks ids against the vocabulary).
INVALID_REASONS = {
    "no_output_tokens": "the target generated no token: nothing to supervise",
    "id_out_of_vocab": "an id is outside the tokenizer's vocabulary",
    "multi_turn_text": "the text formats hold single-generation conversations; export multi-turn rows with a token "
                       "format (specforge, speculators, hf)",
}


@dataclass
class DatasetCounts:
    units: int = 0  # generation units read from committed rows (after the dataset filters)
    written: int = 0
    filtered: Counter[str] = field(default_factory=Counter)  # by filter
    mismatched: Counter[str] = field(default_factory=Counter)  # by reason, written or not
    kept_mismatched: int = 0  # mismatched units written anyway (--keep-mismatched)
    invalid: Counter[str] = field(default_factory=Counter)
    duplicate_slots: int = 0  # a slot met again in another marker: the first is exported
    dangling: list[str] = field(default_factory=list)  # files commit markers name that do not exist: skipped
    suffix_tokens: int = 0  # records whose template renders tokens after the generated ones
    trainer_mask_tokens: int = 0  # tokens where SpecForge's loss mask differs from the target's (text formats)
    supervised_tokens: int = 0  # loss-mask ones in what was written
    longest: int = 0  # tokens of the longest written record: the trainer's max length must reach it

    def add(self, other: DatasetCounts) -> None:
        for name in ("units", "written", "kept_mismatched", "duplicate_slots", "suffix_tokens", "supervised_tokens",
                     "trainer_mask_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.filtered.update(other.filtered)
        self.mismatched.update(other.mismatched)
        self.invalid.update(other.invalid)
        self.dangling.extend(other.dangling)
        self.longest = max(self.longest, other.longest)

    def as_dict(self) -> dict[str, Any]:
        return {
            "units": self.units, "written": self.written, "filtered": dict(sorted(self.filtered.items())),
            "mismatched": dict(sorted(self.mismatched.items())), "kept_mismatched": self.kept_mismatched,
            "invalid": dict(sorted(self.invalid.items())), "duplicate_slots": self.duplicate_slots,
            "dangling_files": list(self.dangling),
            "suffix_tokens": self.suffix_tokens, "supervised_tokens": self.supervised_tokens,
            "trainer_mask_tokens": self.trainer_mask_tokens,
            "longest_record_tokens": self.longest,
        }


@dataclass
class ExportCounts:
    datasets: dict[str, DatasetCounts] = field(default_factory=dict)

    def of(self, dataset: str) -> DatasetCounts:
        return self.datasets.setdefault(dataset, DatasetCounts())

    def total(self) -> DatasetCounts:
        total = DatasetCounts()
        for counts in self.datasets.values():
            total.add(counts)
        return total


@dataclass(frozen=True)
class WrittenFile:
    path: str  # relative to the destination
    records: int
    bytes: int
    sha256: str
    tokens: int = 0  # input ids in the file's records (SpecForge holds about 37 bytes per token of a part it reads)


def run_facts(run: dict[str, Any]) -> dict[str, Any]:
    """What a trainer's input should say about where it came from, from the run's run.json."""
    spec = run.get("spec") or {}
    datasets = {
        name: {"chat_template_kwargs": facts.get("chat_template_kwargs"),
               "sampling": {key: value.get("value") for key, value in (facts.get("sampling") or {}).items()}}
        for name, facts in (run.get("datasets") or {}).items()
    }
    return {"name": run.get("name"), "started_at": run.get("started_at"), "tokenmill": run.get("tokenmill"),
            "model": spec.get("model"), "tokenizer": run.get("tokenizer"),
            "context_length": run.get("context_length"), "datasets": datasets}


def build_manifest(fmt: ExportFormat, source_uri: str, destination_uri: str, run: dict[str, Any],
                   options: dict[str, Any], excluded: dict[str, list[str]], counts: ExportCounts,
                   files: list[WrittenFile], mismatches: WrittenFile | None, now: datetime,
                   version: str, unfinished: dict[str, str] | None = None) -> dict[str, Any]:
    total = counts.total()
    return {
        "schema": SCHEMA,
        "format": fmt.name,
        "reads": fmt.reads,
        "usage": fmt.usage.format(dest=destination_uri.rstrip("/")),
        "created_at": now.isoformat(),
        "tokenmill": version,
        "source": {"uri": source_uri, "run": run_facts(run)},
        "options": options,
        "excluded_datasets": excluded,
        # Datasets whose run is not finished (slots without an outcome): the export holds what was committed.
        "unfinished_datasets": unfinished or {},
        "counts": {**total.as_dict(), "datasets": {name: c.as_dict() for name, c in counts.datasets.items()}},
        "mismatch_reasons": {reason: MISMATCH_REASONS[reason] for reason in sorted(total.mismatched)},
        "invalid_reasons": {reason: INVALID_REASONS[reason] for reason in sorted(total.invalid)},
        "files": [file.__dict__ for file in files],
        "mismatches": mismatches.__dict__ if mismatches else None,
    }


def summary_lines(manifest: dict[str, Any]) -> Iterator[str]:
    counts = manifest["counts"]
    yield (f"{'dataset':<20} {'units':>8} {'written':>8} {'filtered':>8} {'mismatched':>10} {'invalid':>7} "
           f"{'longest':>8}")
    for name, c in counts["datasets"].items():
        yield (f"{name:<20} {c['units']:>8} {c['written']:>8} {sum(c['filtered'].values()):>8} "
               f"{sum(c['mismatched'].values()):>10} {sum(c['invalid'].values()):>7} {c['longest_record_tokens']:>8}")
    for name, messages in manifest["excluded_datasets"].items():
        yield f"excluded {name} (report findings): " + " | ".join(messages)
    for reason, text in manifest["mismatch_reasons"].items():
        kept = " (written anyway, --keep-mismatched)" if manifest["options"].get("keep_mismatched") else " (not written)"
        yield f"mismatched: {reason}: {counts['mismatched'][reason]}{kept}: {text}"
    for reason, text in manifest["invalid_reasons"].items():
        yield f"invalid: {reason}: {counts['invalid'][reason]} (not written): {text}"
    if counts["suffix_tokens"]:
        yield (f"note: {counts['suffix_tokens']} records render tokens after the generated answer (the template's "
               "end-of-turn suffix); SpecForge supervises them when its end_of_turn_token includes them")
    if counts["duplicate_slots"]:
        yield f"note: {counts['duplicate_slots']} slots were committed twice; the first commit was exported"
    if counts.get("dangling_files"):
        yield (f"warning: {len(counts['dangling_files'])} files named by commit markers do not exist and were "
               f"skipped ({', '.join(counts['dangling_files'][:10])}); `tokenmill report` names their markers")
    if counts["trainer_mask_tokens"]:
        yield (f"note: SpecForge's loss mask differs from the target's on {counts['trainer_mask_tokens']:,} tokens "
               "(mismatches.jsonl, reason trainer_loss_mask, says where)")
    for name, missing in (manifest.get("unfinished_datasets") or {}).items():
        yield (f"warning: the run is not finished: {name}: {missing}; this export holds what was committed so far: "
               "export again once the run is done")
    yield f"{counts['written']} records, {counts['supervised_tokens']:,} supervised tokens, longest " \
          f"{counts['longest_record_tokens']} tokens ({manifest['format']}: {manifest['reads']})"
    if manifest["format"].startswith("specforge") and counts["written"]:
        # SpecForge cuts records at data.max_length and skips, silently, those left with no supervised token
        # (SF data/prompt_builder.py:243-246); its default is 2048 (SF config/schema.py:140).
        yield f"set data.max_length: {counts['longest_record_tokens']} (the longest record; SpecForge cuts longer " \
              "ones and silently skips those left with nothing to train on)"
    if len(manifest["files"]) > 1:
        largest = max(manifest["files"], key=lambda file: file["tokens"])
        yield f"{len(manifest['files'])} parts, the largest {largest['bytes'] / 2**20:,.0f} MiB, " \
              f"{largest['tokens']:,} tokens ({manifest['format']})"
    if manifest["mismatches"]:
        yield f"mismatches: {manifest['mismatches']['path']} ({manifest['mismatches']['records']} records)"
    if counts["written"]:  # no hint for files an empty export never wrote (export.json alone is no dataset)
        yield f"use: {manifest['usage']}"


@dataclass(frozen=True)
class ExportProgress:
    done: int
    total: int
    written: int
    mismatched: int
    units_per_s: float
    elapsed_s: float


def progress_line(progress: ExportProgress, width: int = 24) -> str:
    share = min(progress.done / progress.total, 1.0) if progress.total else 1.0
    filled = int(share * width)
    eta = eta_seconds(progress.total - progress.done, progress.units_per_s)
    return (f"export [{'#' * filled}{'-' * (width - filled)}] {progress.done:,}/{progress.total:,} units "
            f"({share:6.1%}) | {progress.units_per_s:,.0f} units/s | written {progress.written:,} | mismatched "
            f"{progress.mismatched:,} | elapsed {format_duration(progress.elapsed_s)} | ETA {format_duration(eta)}")
