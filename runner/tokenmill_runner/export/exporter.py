"""`tokenmill export`: committed rows of a run, streamed shard by shard into a trainer's input format.

Only committed shards count: the exporter reads each dataset's commit markers and then the shards they name,
a few shards ahead in threads (S3 latency), one shard in memory at a time per reader. Each row becomes generation
units (`units.py`); filters, validity and, for text formats, the round-trip check decide what is written; the
files go to the destination whole (`writers.py`), and export.json goes last, listing them.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TextIO

import orjson

from ..generate.conversation import start
from ..progress import ThroughputMeter
from ..report.files import require_manifest
from ..source.adapters import DEFAULT_LAYOUT, RowLayout
from ..source.prompts import Prompt, RowError
from ..spec.resource import DatasetSpec
from ..store.markers import datasets_with_commits, markers_in_commit_order
from ..store.shards import fetch_shard, shard_rows, stored_files
from ..store.storage import TMP_MARK, LocalStorage, Storage, StorageError, open_storage
from .filters import ExportFilters, excluded_by_findings, select_datasets
from .formats import FORMATS, ExportFormat, hf_record, specforge_record, speculators_record
from .manifest import (
    MANIFEST,
    MISMATCHES,
    DatasetCounts,
    ExportCounts,
    ExportProgress,
    build_manifest,
    progress_line,
)
from .roundtrip import Checked, ConversationContext, Mismatch, check_conversation, check_text
from .source_lines import SourceLines
from .specforge_rules import specforge_template
from .units import GenerationUnit, SlotSeen, invalid_reason, units_from_row
from .writers import JsonlFiles, ParquetFiles

logger = logging.getLogger(__name__)

PREFETCH_SHARDS = 4
DEFAULT_PART_BYTES = 256 * 1024 * 1024
# Tokens that open reasoning, by the token that ends it: dropped from reasoning_content when an output starts with
# one (a Qwen3 model writes <think> itself; Kimi's generation prompt already holds it).
REASONING_OPENERS = {"</think>": "<think>", "[/THINK]": "[THINK]"}
SPOOL_PREFIX = ".tokenmill-export-spool-"


class ExportError(RuntimeError):
    """The export cannot start or continue; the message says what to change."""


@dataclass(frozen=True)
class ExportRequest:
    source_uri: str
    dest_uri: str
    format: str
    filters: ExportFilters = field(default_factory=ExportFilters)
    keep_mismatched: bool = False
    overwrite: bool = False
    tokenizer: str | None = None  # folder; default: the one recorded in run.json
    trust_remote_code: bool = False  # the command's --trust-remote-code; run.json's setting is never used
    specforge_template: str | None = None  # SpecForge's data.chat_template (specforge-conversations)
    part_bytes: int = DEFAULT_PART_BYTES
    s3_endpoint: str | None = None
    dest_s3_endpoint: str | None = None
    per_conversation: bool = False  # a conversation as one record where its history is exact (units.py)
    # --format vocab: the draft vocabulary sizes, each dataset's weight in the mix (1 when not named), and the
    # target's vocabulary size (default: its config.json's vocab_size)
    draft_vocab_sizes: tuple[int, ...] = (32000,)
    weights: tuple[tuple[str, float], ...] = ()
    target_vocab_size: int | None = None

    def options(self) -> dict[str, Any]:
        return {"filters": self.filters.as_dict(), "keep_mismatched": self.keep_mismatched,
                "tokenizer": self.tokenizer, "specforge_template": self.specforge_template,
                "per_conversation": self.per_conversation}


def export_format(name: str) -> ExportFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ExportError(f"--format {name!r}: use one of {', '.join(FORMATS)}") from None


# --- the destination -------------------------------------------------------------------------------------------

def _is_export_file(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    if key.startswith(SPOOL_PREFIX) or TMP_MARK in name:
        return True
    if key in (MANIFEST, MISMATCHES) or key in {f.single_file for f in FORMATS.values()}:
        return True
    if any(f.names and re.fullmatch(f.names, key) for f in FORMATS.values()):
        return True
    return any(f.part_prefix and key.startswith(f.part_prefix) for f in FORMATS.values())


def prepare_destination(destination: Storage, overwrite: bool) -> None:
    """An empty destination, or an earlier export (complete with --overwrite, or the leftovers of a killed one)."""
    keys = list(destination.list(""))
    foreign = [key for key in keys if not _is_export_file(key)]
    if foreign:
        raise ExportError(f"{destination.root_uri} holds files tokenmill export did not write ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}); choose an empty destination")
    if MANIFEST in keys and not overwrite:
        raise ExportError(f"{destination.uri(MANIFEST)} exists: {destination.root_uri} holds an export; pass "
                          "--overwrite to replace it")
    if MANIFEST in keys:
        destination.delete(MANIFEST)  # first: a half-replaced export must never look complete
    for key in keys:
        if key != MANIFEST:
            destination.delete(key)
    if isinstance(destination, LocalStorage) and destination.root.is_dir():
        for folder in destination.root.glob(SPOOL_PREFIX + "*"):  # a killed export's spool, emptied above
            shutil.rmtree(folder, ignore_errors=True)


def _spool_folder(destination: Storage, stack: ExitStack) -> Path:
    # Beside the files for a local destination (publishing is then a rename), in the temp folder for S3.
    parent = None
    if isinstance(destination, LocalStorage):
        destination.root.mkdir(parents=True, exist_ok=True)
        parent = destination.root
    folder = Path(tempfile.mkdtemp(prefix=SPOOL_PREFIX, dir=parent))
    stack.callback(shutil.rmtree, folder, True)
    return folder


# --- reading committed rows ------------------------------------------------------------------------------------

def run_datasets(source: Storage, run: dict[str, Any]) -> list[str]:
    """The run's datasets, in spec order; listing the whole output (every shard) only when run.json names none."""
    names = [d["name"] for d in (run.get("spec") or {}).get("datasets", [])]
    return names or datasets_with_commits(source)


