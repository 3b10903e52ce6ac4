"""The validation report: what was generated, in tokens, per dataset, computed from the commit markers.

Pure: the markers' samples and the ledger's outcomes in, a report dict out. Reading the markers and writing the
files is `report_files.py`.
The report's JSON schema is `tokenmill.report/v1` (documented in docs/report.md); bump it on breaking changes.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .ledger import RETRYABLE_REASONS, DatasetLedger
from .summary import RETRY_HINT
from .stats import distribution, length_shares, order_drift, reasoning_and_answer

logger = logging.getLogger(__name__)

SCHEMA = "tokenmill.report/v1"
LEVELS = ("pass", "warn", "fail")
DRIFT_FIRST_N = 100
# Reasoning "absent from (almost) every sample": below this share the run is broken, not just thin.
BROKEN_REASONING_SHARE = 0.05
SAMPLE_COLUMNS = ("sample_id", "line", "prompt_tokens", "completion_tokens", "finish_reason", "matched_stop",
                  "reasoning_end", "reasoning_end_token_id", "has_tool_call", "max_new_tokens", "latency_s")


@dataclass
class DatasetSamples:
    """A dataset's committed samples (in commit order) and final failures, from its markers."""

    name: str
    samples: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in SAMPLE_COLUMNS})
    errors: Counter[str] = field(default_factory=Counter)  # final failures by reason (retried ones excluded)
    rows: int | None = None  # source rows (run.json), when known: what completeness is checked against

    def add_markers(self, markers: list[dict[str, Any]]) -> None:
        for marker in markers:
            count = len(marker["samples"]["sample_id"])
            for column in SAMPLE_COLUMNS:
                # Markers written before a column existed (reasoning_end_token_id) read as nulls.
                self.samples[column].extend(marker["samples"].get(column, [None] * count))
        self.errors = Counter(DatasetLedger(self.name, self.rows or 0).fold_all(markers).final_failures())


@dataclass
class Ledger:
    output_uri: str
    run: dict[str, Any]  # run.json
    datasets: list[DatasetSamples]


@dataclass(frozen=True)
class Thresholds:
    max_truncated_fraction: float = 0.05
    min_reasoning_fraction: float = 0.9
    max_error_fraction: float = 0.01

    @classmethod
    def from_run(cls, run: dict[str, Any]) -> Thresholds:
        validation = (run.get("spec") or {}).get("validation") or {}
        defaults = cls()
        return cls(
            max_truncated_fraction=float(validation.get("maxTruncatedFraction", defaults.max_truncated_fraction)),
            min_reasoning_fraction=float(validation.get("minReasoningFraction", defaults.min_reasoning_fraction)),
            max_error_fraction=float(validation.get("maxErrorFraction", defaults.max_error_fraction)),
        )


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _end_token_counts(s: dict[str, list[Any]], names: dict[str, str]) -> dict[str, int]:
    """Samples per token that ended their reasoning (e.g. </think> vs Kimi's tool-call section opener)."""
    counts = Counter(token for end, token in zip(s["reasoning_end"], s["reasoning_end_token_id"], strict=True)
                     if end is not None)
    return {(_stop_name(token, names) if token is not None else "unrecorded"): count
            for token, count in sorted(counts.items(), key=lambda item: -item[1])}


def _reasoning(s: dict[str, list[Any]], expected: bool, end_names: dict[str, str] | None = None) -> dict[str, Any]:
    ends = s["reasoning_end"]
    reasoning, answer = reasoning_and_answer(s)
    truncated_reasoning = sum(
        1 for end, reason in zip(ends, s["finish_reason"], strict=True) if end is None and reason == "length"
    )
    return {
        "expected": expected,
        "present": len(reasoning),
        "present_share": _share(len(reasoning), len(ends)),
        "reasoning_tokens": distribution(reasoning).as_dict(),
        "answer_tokens": distribution(answer).as_dict(),
        "truncated_while_reasoning": truncated_reasoning,
        "end_tokens": _end_token_counts(s, end_names or {}),
    }


def _truncation(s: dict[str, list[Any]]) -> dict[str, Any]:
    n = len(s["finish_reason"])
    length = sum(1 for reason in s["finish_reason"] if reason == "length")
    caps = sorted({cap for cap in s["max_new_tokens"] if cap})
    at_cap = sum(1 for done, cap in zip(s["completion_tokens"], s["max_new_tokens"], strict=True)
                 if cap and done >= cap)
    return {"count": length, "share": _share(length, n), "caps": caps, "at_cap": at_cap}


