"""The validation report: what was generated, in tokens, per dataset, computed from the commit markers.

Pure: what `report_stream.DatasetSamples` accumulated from the markers in, a report dict out (every figure exact;
latency quantiles within 0.5 % above a million samples, see `histograms.py`). Reading the markers and writing the
files is `files.py`.
The report's JSON schema is `tokenmill.report/v1` (documented in docs/report.md); bump it on breaking changes.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..generate.summary import RETRY_HINT
from ..stats.distributions import OVER, UNDER, DriftResult
from ..stats.histograms import IntHistogram, mann_whitney_histograms
from ..store.ledger import RETRYABLE_REASONS, Completeness
from .stream import DRIFT_FIRST_N, SAMPLE_COLUMNS, DatasetSamples

logger = logging.getLogger(__name__)

__all__ = ["DRIFT_FIRST_N", "SAMPLE_COLUMNS", "DatasetSamples", "Ledger", "Thresholds", "build_report",
           "dataset_report"]

SCHEMA = "tokenmill.report/v1"
LEVELS = ("pass", "warn", "fail")
# Reasoning "absent from (almost) every sample": below this share the run is broken, not just thin.
BROKEN_REASONING_SHARE = 0.05
DRIFT_MIN_REST = 20
DRIFT_ALPHA = 0.001


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


def _end_token_counts(d: DatasetSamples, names: dict[str, str]) -> dict[str, int]:
    """Samples per token that ended their reasoning (e.g. </think> vs Kimi's tool-call section opener)."""
    return {(_stop_name(token, names) if token is not None else "unrecorded"): count
            for token, count in sorted(d.end_tokens.items(), key=lambda item: -item[1])}


def _reasoning(d: DatasetSamples, expected: bool, end_names: dict[str, str] | None = None) -> dict[str, Any]:
    present = d.with_reasoning  # conversations: every turn that holds the token
    return {
        "expected": expected,
        "present": present,
        "present_share": _share(d.with_reasoning, d.generations),
        "reasoning_tokens": d.reasoning.distribution().as_dict(),
        "answer_tokens": d.answers.distribution().as_dict(),
        "truncated_while_reasoning": d.truncated_while_reasoning,
        "end_tokens": _end_token_counts(d, end_names or {}),
    }


def _truncation(d: DatasetSamples) -> dict[str, Any]:
    length = d.finish_reasons.get("length", 0)
    # Of generations: a conversation's turns are generations each (only its last can be cut: that stops it).
    return {"count": length, "share": _share(length, d.generations), "caps": sorted(d.caps), "at_cap": d.at_cap}


def _context_budget(d: DatasetSamples, context_length: int | None) -> dict[str, Any]:
    largest = d.budgets.max
    # Budgets are integers: b > 0.9 * context_length exactly when b > floor(0.9 * context_length).
    near = d.budgets.above(math.floor(0.9 * context_length)) if context_length and d.budgets.count else 0
    return {
        "context_length": context_length,
        "max_prompt_plus_cap": largest,
        "headroom_tokens": (context_length - largest) if context_length and largest is not None else None,
        "share_over_90pct_of_context": _share(near, d.budgets.count),
    }


def _stop_name(token_id: int, names: dict[str, str]) -> str:
    return f"{names[str(token_id)]} ({token_id})" if str(token_id) in names else str(token_id)


def _length_shares(completions: IntHistogram) -> dict[str, float | None]:
    """Share of samples under 100/300/500 tokens and over 1000/5000 tokens (strict inequalities)."""
    n = completions.count
    shares = {f"under_{t}": _share(completions.below(t), n) for t in UNDER}
    shares.update({f"over_{t}": _share(completions.above(t), n) for t in OVER})
    return shares


def order_drift(d: DatasetSamples) -> DriftResult | None:
    """Do the first committed samples differ from the rest beyond chance? None when there are too few. The first
    DRIFT_FIRST_N are kept in commit order; the rest is the whole histogram minus them."""
    if d.samples < DRIFT_FIRST_N + DRIFT_MIN_REST:
        return None
    first = IntHistogram.of(d.first_completions)
    rest = d.completions.minus(first)
    z, p = mann_whitney_histograms(first, rest)
    return DriftResult(
        first_n=first.count, first_mean=float(first.mean() or 0.0), first_median=float(first.median() or 0.0),
        rest_n=rest.count, rest_mean=float(rest.mean() or 0.0), rest_median=float(rest.median() or 0.0),
        z=z, p_value=p, significant=p < DRIFT_ALPHA,
    )


def _outcomes(ledger: DatasetSamples, n: int, layout: list[Completeness] | None) -> dict[str, Any]:
    """Failures split into input-caused and given up, and completeness by slot against the current layout (slots
    of an earlier, larger layout are counted apart, as `outside_layout`, never as the layout's outcomes)."""
    failures = Counter(ledger.errors)
    if layout is not None:
        failures = Counter()
        for part in layout:
            failures.update(part.failures)
    errors = failures.total()
    given_up = {r: c for r, c in sorted(failures.items()) if r in RETRYABLE_REASONS}
    input_errors = errors - sum(given_up.values())
    return {
        "samples": n,
        "errors": errors,
        "input_errors": input_errors,
        "error_share": _share(input_errors, n + errors),
        "errors_by_reason": dict(sorted(failures.items())),
        "given_up": sum(given_up.values()),
        "given_up_by_reason": given_up,
        "slots": None if layout is None else sum(part.slots for part in layout),
        "without_outcome": None if layout is None else sum(part.missing for part in layout),
        "missing_by_sample_index": (list(layout[0].missing_by_index) if layout is not None and len(layout) == 1
                                    else None),
        "outside_layout": None if layout is None else sum(part.outside for part in layout),
        "skipped_lines": None if layout is None else sum(part.skipped for part in layout),
        "layout_missing": ledger.no_layout,
        "duplicate_rows": ledger.duplicate_rows,
        "dangling_markers": ledger.dangling_markers,
        "dangling_files": list(ledger.dangling),
    }


def dataset_report(ledger: DatasetSamples, context_length: int | None, reasoning_expected: bool,
                   stop_names: dict[str, str] | None = None, end_names: dict[str, str] | None = None,
                   drift: bool = True, layout: list[Completeness] | None = None) -> dict[str, Any]:
    n = ledger.samples
    result = order_drift(ledger) if drift else None
    if layout is None and (own := ledger.completeness()) is not None:
        layout = [own]
    return {
        **_outcomes(ledger, n, layout),
        "completion_tokens_total": ledger.completions.total,
        "completion_tokens": ledger.completions.distribution().as_dict(),
        "length_shares": _length_shares(ledger.completions),
        "finish_reasons": dict(sorted(ledger.finish_reasons.items())),
        "stop_tokens": {_stop_name(k, stop_names or {}): v for k, v in sorted(ledger.stop_tokens.items())},
        "truncated": _truncation(ledger),
        "reasoning": _reasoning(ledger, reasoning_expected, end_names),
        "tool_calls": {"count": ledger.tool_calls, "share": _share(ledger.tool_calls, n)},
        "conversations": _conversations(ledger),
        "prefix_cache": _prefix_cache(ledger),
        "reasoning_tokens_disagree": ledger.reasoning_disagreements,
        "prompt_tokens": ledger.prompts.distribution().as_dict(),
        "context_budget": _context_budget(ledger, context_length),
        "latency_s": ledger.latency.distribution().as_dict(),
        "order_drift": result.as_dict() if result else None,
    }


def _prefix_cache(ledger: DatasetSamples) -> dict[str, Any]:
    """How much of the prompt tokens sent SGLang found in its prefix cache (meta_info.cached_tokens): the samples
    of a prompt and the turns of a conversation share a prefix, which prefix-affine routing keeps on one replica.
    `share` is None when no marker records it (runs before tokenmill recorded cached_tokens)."""
    return {"cached_tokens": ledger.cached_tokens, "prompt_tokens_sent": ledger.sent_tokens,
            "share": _share(ledger.cached_tokens, ledger.sent_tokens), "samples": ledger.cache_rows}


def _conversations(ledger: DatasetSamples) -> dict[str, Any] | None:
    """Multi-turn rows (mode all-turns): how many, their turns, why they ended; None for a dataset without."""
    if not ledger.turns.count:
        return None
    return {"count": ledger.turns.count, "turns": ledger.turns.distribution().as_dict(),
            "turns_total": ledger.turns.total, "stop_reasons": dict(sorted(ledger.stop_reasons.items()))}


def _merged(datasets: Iterable[DatasetSamples]) -> DatasetSamples:
    merged = DatasetSamples("overall")
    for ledger in datasets:
        merged.merge(ledger)
    return merged


def _layouts(datasets: list[DatasetSamples]) -> list[Completeness] | None:
    """Every dataset's completeness, or None when one of them has no known layout."""
    parts = [d.completeness() for d in datasets]
    return None if any(part is None for part in parts) else [part for part in parts if part is not None]


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
    missing, slots = report["without_outcome"], report["slots"]
    if report.get("layout_missing") and report["samples"] + report["errors"]:
        findings.append(_finding(
            "complete", "fail", name,
            f"{name}: {report['layout_missing']}, so whether every slot has an outcome cannot be told "
            f"({report['samples'] + report['errors']} outcomes are committed): start worker 0 (it records the layout "
            "and resumes), or rerun with one worker", None, None))
    if report.get("dangling_markers"):
        named = ", ".join(report["dangling_files"])
        findings.append(_finding(
            "dangling", "fail", name,
            f"{name}: {report['dangling_markers']} commit markers name files that do not exist ({named}): their "
            "samples are counted but cannot be exported (two writers on one output, or files removed by hand). "
            f"Remove those markers from {name}/commits/ and run again: their slots are generated again",
            report["dangling_markers"], 0))
    if report.get("duplicate_rows"):
        findings.append(_finding(
            "duplicates", "warn", name,
            f"{name}: {report['duplicate_rows']} rows were committed for slots that already had one (two writers "
            "on one output): each slot counts once, and export keeps its first row", report["duplicate_rows"], 0))
    if missing:
        by_index = report.get("missing_by_sample_index") or []
        lacking = ", ".join(f"{count} lines lack sample {index}" for index, count in enumerate(by_index) if count)
        findings.append(_finding(
            "complete", "fail", name,
            f"{name}: {missing} of {slots} slots of the current layout have no outcome"
            f"{f' ({lacking})' if lacking else ''}: the run is not finished; run it again (it resumes) or wait for "
            "its workers", missing, 0))
    if report["given_up"]:
        reasons = ", ".join(f"{r} {c}" for r, c in report["given_up_by_reason"].items())
        findings.append(_finding(
            "given_up", "fail", name,
            f"{name}: {report['given_up']} samples given up for a server-side reason ({reasons}); {RETRY_HINT}",
            report["given_up"], 0))
    return findings


def dataset_findings(name: str, report: dict[str, Any], limits: Thresholds, end_token: str | None) -> list[dict[str, Any]]:
    findings: list[dict[str, Any]] = outcome_findings(name, report)
    # Before the sample checks: a run whose every answer came from other ids has no samples at all.
    if report["errors_by_reason"].get("input_mismatch"):
        findings.append(_finding(
            "input_ids", "fail", name,
            f"{name}: the server generated from other prompt ids than were sent (its echoed prompt_token_ids "
            "differ): something between tokenmill and SGLang re-encodes the prompt, so those answers belong to "
            f"other prompts; send input_ids to SGLang unchanged, then --retry-failed (see {name}/errors/)",
            report["errors_by_reason"]["input_mismatch"]))
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
    if report.get("reasoning_tokens_disagree"):
        findings.append(_finding(
            "reasoning_tokens", "warn", name,
            f"{name}: in {report['reasoning_tokens_disagree']} generations SGLang's meta_info.reasoning_tokens "
            "is not the count through the first spec.model.reasoning end token (all of the output when it never "
            "comes), which is how SGLang counts: the server's --reasoning-parser counts to another end token than "
            "the spec names (a parser for another model family?), or the spec names a token this model does not "
            "end reasoning with; compare the two (tokenmill inspect --sample ID shows both counts)",
            report["reasoning_tokens_disagree"]))
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
        "overall": dataset_report(_merged(ledger.datasets), context_length, expected, names, end_names, drift=False,
                                  layout=_layouts(ledger.datasets)),
        "datasets": datasets,
    }
