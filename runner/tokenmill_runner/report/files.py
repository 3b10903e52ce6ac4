"""The report's files: the ledger read from a run's commit markers, and report.json, report.md and one PNG per
dataset written next to them (under report/), with the draft-vocabulary coverage from each shard's loss-token counts
(`vocabulary.png`) and, when asked, the prompts' duplicates and evaluation overlap (`duplicates.jsonl`,
`eval_overlap.jsonl`). The storage edge of `validation.py`, `vocabulary.py` and `mix.py`."""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import orjson

from ..stats.token_freq import REPORT_SIZES, TokenFrequencies
from ..store.completion import Completion, StateCoverage
from ..store.ledger import DatasetLedger, LedgerBudget
from ..store.manifest import MANIFEST, RunManifest, read_manifest
from ..store.markers import datasets_with_commits, markers_in_commit_order
from ..store.shards import missing_files, stored_files
from ..store.storage import Storage
from ..store.token_counts import CountedShard, accumulate, counted_shard
from .mix import NGRAM, duplicate_groups, duplicate_section, overlap_section, share_section
from .validation import LEVELS, DatasetSamples, Ledger, build_report
from .vocabulary import mixed, vocabulary_section

REPORT_DIR = "report"
COUNT_BATCH = 1024  # shards whose counts are read together after their markers are folded


# Why a dataset with commits and no run.json cannot pass: only worker 0 records the layout (one writer of run.json,
# under the lease), so its absence means worker 0 never got that far, and the other workers' commits are a part of
# a whole whose size nobody recorded. The report says so rather than have another worker write a layout: a report of
# an output written by an older release, or by workers that all died before worker 0 started, is judged the same.
NO_LAYOUT = "run.json missing: worker 0 never recorded the layout"


class NotARunOutput(LookupError):
    """The URI holds no run (a mistyped path): report, inspect and export refuse it before writing anything."""


def require_run_output(storage: Storage, manifest_needed: bool = False) -> None:
    """Refuse a URI that is no run's output: no run.json and (unless `manifest_needed`) no commit marker either. A
    report of it would create the folder and print FAIL with no reason; tokenmill exits 2 instead, as for any bad
    argument."""
    if storage.exists(MANIFEST) or (not manifest_needed and datasets_with_commits(storage)):
        return
    raise NotARunOutput(f"{storage.root_uri} is not a tokenmill run's output: it has no {MANIFEST}"
                        f"{'' if manifest_needed else ' and no commit markers'}; check the path (nothing was written)")


def require_manifest(storage: Storage) -> RunManifest:
    """run.json, bounded and checked as the report and the operator read it, for the readers that need the run's
    layout and tokenizer (inspect, export); a URI without it is refused before anything is written."""
    require_run_output(storage, manifest_needed=True)
    recorded = read_manifest(storage)
    if recorded is None:  # removed between the check and the read
        raise NotARunOutput(f"{storage.uri(MANIFEST)} does not exist: {storage.root_uri} is not a tokenmill run's "
                            "output; check the path (nothing was written)")
    return recorded


def load_ledger(storage: Storage, count: Callable[[str, Iterator[CountedShard]], None] | None = None) -> Ledger:
    """The ledger of every dataset, folded from its markers; `count` (when given) is handed, per dataset, the shards
    whose loss-token counts count (store/token_counts.py), as the same fold decides, while the fold goes on: it must
    take them all (`accumulate` does), and nothing per marker is kept."""
    recorded = read_manifest(storage)
    manifest = recorded or RunManifest()
    names = manifest.dataset_names
    extra = sorted(set(datasets_with_commits(storage)) - set(names))
    datasets = []
    budget = LedgerBudget()  # one for the run: its markers set how much the report allocates only up to the bound
    for name in names + extra:
        layout = manifest.datasets.get(name)  # the current layout: its lines x samples per prompt
        lines, per_prompt = (layout.last_line, layout.samples) if layout else (None, 1)
        ledger = DatasetSamples(name, lines=lines, per_prompt=per_prompt,
                                within=layout.within_bits() if layout else None,
                                no_layout=NO_LAYOUT if recorded is None else None,
                                ledger=DatasetLedger(name, lines or 0, per_prompt, budget))
        shards = _fold(storage, name, ledger)
        if count is None:
            deque(shards, maxlen=0)
        else:
            count(name, shards)
        datasets.append(ledger)
    return Ledger(storage.root_uri, manifest.model_dump(mode="json", exclude_none=True), datasets)