def _context_budget(s: dict[str, list[Any]], context_length: int | None) -> dict[str, Any]:
    budgets = [p + cap for p, cap in zip(s["prompt_tokens"], s["max_new_tokens"], strict=True)]
    largest = max(budgets, default=None)
    near = sum(1 for b in budgets if context_length and b > 0.9 * context_length)
    return {
        "context_length": context_length,
        "max_prompt_plus_cap": largest,
        "headroom_tokens": (context_length - largest) if context_length and largest is not None else None,
        "share_over_90pct_of_context": _share(near, len(budgets)),
    }


def _stop_name(token_id: int, names: dict[str, str]) -> str:
    return f"{names[str(token_id)]} ({token_id})" if str(token_id) in names else str(token_id)


def _outcomes(ledger: DatasetSamples, n: int) -> dict[str, Any]:
    """Failures split into input-caused and given up, and completeness against the source's rows."""
    errors = sum(ledger.errors.values())
    given_up = {r: c for r, c in sorted(ledger.errors.items()) if r in RETRYABLE_REASONS}
    input_errors = errors - sum(given_up.values())
    return {
        "samples": n,
        "errors": errors,
        "input_errors": input_errors,
        "error_share": _share(input_errors, n + errors),
        "errors_by_reason": dict(sorted(ledger.errors.items())),
        "given_up": sum(given_up.values()),
        "given_up_by_reason": given_up,
        "rows": ledger.rows,
        "without_outcome": None if ledger.rows is None else max(ledger.rows - n - errors, 0),
    }


def dataset_report(ledger: DatasetSamples, context_length: int | None, reasoning_expected: bool,
                   stop_names: dict[str, str] | None = None, end_names: dict[str, str] | None = None) -> dict[str, Any]:
    s = ledger.samples
    completions = s["completion_tokens"]
    n = len(completions)
    drift = order_drift(completions, DRIFT_FIRST_N)
    return {
        **_outcomes(ledger, n),
        "completion_tokens_total": int(sum(completions)),
        "completion_tokens": distribution(completions).as_dict(),
        "length_shares": length_shares(completions),
        "finish_reasons": dict(sorted(Counter(s["finish_reason"]).items())),
        "stop_tokens": {_stop_name(k, stop_names or {}): v
                        for k, v in sorted(Counter(m for m in s["matched_stop"] if m is not None).items())},
        "truncated": _truncation(s),
        "reasoning": _reasoning(s, reasoning_expected, end_names),
        "tool_calls": {"count": sum(s["has_tool_call"]), "share": _share(sum(s["has_tool_call"]), n)},
        "prompt_tokens": distribution(s["prompt_tokens"]).as_dict(),
        "context_budget": _context_budget(s, context_length),
        "latency_s": distribution(s["latency_s"]).as_dict(),
        "order_drift": drift.as_dict() if drift else None,
    }


def _merged(datasets: Iterable[DatasetSamples]) -> DatasetSamples:
    datasets = list(datasets)
    known = [d.rows for d in datasets if d.rows is not None]
    merged = DatasetSamples("overall", rows=sum(known) if len(known) == len(datasets) else None)
    for ledger in datasets:
        for column in SAMPLE_COLUMNS:
            merged.samples[column].extend(ledger.samples[column])
        merged.errors.update(ledger.errors)
    return merged


