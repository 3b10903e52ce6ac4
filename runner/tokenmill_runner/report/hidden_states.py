"""The report's hidden-state section: coverage (samples with states / committed samples), bytes, and a `fail`
finding when a sample's states do not have one row per token of its sequence, or samples lack states. The counts
are store/completion.py's `coverage` (the one definition of done the exit code and the operator read too). Pure."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..store.completion import StateCoverage, StateRecord, coverage


def hidden_state_section(dataset: str, keys: np.ndarray, lengths: np.ndarray, states: Iterable[StateRecord],
                         failed: np.ndarray, kind: str = "aux"
                         ) -> tuple[dict[str, Any], list[dict[str, Any]], StateCoverage]:
    """`keys`, `lengths`: every committed sample (sorted 64-bit keys) and its sequence length (prompt + output
    tokens; -1 where the marker cannot tell, a multi-turn conversation). `states`: (label, key, tokens, bytes, stored
    dtype: the served one, or float8_e4m3fn) of each state marker, streamed; `failed`: the keys of the recorded
    capture failures. `kind` "final": SpecForge's final-state pass, its own checks. Memory: a byte per committed
    sample, whatever the states."""
    check, what = ("hidden_states", "hidden states") if kind == "aux" else ("final_states", "final hidden states")
    found = coverage(kind, keys, lengths, states, failed)
    section = {"samples": found.samples, "with_states": found.captured, "coverage": found.coverage,
               "bytes": found.state_bytes, "dtypes": list(found.dtypes),
               "bytes_per_token": found.state_bytes / found.state_tokens if found.state_tokens else None,
               "failed_captures": found.failed, "missing": found.missing, "misaligned": found.misaligned,
               "uncounted": found.uncounted}
    findings: list[dict[str, Any]] = []
    if found.misaligned:
        findings.append(_finding(f"{check}_length", dataset, found.misaligned,
                                 f"{dataset}: {found.misaligned} samples' {what} differ in length from their "
                                 f"sequence, e.g. {found.examples[0]}; a drafter would train on misaligned features "
                                 "(delete those state markers and run again to capture them anew)"))
    lacking = found.failed + found.missing
    if lacking:
        advice = []
        if found.failed:
            advice.append(f"{found.failed} captures failed: rerun with --retry-failed (on a cluster: the retry "
                          "annotation)")
        if found.missing:
            advice.append(f"{found.missing} were never captured: " + (
                "run again (the capture pass captures what is missing)" if kind == "aux" else
                "run the final-state pass against the server relaunched with --enable-return-hidden-states"))
        findings.append(_finding(f"{check}_coverage", dataset, found.coverage,
                                 f"{dataset}: {lacking} of {found.samples} samples have no {what}; "
                                 + "; ".join(advice)))
    return section, findings, found


def _finding(check: str, dataset: str, value: Any, message: str) -> dict[str, Any]:
    return {"check": check, "level": "fail", "dataset": dataset, "value": value, "threshold": None,
            "message": message}