def _fold(storage: Storage, name: str, ledger: DatasetSamples) -> Iterator[CountedShard]:
    """Fold a dataset's markers into `ledger`, streamed in commit order (a window of markers in memory), yielding
    each shard that counts as its marker is folded (a list of them would grow by a marker's shard)."""
    stored = stored_files(storage, name)
    for marker in markers_in_commit_order(storage, name):
        ledger.check_files(marker, missing_files(marker, stored))
        shard = counted_shard(name, marker, ledger.add_marker(marker))
        if shard is not None:
            yield shard


def _add_hidden_states(storage: Storage, ledger: Any, report: dict[str, Any]) -> tuple[StateCoverage, ...]:
    """The hidden-state section and its findings, when the run asked for states (report/hidden_states.py); each
    kind's coverage over every dataset, for the run's completion."""
    from ..facts.hidden_states import kinds_needed
    from ..store.hidden_states import KINDS, expected_lengths, failed_keys, state_keys, state_records
    from .hidden_states import hidden_state_section

    spec = ledger.run.get("spec") if isinstance(ledger.run, dict) else None
    if not (isinstance(spec, dict) and spec.get("hiddenStates") is not None):
        return ()
    layouts = spec["hiddenStates"].get("layouts") or []
    sections: dict[str, Any] = {}
    kinds: dict[str, StateCoverage] = {}
    for dataset in ledger.datasets:
        keys, lengths = expected_lengths(storage, dataset.name)
        for kind in kinds_needed(list(layouts)):
            failed = state_keys(failed_keys(storage, dataset.name, KINDS[kind]))
            section, findings, found = hidden_state_section(
                dataset.name, keys, lengths, state_records(storage, dataset.name, KINDS[kind]), failed, kind)
            kinds[kind] = kinds[kind] + found if kind in kinds else found
            if kind == "aux":
                sections[dataset.name] = section
            else:
                sections[dataset.name]["final"] = section
            report["findings"].extend(findings)
    report["hidden_states"] = sections
    return tuple(kinds.values())


def _add_completion(report: dict[str, Any], states: tuple[StateCoverage, ...]) -> None:
    """The run's completion (store/completion.py: every slot settled and every artifact present) and the verdict: a
    report whose run is not complete never passes."""
    overall = report["overall"]
    unsettled = overall["without_outcome"]
    if unsettled is None:  # no layout recorded: whether it is complete cannot be told (a finding says why)
        report["completion"] = None
    else:
        completion = Completion(unsettled, overall["given_up"], states)
        report["completion"] = {"verdict": completion.verdict, "unsettled": completion.unsettled,
                                "given_up": completion.given_up, "states_missing": completion.states_missing,
                                "states_failed": completion.states_failed, "retryable": completion.retryable,
                                "message": completion.describe()}
    verdict = max((f["level"] for f in report["findings"]), key=LEVELS.index, default="fail")
    complete = report["completion"] is not None and report["completion"]["verdict"] == "complete"
    report["verdict"] = verdict if complete else "fail"


@dataclass(frozen=True)
class PromptChecks:
    """What `tokenmill report --mix` asks for: the prompt sources read for duplicates, and overlap with these
    evaluation files (JSON lines of prompts), by runs of `ngram` words."""

    eval_files: Sequence[str] = field(default_factory=tuple)
    ngram: int = NGRAM
    endpoint: str | None = None  # S3 endpoint of the sources and evaluation files


DUPLICATES, EVAL_OVERLAP, COVERAGE_PNG = "duplicates.jsonl", "eval_overlap.jsonl", "vocabulary.png"


def _add_mix(storage: Storage, ledger: Ledger, report: dict[str, Any],
             frequencies: dict[str, TokenFrequencies], checks: PromptChecks | None) -> list[str]:
    """The mix section (shares always; duplicates and evaluation overlap when asked); returns the files written."""
    from .prompt_scan import read_eval_files, scan_prompts

    samples = {d.name: d.samples for d in ledger.datasets}
    section: dict[str, Any] = {"shares": share_section(samples, {n: f.total for n, f in frequencies.items()})}
    report["mix"] = section
    if checks is None:
        return []
    index = read_eval_files(checks.eval_files, checks.ngram, checks.endpoint) if checks.eval_files else None
    scan = scan_prompts(ledger.run, [d.name for d in ledger.datasets], index, checks.endpoint)
    groups = duplicate_groups(scan.hashes)
    section["duplicates"] = duplicate_section(scan.hashes, groups)
    storage.put(f"{REPORT_DIR}/{DUPLICATES}", b"".join(orjson.dumps(g.record()) + b"\n" for g in groups))
    written = [DUPLICATES]
    if index is not None:
        overlap = section["eval_overlap"] = overlap_section(index, scan.matches, scan.prompts(), checks.eval_files)
        storage.put(f"{REPORT_DIR}/{EVAL_OVERLAP}", b"".join(orjson.dumps(m.record()) + b"\n" for m in scan.matches))
        written.append(EVAL_OVERLAP)
        for name, counts in overlap["datasets"].items():
            if counts["overlapping"]:
                report["findings"].append({
                    "check": "eval_overlap", "level": "warn", "dataset": name, "value": counts["overlapping"],
                    "threshold": 0,
                    "message": f"{name}: {counts['overlapping']} prompts share a run of {checks.ngram} words with "
                               f"the evaluation files ({', '.join(checks.eval_files)}): a drafter trained on them "
                               f"is judged on what it saw; report/{EVAL_OVERLAP} lists them, and tokenmill export "
                               "--exclude-eval-overlap FILE leaves them out"})
        report["verdict"] = max((f["level"] for f in report["findings"]), key=LEVELS.index, default="fail")
    return written