@dataclass(frozen=True)
class Shards:
    """A dataset's committed shards, in commit order, and how many rows they hold (markers themselves are not
    kept: they list every sample)."""

    keys: list[str]
    rows: int
    dangling: list[str] = field(default_factory=list)  # data files markers name that do not exist


def committed_shards(source: Storage, dataset: str) -> Shards:
    """The shards the markers name that exist; a marker whose data file is gone (a dangling marker: another writer
    deleted it, or a person did) is skipped and named, so the rest of the dataset still exports."""
    keys, rows, dangling = [], 0, []
    stored = stored_files(source, dataset)
    for marker in markers_in_commit_order(source, dataset):  # streamed: only the shard keys are kept
        data = marker.get("data")
        if data and data not in stored:
            dangling.append(f"{dataset}/{data}")
            logger.warning("%s: the commit marker of shard %s names %s, which does not exist: skipped", dataset,
                           marker.get("shard_id"), source.uri(f"{dataset}/{data}"))
            continue
        if data:
            keys.append(f"{dataset}/{data}")
        rows += len(marker["samples"]["sample_id"])
    return Shards(keys, rows, dangling)


def committed_rows(source: Storage, keys: list[str], pool: ThreadPoolExecutor) -> Iterator[dict[str, Any]]:
    """Rows of the given shards, in order, a few shards fetched ahead (to temporary files, each bounded) and read as
    every reader reads shards (`shards.shard_rows`)."""
    pending: deque[tuple[str, Future[IO[bytes]]]] = deque()

    def rows(key: str, fetched: Future[IO[bytes]]) -> Iterator[dict[str, Any]]:
        with fetched.result() as spool:
            yield from shard_rows(spool, source.uri(key))

    try:
        for key in keys:
            pending.append((key, pool.submit(fetch_shard, source, key)))
            if len(pending) > PREFETCH_SHARDS:
                yield from rows(*pending.popleft())
        while pending:
            yield from rows(*pending.popleft())
    finally:
        for _, fetched in pending:  # an export stopped part-way: the fetched copies are removed
            if not fetched.cancel() and fetched.exception() is None:
                fetched.result().close()


