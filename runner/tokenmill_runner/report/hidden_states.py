"""The report's hidden-state section: coverage (samples with states / committed samples), bytes, and a `fail`
finding when a sample's states do not have one row per token of its sequence, or samples lack states. Pure."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


def hidden_state_section(dataset: str, keys: np.ndarray, lengths: np.ndarray,
                         states: Iterable[tuple[str, int, int, int, str]], failed: int,
                         kind: str = "aux") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`keys`, `lengths`: every committed sample (sorted 64-bit keys) and its sequence length (prompt + output
    tokens; -1 where the marker cannot tell, a multi-turn conversation). `states`: (label, key, tokens, bytes, stored
    dtype: the served one, or float8_e4m3fn) of each state marker, streamed. `kind` "final": SpecForge's final-state pass, its own checks. Memory: a byte per
    committed sample, whatever the states."""
    check, what = ("hidden_states", "hidden states") if kind == "aux" else ("final_states", "final hidden states")
    covered = np.zeros(keys.size, dtype=bool)
    total_bytes = total_tokens = 0
    dtypes: set[str] = set()
    misaligned, example = 0, ""
    orphans = 0
    for label, key, tokens, size, dtype in states:
        at = int(np.searchsorted(keys, np.uint64(key)))
        if at >= keys.size or int(keys[at]) != key:
            orphans += 1  # a sample the fold no longer counts (e.g. a duplicate): not coverage
            continue
        if covered[at]:
            continue
        covered[at] = True
        total_bytes += size
        total_tokens += tokens
        dtypes.add(dtype)
        length = int(lengths[at])
        if length >= 0 and length != tokens:
            misaligned += 1
            example = example or f"{label}: {tokens} states for {length} tokens"
    samples, with_states = int(keys.size), int(covered.sum())
    coverage = with_states / samples if samples else None
    section = {"samples": samples, "with_states": with_states, "coverage": coverage, "bytes": total_bytes,
               "dtypes": sorted(dtypes - {""}), "bytes_per_token": total_bytes / total_tokens if total_tokens else None,
               "failed_captures": failed, "misaligned": misaligned, "uncounted": orphans}
    findings: list[dict[str, Any]] = []
    if misaligned:
        findings.append(_finding(f"{check}_length", dataset, misaligned,
                                 f"{dataset}: {misaligned} samples' {what} differ in length from their "
                                 f"sequence, e.g. {example}; a drafter would train on misaligned features"))
    if samples and with_states < samples:
        advice = ("rerun with --retry-failed" if kind == "aux" or failed else "run the final-state pass against the "
                  "server relaunched with --enable-return-hidden-states")
        findings.append(_finding(f"{check}_coverage", dataset, coverage,
                                 f"{dataset}: {samples - with_states} of {samples} samples have no {what} "
                                 f"({failed} captures failed); {advice}"))
    return section, findings


def _finding(check: str, dataset: str, value: Any, message: str) -> dict[str, Any]:
    return {"check": check, "level": "fail", "dataset": dataset, "value": value, "threshold": None,
            "message": message}