def _finding(check: str, level: str, dataset: str | None, message: str, value: Any = None,
             threshold: Any = None) -> dict[str, Any]:
    return {"check": check, "level": level, "dataset": dataset, "value": value, "threshold": threshold,
            "message": message}


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def outcome_findings(name: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Fail while lines have no outcome (the run is not finished) or samples were given up (a server-side reason):
    a half-done run or one that wrote samples off never passes."""
    findings = []
    missing, rows = report["without_outcome"], report["rows"]
    if missing:
        findings.append(_finding(
            "complete", "fail", name,
            f"{name}: {missing} of {rows} source lines have no outcome yet ({report['samples']} samples and "
            f"{report['errors']} errors committed): the run is not finished; run it again (it resumes) or wait for "
            "its workers", missing, 0))
    if report["given_up"]:
        reasons = ", ".join(f"{r} {c}" for r, c in report["given_up_by_reason"].items())
        findings.append(_finding(
            "given_up", "fail", name,
            f"{name}: {report['given_up']} samples given up for a server-side reason ({reasons}); {RETRY_HINT}",
            report["given_up"], 0))
    return findings


def dataset_findings(name: str, report: dict[str, Any], limits: Thresholds, end_token: str | None) -> list[dict]:
    findings: list[dict[str, Any]] = outcome_findings(name, report)
    n = report["samples"]
    if n == 0:
        return [*findings, _finding("samples", "fail", name, f"{name}: no committed samples; check the errors and "
                                    "the runner's log", 0)]
    truncated = report["truncated"]["share"]
    caps = "/".join(str(c) for c in report["truncated"]["caps"])
    if truncated > limits.max_truncated_fraction:
        findings.append(_finding(
            "truncated", "warn", name,
            f"{name}: {_pct(truncated)} of samples hit maxNewTokens ({caps}), above {_pct(limits.max_truncated_fraction)}: "
            "their outputs are cut off; raise this dataset's sampling.maxNewTokens if the context allows",
            truncated, limits.max_truncated_fraction))
    reasoning = report["reasoning"]
    if reasoning["expected"]:
        share = reasoning["present_share"]
        if share < BROKEN_REASONING_SHARE:
            findings.append(_finding(
                "reasoning", "fail", name,
                f"{name}: the end-of-reasoning token {end_token!r} is in only {_pct(share)} of outputs: reasoning is "
                "missing or mis-delimited. Likely causes: a reasoning parser or a chat API stripped the reasoning "
                "tokens before they were recorded, or spec.model.reasoning.endToken is not this tokenizer's "
                "end-of-reasoning token", share, limits.min_reasoning_fraction))
        elif share < limits.min_reasoning_fraction:
            findings.append(_finding(
                "reasoning", "warn", name,
                f"{name}: only {_pct(share)} of outputs contain {end_token!r} (minimum {_pct(limits.min_reasoning_fraction)});"
                f" {reasoning['truncated_while_reasoning']} were truncated while still reasoning — inspect samples "
                "without it (tokenmill inspect --dataset ... --shortest N)", share, limits.min_reasoning_fraction))
    error_share = report["error_share"]
    if error_share > limits.max_error_fraction:
        caused_by_input = Counter({r: c for r, c in report["errors_by_reason"].items() if r not in RETRYABLE_REASONS})
        top = ", ".join(f"{r} {c}" for r, c in caused_by_input.most_common(3))
        findings.append(_finding(
            "errors", "fail", name,
            f"{name}: {_pct(error_share)} of samples failed because of their input ({top}), above "
            f"{_pct(limits.max_error_fraction)}; see {name}/errors/ for each line and reason", error_share,
            limits.max_error_fraction))
    if report["errors_by_reason"].get("output_mismatch"):
        findings.append(_finding(
            "output_ids", "fail", name,
            f"{name}: the server returned output_ids that do not match completion_tokens; SGLang v0.5.0-v0.5.4.post2 "
            "prepends prompt tokens: use v0.5.5 or newer", report["errors_by_reason"]["output_mismatch"]))
    drift = report["order_drift"]
    if drift and drift["significant"]:
        findings.append(_finding(
            "order_drift", "warn", name,
            f"{name}: the first {drift['first_n']} committed samples average {drift['first_mean']:.0f} tokens "
            f"(median {drift['first_median']:.0f}) but the rest average {drift['rest_mean']:.0f} (median "
            f"{drift['rest_median']:.0f}), beyond chance (p={drift['p_value']:.1e}): short outputs finish first, "
            "so judge a run by its whole distribution, not its first samples", drift["p_value"], 0.001))
    if not findings:
        findings.append(_finding("all", "pass", name, f"{name}: {n} samples, all checks passed"))
    return findings


def build_report(ledger: Ledger, now: datetime | None = None) -> dict[str, Any]:
    run = ledger.run
    context_length = run.get("context_length")
    tokenizer = run.get("tokenizer") or {}
    end_token = tokenizer.get("reasoning_end_token")
    expected = tokenizer.get("reasoning_end_id") is not None
    limits = Thresholds.from_run(run)
    names = tokenizer.get("eos_tokens") or {}
    end_names = tokenizer.get("reasoning_end_tokens") or {}
    if end_token is not None and len(end_names) > 1:
        end_token = " or ".join(end_names.values())
    datasets = {d.name: dataset_report(d, context_length, expected, names, end_names) for d in ledger.datasets}
    findings = [f for name, rep in datasets.items() for f in dataset_findings(name, rep, limits, end_token)]
    verdict = max((f["level"] for f in findings), key=LEVELS.index, default="fail")
    return {
        "schema": SCHEMA,
        "generated_at": (now or datetime.now(UTC)).isoformat(),
        "output_uri": ledger.output_uri,
        "name": run.get("name"),
        "tokenizer": tokenizer,
        "context_length": context_length,
        "thresholds": limits.__dict__,
        "verdict": verdict,
        "findings": findings,
        # Drift is about commit order within one dataset; a concatenation of datasets has no such order.
        "overall": {**dataset_report(_merged(ledger.datasets), context_length, expected, names, end_names),
                    "order_drift": None},
        "datasets": datasets,
    }