# --- the text formats' tokenizer side --------------------------------------------------------------------------

@dataclass
class TextSide:
    """Tokenizer, sources and template facts for the text formats (None of it is needed for the token formats)."""

    tokenizer: Any
    context: ConversationContext  # the SpecForge template (both text formats) and the run's facts
    conversations: bool  # specforge-conversations (re-rendered), else specforge-text (re-tokenized)
    sources: dict[str, str]  # dataset -> source URI
    formats: dict[str, str]  # dataset -> declared source format
    endpoint: str | None
    spool: Path
    stack: ExitStack
    layouts: dict[str, RowLayout] = field(default_factory=dict)  # dataset -> its input layout (spec input)
    _open: dict[str, SourceLines] = field(default_factory=dict)

    def lines(self, dataset: str) -> SourceLines:
        if dataset not in self._open:
            if dataset not in self.sources:
                raise ExportError(f"run.json names no source for dataset {dataset!r}; a text export needs its prompts")
            lines = SourceLines(self.sources[dataset], self.formats.get(dataset, "auto"), self.endpoint, self.spool,
                                self.layouts.get(dataset, DEFAULT_LAYOUT))
            self._open[dataset] = self.stack.enter_context(lines)
        return self._open[dataset]

    def check(self, unit: GenerationUnit) -> Checked:
        if not self.conversations:
            return check_text(self.tokenizer, unit, self.context.template)
        prompt = self.lines(unit.dataset).prompt(unit.line)
        if isinstance(prompt, Prompt) and unit.in_conversation:
            prompt = answered_history(prompt)
        if not isinstance(prompt, Prompt) or prompt.sample_id != unit.sample_id:
            found = prompt.message if isinstance(prompt, RowError) else f"sample {prompt.sample_id!r}"
            return Checked({}, Mismatch("source_changed", 0, [], [],
                                        f"line {unit.line} of {self.sources[unit.dataset]}: {found}; the committed "
                                        f"row is sample {unit.sample_id!r}"))
        context = ConversationContext(self.context.template, self.context.template_kwargs.get(unit.dataset, {}),
                                      self.context.openers, self.context.tool_call_id)
        return check_conversation(self.tokenizer, unit, prompt, context)


def answered_history(prompt: Prompt) -> Prompt | RowError:
    """The messages a regenerated conversation's first turn answered (`mode: all-turns`): the source up to its first
    assistant message. A conversation that stopped after turn 0 is exported with that history only: the source's
    later answers and tool results followed the source's answer, not the model's."""
    conversation = start(prompt)
    if isinstance(conversation, RowError):
        return conversation
    return Prompt(prompt.line, prompt.sample_id, conversation.history, prompt.tools)