@dataclass
class Computed:
    """A report computed from a run's markers and counts, before its files are drawn and written."""

    report: dict[str, Any]
    ledger: Ledger
    frequencies: dict[str, TokenFrequencies]  # per dataset, in spec order
    files: list[str]  # the .jsonl files the mix wrote under report/


def _return_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere). The fold frees what
    it held per marker and the latencies' exact window (up to 2^20 floats), but glibc keeps those pages, and the
    figures and plots that follow would stack their peak on them: at 10M samples ~14 MiB that a 200k report never
    held."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator returns pages its own way
        return
    trim(0)


def compute_report(storage: Storage, checks: PromptChecks | None = None, recount_rows: bool = False) -> Computed:
    """report.json's content: the validation report, the hidden states, the vocabulary coverage and the mix.
    `recount_rows`: count a shard whose counts file cannot be used (a slot committed twice, a marker older than the
    counts) from its rows. Off where the operator reports: it reads no tenant's shard (docs/security.md); such
    shards are then named in the vocabulary section as not counted."""
    frequencies, uncounted = {}, {}

    def count(name: str, shards: Iterator[CountedShard]) -> None:
        # A batch of markers folded, then their shards' counts read: never a list of every shard, and the fold does
        # not wait on each counts read (reading them as each marker is folded took ~8 % longer at 10M samples).
        total, missed = TokenFrequencies(), 0
        for batch in iter(lambda: list(islice(shards, COUNT_BATCH)), []):
            part, left = accumulate(storage, batch, recount_rows=recount_rows)
            total.merge(part)  # exact: its ids met after the earlier batches', as one pass in order would
            missed += left
        frequencies[name], uncounted[name] = total, missed

    ledger = load_ledger(storage, count)
    _return_freed_heap()
    report = build_report(ledger)
    states = _add_hidden_states(storage, ledger, report)
    report["vocabulary"] = vocabulary_section(frequencies, uncounted=uncounted)
    files = _add_mix(storage, ledger, report, frequencies, checks)
    _add_completion(report, states)
    return Computed(report, ledger, frequencies, files)


def write_report(storage: Storage, checks: PromptChecks | None = None,
                 recount_rows: bool = False) -> tuple[dict[str, Any], list[str]]:
    """Compute the report from the commit markers and write report.json, report.md and the PNGs (one per dataset
    and the vocabulary coverage); with `checks`, read the prompt sources for the mix's duplicates and overlap;
    `recount_rows` as in `compute_report` (the runner's own commands recount; the operator does not)."""
    from .markdown import render
    from .plots import coverage_png, dataset_png

    computed = compute_report(storage, checks, recount_rows)
    report, frequencies = computed.report, computed.frequencies
    images = []
    for dataset in computed.ledger.datasets:
        caps = report["datasets"][dataset.name]["truncated"]["caps"]
        storage.put(f"{REPORT_DIR}/{dataset.name}.png", dataset_png(dataset.name, dataset, caps))
        images.append(f"{dataset.name}.png")
    curves = {name: counts.curve() for name, counts in frequencies.items()}
    if len(frequencies) > 1:
        curves["mix"] = mixed(frequencies).curve()
    storage.put(f"{REPORT_DIR}/{COVERAGE_PNG}", coverage_png(curves, list(REPORT_SIZES)))
    images.append(COVERAGE_PNG)
    storage.put(f"{REPORT_DIR}/report.json", orjson.dumps(report, option=orjson.OPT_INDENT_2))
    storage.put(f"{REPORT_DIR}/report.md", render(report, images).encode())
    written = [storage.uri(f"{REPORT_DIR}/{name}") for name in ("report.json", "report.md", *images,
                                                                 *computed.files)]
    return report, written
