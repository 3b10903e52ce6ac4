"""The report's hidden-state section: coverage (samples with states / committed samples), bytes (as stored: fp8 states
are about half of bf16's) and the stored dtypes, and a `fail` finding when a sample's states do not have one row per
token of its sequence, or samples lack states. Pure."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SampleRef = tuple[str, int]  # (sample id, sample index)


@dataclass(frozen=True)
class StateRecord:
    sample: SampleRef
    tokens: int
    bytes: int
    dtype: str = ""  # as stored (the marker's dtype: the served one, or float8_e4m3fn)


def hidden_state_section(dataset: str, expected: dict[SampleRef, int | None], states: Iterable[StateRecord],
                         failed: int, kind: str = "aux") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`expected`: every committed sample and its sequence length (prompt + output tokens; None where the marker
    cannot tell, a multi-turn conversation). `kind` "final": SpecForge's final-state pass, its own checks."""
    check, what = ("hidden_states", "hidden states") if kind == "aux" else ("final_states", "final hidden states")
    covered: set[SampleRef] = set()
    total_bytes = total_tokens = 0
    dtypes: set[str] = set()
    misaligned: list[str] = []
    orphans = 0
    for record in states:
        if record.sample not in expected:
            orphans += 1  # a sample the fold no longer counts (e.g. a duplicate): not coverage
            continue
        covered.add(record.sample)
        total_bytes += record.bytes
        total_tokens += record.tokens
        dtypes.add(record.dtype)
        length = expected[record.sample]
        if length is not None and length != record.tokens:
            misaligned.append(f"{record.sample[0]} (index {record.sample[1]}): {record.tokens} states for "
                              f"{length} tokens")
    samples = len(expected)
    coverage = len(covered) / samples if samples else None
    section = {"samples": samples, "with_states": len(covered), "coverage": coverage, "bytes": total_bytes,
               "dtypes": sorted(dtypes - {""}), "bytes_per_token": total_bytes / total_tokens if total_tokens else None,
               "failed_captures": failed, "misaligned": len(misaligned), "uncounted": orphans}
    findings: list[dict[str, Any]] = []
    if misaligned:
        findings.append(_finding(f"{check}_length", dataset, len(misaligned),
                                 f"{dataset}: {len(misaligned)} samples' {what} differ in length from their "
                                 f"sequence, e.g. {misaligned[0]}; a drafter would train on misaligned features"))
    if samples and len(covered) < samples:
        advice = ("rerun with --retry-failed" if kind == "aux" or failed else "run the final-state pass against the "
                  "server relaunched with --enable-return-hidden-states")
        findings.append(_finding(f"{check}_coverage", dataset, coverage,
                                 f"{dataset}: {samples - len(covered)} of {samples} samples have no {what} "
                                 f"({failed} captures failed); {advice}"))
    return section, findings


def _finding(check: str, dataset: str, value: Any, message: str) -> dict[str, Any]:
    return {"check": check, "level": "fail", "dataset": dataset, "value": value, "threshold": None,
            "message": message}