def template_columns(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{dataset: its chat template arguments over the union of every dataset's keys}: each becomes a column of
    every conversations row (SpecForge passes columns to the template), null where a dataset does not set it."""
    per_dataset = {name: facts.get("chat_template_kwargs") or {} for name, facts in (run.get("datasets") or {}).items()}
    keys = sorted({key for kwargs in per_dataset.values() for key in kwargs})
    clash = [key for key in keys if key in ("id", "conversations", "tools")]
    if clash:
        raise ExportError(f"chat template argument(s) {', '.join(clash)} would collide with SpecForge's own columns")
    return {name: {key: kwargs.get(key) for key in keys} for name, kwargs in per_dataset.items()}


def text_side(request: ExportRequest, fmt: ExportFormat, run: dict[str, Any], spool: Path,
              stack: ExitStack) -> TextSide:
    from ..render.pretokenize import flag_allows_remote_code, load_tokenizer, local_model_folder, single_token_id

    info = run.get("tokenizer") or {}
    location = request.tokenizer or info.get("location")
    if not location:
        raise ExportError("run.json records no tokenizer; pass --tokenizer FOLDER")
    tokenizer = load_tokenizer(local_model_folder(location, request.s3_endpoint), request.trust_remote_code,
                               flag_allows_remote_code(location))
    if not request.specforge_template:
        raise ExportError(f"--format {fmt.name} needs --specforge-template NAME: the data.chat_template you will train "
                          "with (it decides the loss mask SpecForge builds, the system prompt it adds and whether "
                          "reasoning_content reaches the template)")
    ends = (info.get("reasoning_end_tokens") or {}).values()
    openers = frozenset(i for text in ends if text in REASONING_OPENERS
                        for i in [single_token_id(tokenizer, REASONING_OPENERS[text])] if i is not None)
    context = ConversationContext(specforge_template(request.specforge_template), template_columns(run),
                                  openers, info.get("tool_call_id"))
    datasets = (run.get("spec") or {}).get("datasets", [])
    return TextSide(tokenizer, context, fmt.name == "specforge-conversations",
                    {d["name"]: d["source"] for d in datasets},
                    {d["name"]: d.get("format", "auto") for d in datasets}, request.s3_endpoint, spool, stack,
                    {d["name"]: DatasetSpec.model_validate(d).row_layout() for d in datasets})


# --- the export ------------------------------------------------------------------------------------------------

TOKEN_RECORDS: dict[str, Callable[[GenerationUnit], dict[str, Any]]] = {
    "specforge": specforge_record, "speculators": speculators_record, "hf": hf_record,
}


class ProgressLine:
    """A redrawn line on a terminal, a log line every `log_every_s` otherwise."""

    def __init__(self, total: int, stream: TextIO | None, clock: Callable[[], float], log_every_s: float = 10.0):
        self.total, self.clock, self.log_every_s = total, clock, log_every_s
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.started = self._last = clock()
        self.meter = ThroughputMeter(window_s=30.0)

    def update(self, done: int, written: int, mismatched: int, final: bool = False) -> None:
        now = self.clock()
        self.meter.record(now, done - self.meter.samples, 0)
        if not (final or self.interactive or now - self._last >= self.log_every_s):
            return
        self._last = now
        rate = self.meter.rates(now, self.started)[0]
        line = progress_line(ExportProgress(done, max(self.total, done), written, mismatched, rate, now - self.started))
        if self.interactive:
            self.stream.write("\r" + line + "\x1b[K" + ("\n" if final else ""))
            self.stream.flush()
        else:
            logger.info("%s", line)


@dataclass
class Exporter:
    request: ExportRequest
    fmt: ExportFormat
    run: dict[str, Any]
    text: TextSide | None
    writer: JsonlFiles | ParquetFiles
    mismatches: JsonlFiles
    counts: ExportCounts = field(default_factory=ExportCounts)
    overlapping: dict[str, set[int]] = field(default_factory=dict)  # dataset -> lines overlapping an evaluation set
    done: int = 0  # running totals over every dataset, for the progress line
    written: int = 0
    mismatched: int = 0

    def add_unit(self, unit: GenerationUnit, counts: DatasetCounts) -> None:
        counts.units += 1
        self.done += 1
        rejected = "eval_overlap" if unit.line in self.overlapping.get(unit.dataset, ()) else None
        rejected = rejected or self.request.filters.rejection(unit)
        if rejected:
            counts.filtered[rejected] += 1
            return
        invalid = invalid_reason(unit, (self.run.get("tokenizer") or {}).get("vocab_size"))
        if invalid is None and self.text is not None and unit.turns > 1:
            invalid = "multi_turn_text"
        if invalid:
            counts.invalid[invalid] += 1
            self.mismatches.write({**Mismatch(invalid, 0, [], []).record(unit), "written": False})
            return
        if self.text is None:
            record = TOKEN_RECORDS[self.fmt.name](unit)
        else:
            checked = self.text.check(unit)
            counts.suffix_tokens += checked.suffix_tokens > 0
            counts.trainer_mask_tokens += checked.mask.tokens if checked.mask else 0
            if checked.mismatch is not None:
                counts.mismatched[checked.mismatch.reason] += 1
                self.mismatched += 1
                write = self.request.keep_mismatched and bool(checked.record)
                self.mismatches.write({**checked.mismatch.record(unit), "written": write})
                if not write:
                    return
                counts.kept_mismatched += 1
            record = checked.record
        self.writer.write(record)
        counts.written += 1
        self.written += 1
        counts.supervised_tokens += unit.supervised_tokens
        counts.longest = max(counts.longest, len(unit.prompt_ids) + len(unit.output_ids))


def export(request: ExportRequest, stream: TextIO | None = None,
           clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Export a run's committed rows; returns the manifest (also written to DEST/export.json, last)."""
    from .. import __version__

    fmt = export_format(request.format)
    source = open_storage(request.source_uri, request.s3_endpoint)
    recorded = require_manifest(source)
    run = recorded.model_dump(mode="json", exclude_none=True)
    datasets = select_datasets(run_datasets(source, run), request.filters.datasets)
    excluded, unfinished = _judged(source, datasets, request.filters)
    datasets = [name for name in datasets if name not in excluded]
    destination = open_storage(request.dest_uri, request.dest_s3_endpoint or request.s3_endpoint)
    if destination.root_uri.rstrip("/") == source.root_uri.rstrip("/"):
        raise ExportError("the destination is the run's own output folder; export next to it")
    if fmt.kind == "ckpt" and ((run.get("spec") or {}).get("hiddenStates") or {}).get("storage") == "fp8":
        raise ExportError("--format specforge-offline: the run stored its hidden states as fp8 (spec.hiddenStates."
                          "storage), and SpecForge 0.2.0 reads .ckpt tensors as stored, with no FP8 reader; capture "
                          "with storage: served for SpecForge")
    if fmt.kind == "arrow":
        from .speculators_offline import SpeculatorsLayoutError, check_run_layout

        try:
            check_run_layout(run)  # before the destination is touched: an earlier export there stays whole
        except SpeculatorsLayoutError as error:
            raise ExportError(str(error)) from None
    if fmt.kind == "ckpt" and not (run.get("spec") or {}).get("hiddenStates"):
        raise ExportError("--format specforge-offline: the run's spec sets no hiddenStates, so it captured no hidden "
                          "states to export; add spec.hiddenStates and run it (docs/export.md), or export a token "
                          "format (specforge, hf, speculators)")
    f = request.filters
    if fmt.kind in ("ckpt", "arrow") and (f.per_unit or f.exclude_findings or f.eval_files):
        raise ExportError(f"--format {fmt.name} takes only --dataset among the filters: its features are every "
                          "captured sample's")
    prepare_destination(destination, request.overwrite)
    overlapping = _overlapping(request, run, datasets) if fmt.kind not in ("ckpt", "arrow") else {}
    if fmt.kind == "vocab":
        from .vocab import VocabExportError, export_vocab

        with ThreadPoolExecutor(max_workers=PREFETCH_SHARDS) as pool:
            def rows(dataset: str) -> Iterator[dict[str, Any]]:
                return committed_rows(source, committed_shards(source, dataset).keys, pool)

            try:
                return export_vocab(request, source, destination, run, datasets, excluded, overlapping, rows,
                                    __version__)
            except VocabExportError as error:
                raise ExportError(str(error)) from None
    if fmt.kind in ("ckpt", "arrow"):
        if fmt.kind == "ckpt":
            from .offline import export_specforge_offline

            return export_specforge_offline(source, destination, datasets, source.root_uri, __version__)
        from .speculators_offline import export_speculators_offline

        with ExitStack() as stack:
            return export_speculators_offline(source, destination, datasets, run, _spool_folder(destination, stack),
                                              request.part_bytes, __version__)
    with ExitStack() as stack, ThreadPoolExecutor(max_workers=PREFETCH_SHARDS) as pool:
        spool = _spool_folder(destination, stack)
        text = text_side(request, fmt, run, spool, stack) if fmt.text else None
        writer = (ParquetFiles(destination, spool, fmt, request.part_bytes) if fmt.kind == "parquet"
                  else JsonlFiles(destination, spool, fmt, request.part_bytes))
        exporter = Exporter(request, fmt, run, text, writer, JsonlFiles(destination, spool, None, 0, MISMATCHES),
                            overlapping=overlapping)
        shards = {name: committed_shards(source, name) for name in datasets}
        progress = ProgressLine(sum(s.rows for s in shards.values()), stream, clock)
        for name in datasets:
            exporter.counts.of(name).dangling.extend(shards[name].dangling)
            _export_dataset(exporter, source, name, shards[name].keys, pool, progress)
        files = writer.close()
        mismatch_files = exporter.mismatches.close()
        progress.update(exporter.done, exporter.written, exporter.mismatched, final=True)
        manifest = build_manifest(fmt, source.root_uri, destination.root_uri, run, request.options(), excluded,
                                  exporter.counts, files, mismatch_files[0] if mismatch_files else None,
                                  datetime.now(UTC), __version__, unfinished)
        destination.put(MANIFEST, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    return manifest


def _overlapping(request: ExportRequest, run: dict[str, Any], datasets: list[str]) -> dict[str, set[int]]:
    """{dataset: source lines whose prompt overlaps an evaluation file} (--exclude-eval-overlap), read from the
    sources run.json names, as `tokenmill report --eval` finds them (report/mix.py)."""
    filters = request.filters
    if not filters.eval_files:
        return {}
    from ..report.mix import matched_lines
    from ..report.prompt_scan import read_eval_files, scan_prompts

    index = read_eval_files(filters.eval_files, filters.ngram, request.s3_endpoint)
    return matched_lines(scan_prompts(run, datasets, index, request.s3_endpoint).matches)


def _judged(source: Storage, datasets: list[str], filters: ExportFilters) -> tuple[dict[str, list[str]],
                                                                                 dict[str, str]]:
    """What the run's ledger says of the datasets to export, from one fold of its markers: those the report's
    findings exclude (--exclude-findings), with the findings, and those whose run is not finished, with how much of
    the layout has no outcome (the export then holds what is committed so far, and says so)."""
    from ..report.files import load_ledger
    from ..report.validation import build_report

    ledger = load_ledger(source)
    unfinished = {}
    for dataset in ledger.datasets:
        completeness = dataset.completeness() if dataset.name in datasets else None
        if completeness is not None and not completeness.settled:
            unfinished[dataset.name] = completeness.describe_missing()
    if filters.exclude_findings is None:
        return {}, unfinished
    findings = build_report(ledger)["findings"]
    return {name: messages for name, messages in excluded_by_findings(findings, filters.exclude_findings).items()
            if name in datasets}, unfinished


def _export_dataset(exporter: Exporter, source: Storage, dataset: str, shard_keys: list[str],
                    pool: ThreadPoolExecutor, progress: ProgressLine) -> None:
    counts = exporter.counts.of(dataset)
    seen = SlotSeen()
    for row in committed_rows(source, shard_keys, pool):
        if row.get("dataset") not in (None, dataset):
            raise ExportError(f"a committed shard of {dataset} holds a row of dataset {row.get('dataset')!r}")
        if not seen.add(int(row["line"]), int(row.get("sample_index") or 0)):
            counts.duplicate_slots += 1
            continue
        for unit in units_from_row(row, exporter.request.per_conversation):
            exporter.add_unit(unit, counts)
        progress.update(exporter.done, exporter.written, exporter.mismatched)


__all__ = ["DEFAULT_PART_BYTES", "ExportError", "ExportRequest", "StorageError", "export", "export_format"]
