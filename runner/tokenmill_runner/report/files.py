"""The report's files: the ledger read from a run's commit markers, and report.json, report.md and one PNG per
dataset written next to them (under report/). The storage edge of `validation.py`."""

from __future__ import annotations

from typing import Any

import orjson

from ..store.manifest import MANIFEST, RunManifest, read_manifest
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


def _add_hidden_states(storage: Storage, ledger: Any, report: dict[str, Any]) -> None:
    """The hidden-state section and its findings, when the run asked for states (report/hidden_states.py)."""
    from ..facts.hidden_states import kinds_needed
    from ..store.hidden_states import KINDS, hidden_state_inputs
    from .hidden_states import StateRecord, hidden_state_section
    from .validation import LEVELS

    spec = ledger.run.get("spec") if isinstance(ledger.run, dict) else None
    if not (isinstance(spec, dict) and spec.get("hiddenStates") is not None):
        return
    layouts = spec["hiddenStates"].get("layouts") or []
    sections = {}
    for dataset in ledger.datasets:
        for kind in kinds_needed(list(layouts)):
            expected, states, failed = hidden_state_inputs(storage, dataset.name, KINDS[kind])
            records = [StateRecord(*state) for state in states]
            section, findings = hidden_state_section(dataset.name, expected, records, failed, kind)
            if kind == "aux":
                sections[dataset.name] = section
            else:
                sections[dataset.name]["final"] = section
            report["findings"].extend(findings)
    report["hidden_states"] = sections
    report["verdict"] = max((f["level"] for f in report["findings"]), key=LEVELS.index, default="fail")


def write_report(storage: Storage) -> tuple[dict[str, Any], list[str]]:
    """Compute the report from the commit markers and write report.json, report.md and one PNG per dataset."""
    from .markdown import render
    from .plots import dataset_png

    ledger = load_ledger(storage)
    report = build_report(ledger)
    _add_hidden_states(storage, ledger, report)
    images = []
    for dataset in ledger.datasets:
        caps = report["datasets"][dataset.name]["truncated"]["caps"]
        storage.put(f"{REPORT_DIR}/{dataset.name}.png", dataset_png(dataset.name, dataset, caps))
        images.append(f"{dataset.name}.png")
    storage.put(f"{REPORT_DIR}/report.json", orjson.dumps(report, option=orjson.OPT_INDENT_2))
    storage.put(f"{REPORT_DIR}/report.md", render(report, images).encode())
    written = [storage.uri(f"{REPORT_DIR}/{name}") for name in ("report.json", "report.md", *images)]
    return report, written
