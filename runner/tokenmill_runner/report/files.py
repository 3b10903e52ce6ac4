"""The report's files: the ledger read from a run's commit markers, and report.json, report.md and one PNG per
dataset written next to them (under report/). The storage edge of `validation.py`."""

from __future__ import annotations

from typing import Any

import orjson

from ..store.manifest import RunManifest, read_manifest
from ..store.markers import datasets_with_commits, markers_in_commit_order
from ..store.shards import missing_files, stored_files
from ..store.storage import Storage
from .validation import DatasetSamples, Ledger, build_report

REPORT_DIR = "report"


# Why a dataset with commits and no run.json cannot pass: only worker 0 records the layout (one writer of run.json,
# under the lease), so its absence means worker 0 never got that far, and the other workers' commits are a part of
# a whole whose size nobody recorded. The report says so rather than have another worker write a layout: a report of
# an output written by an older release, or by workers that all died before worker 0 started, is judged the same.
NO_LAYOUT = "run.json missing: worker 0 never recorded the layout"


def load_ledger(storage: Storage) -> Ledger:
    recorded = read_manifest(storage)
    manifest = recorded or RunManifest()
    names = manifest.dataset_names
    extra = sorted(set(datasets_with_commits(storage)) - set(names))
    datasets = []
    for name in names + extra:
        layout = manifest.datasets.get(name)  # the current layout: its lines x samples per prompt
        ledger = DatasetSamples(name, lines=layout.last_line if layout else None,
                                per_prompt=layout.samples if layout else 1,
                                within=layout.within() if layout else None,
                                no_layout=NO_LAYOUT if recorded is None else None)
        stored = stored_files(storage, name)
        for marker in markers_in_commit_order(storage, name):  # streamed: one pass, a window of markers in memory
            ledger.check_files(marker, missing_files(marker, stored))
            ledger.add_marker(marker)
        datasets.append(ledger)
    return Ledger(storage.root_uri, manifest.model_dump(mode="json", exclude_none=True), datasets)


def _add_completion(storage: Storage, ledger: Any, report: dict[str, Any]) -> None:
    """The hidden-state section and its findings, when the run asked for states (report/hidden_states.py), and the
    run's completion (store/completion.py: every slot settled and every artifact present): a report whose run is not
    complete never passes."""
    from ..facts.hidden_states import kinds_needed
    from ..store.completion import Completion
    from ..store.hidden_states import KINDS, state_coverage
    from .hidden_states import hidden_state_section
    from .validation import LEVELS

    spec = ledger.run.get("spec") if isinstance(ledger.run, dict) else None
    states = spec.get("hiddenStates") if isinstance(spec, dict) else None
    kinds: dict[str, Any] = {}
    if states is not None:
        sections: dict[str, Any] = {}
        for dataset in ledger.datasets:
            for kind in kinds_needed(list(states.get("layouts") or [])):
                found, size = state_coverage(storage, dataset.name, KINDS[kind], read_markers=True)
                kinds[kind] = kinds[kind] + found if kind in kinds else found
                section, findings = hidden_state_section(dataset.name, found, size)
                if kind == "aux":
                    sections[dataset.name] = section
                else:
                    sections[dataset.name]["final"] = section
                report["findings"].extend(findings)
        report["hidden_states"] = sections
    overall = report["overall"]
    unsettled = overall["without_outcome"]
    if unsettled is None:  # no layout recorded: whether it is complete cannot be told (a finding says why)
        report["completion"] = None
    else:
        completion = Completion(unsettled, overall["given_up"], tuple(kinds.values()))
        report["completion"] = {"verdict": completion.verdict, "unsettled": completion.unsettled,
                                "given_up": completion.given_up, "states_missing": completion.states_missing,
                                "states_failed": completion.states_failed, "retryable": completion.retryable,
                                "message": completion.describe()}
    verdict = max((f["level"] for f in report["findings"]), key=LEVELS.index, default="fail")
    complete = report["completion"] is not None and report["completion"]["verdict"] == "complete"
    report["verdict"] = verdict if complete else "fail"


def full_report(storage: Storage) -> tuple[dict[str, Any], Ledger]:
    """The report of what is committed, its hidden states and the run's completion included, and the ledger it was
    computed from; nothing written."""
    ledger = load_ledger(storage)
    report = build_report(ledger)
    _add_completion(storage, ledger, report)
    return report, ledger


def write_report(storage: Storage) -> tuple[dict[str, Any], list[str]]:
    """Compute the report from the commit markers and write report.json, report.md and one PNG per dataset."""
    from .markdown import render
    from .plots import dataset_png

    report, ledger = full_report(storage)
    images = []
    for dataset in ledger.datasets:
        caps = report["datasets"][dataset.name]["truncated"]["caps"]
        storage.put(f"{REPORT_DIR}/{dataset.name}.png", dataset_png(dataset.name, dataset, caps))
        images.append(f"{dataset.name}.png")
    storage.put(f"{REPORT_DIR}/report.json", orjson.dumps(report, option=orjson.OPT_INDENT_2))
    storage.put(f"{REPORT_DIR}/report.md", render(report, images).encode())
    written = [storage.uri(f"{REPORT_DIR}/{name}") for name in ("report.json", "report.md", *images)]
    return report, written
