"""report.json → Markdown tables a person reads in a terminal or a pull request. Pure."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

MARKS = {"pass": "PASS", "warn": "WARN", "fail": "FAIL"}


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _per_dataset(report: dict[str, Any], row: Callable[[dict[str, Any]], list[str]],
                 overall: bool = True) -> Iterable[list[str]]:
    for name, data in report["datasets"].items():
        yield [name, *row(data)]
    if overall and len(report["datasets"]) > 1:
        yield ["**overall**", *row(report["overall"])]


def _dist_row(d: dict[str, Any]) -> list[str]:
    return [str(d["count"]), *(_num(d[k]) for k in ("mean", "median", "stdev", "p10", "p25", "p75", "p90", "p95",
                                                    "p99", "max"))]


def completion_table(report: dict[str, Any]) -> list[str]:
    header = ["dataset", "n", "mean", "median", "stdev", "p10", "p25", "p75", "p90", "p95", "p99", "max"]
    return table(header, _per_dataset(report, lambda d: _dist_row(d["completion_tokens"])))


def findings_lines(report: dict[str, Any]) -> list[str]:
    return [f"- **{MARKS[f['level']]}** {f['message']}" for f in report["findings"]] + [""]


def _shares_row(d: dict[str, Any]) -> list[str]:
    shares, truncated = d["length_shares"], d["truncated"]
    caps = "/".join(str(c) for c in truncated["caps"]) or "-"
    return [_pct(shares[k]) for k in ("under_100", "under_300", "under_500", "over_1000", "over_5000")] + [
        _pct(truncated["share"]), f"{truncated['at_cap']} at {caps}"]


def _finish_row(d: dict[str, Any]) -> list[str]:
    reasons = d["finish_reasons"]
    stops = ", ".join(f"{token} ×{count}" for token, count in d["stop_tokens"].items()) or "-"
    return [str(reasons.get(k, 0)) for k in ("stop", "length", "abort")] + [stops]


def _reasoning_row(d: dict[str, Any]) -> list[str]:
    r = d["reasoning"]
    return [_pct(r["present_share"]), _num(r["reasoning_tokens"]["median"]), _num(r["reasoning_tokens"]["p90"]),
            _num(r["answer_tokens"]["median"]), _num(r["answer_tokens"]["p90"]), str(r["truncated_while_reasoning"]),
            _pct(d["tool_calls"]["share"]),
            ", ".join(f"{token} ×{count}" for token, count in r.get("end_tokens", {}).items()) or "-"]


def _end_tokens_title(tokenizer: dict[str, Any]) -> str:
    names = list((tokenizer.get("reasoning_end_tokens") or {}).values())
    return " or ".join(names) if names else str(tokenizer.get("reasoning_end_token"))


def _prompt_row(d: dict[str, Any]) -> list[str]:
    p, budget = d["prompt_tokens"], d["context_budget"]
    return [_num(p["median"]), _num(p["p99"]), _num(p["max"]), _num(budget["max_prompt_plus_cap"]),
            _num(budget["context_length"]), _num(budget["headroom_tokens"])]


def _cache_row(d: dict[str, Any]) -> list[str]:
    cache = d.get("prefix_cache") or {}
    return [_pct(cache.get("share")), _num(cache.get("cached_tokens")), _num(cache.get("prompt_tokens_sent")),
            str(d.get("reasoning_tokens_disagree", 0))]


def _drift_rows(report: dict[str, Any]) -> Iterable[list[str]]:
    for name, data in report["datasets"].items():
        drift = data["order_drift"]
        if drift is None:
            yield [name, "-", "-", "-", f"too few samples ({data['samples']})"]
            continue
        verdict = "yes, beyond chance" if drift["significant"] else "no"
        yield [name, f"{drift['first_mean']:.0f} / {drift['first_median']:.0f} (first {drift['first_n']})",
               f"{drift['rest_mean']:.0f} / {drift['rest_median']:.0f} ({drift['rest_n']})",
               f"{drift['p_value']:.1e}", verdict]


def _error_rows(report: dict[str, Any]) -> Iterable[list[str]]:
    for name, data in report["datasets"].items():
        for reason, count in data["errors_by_reason"].items():
            yield [name, reason, str(count)]


def _conversation_rows(report: dict[str, Any]) -> Iterable[list[str]]:
    for name, data in report["datasets"].items():
        found = data.get("conversations")
        if found:
            ended = ", ".join(f"{reason} {count}" for reason, count in found["stop_reasons"].items())
            yield [name, str(found["count"]), str(found["turns_total"]), _num(found["turns"]["mean"], 1),
                   _num(found["turns"]["max"]), ended]


def vocabulary_lines(report: dict[str, Any]) -> list[str]:
    section = report.get("vocabulary")
    if not section:
        return []
    sizes = [str(size) for size in section["sizes"]]
    shares = list(section["mix"]["ids_for_share"])

    def row(d: dict[str, Any]) -> list[str]:
        return [_num(d["loss_tokens"]), _num(d["distinct_ids"]), *(_pct(d["coverage"][k]) for k in sizes),
                *(_num(d["ids_for_share"][k]) for k in shares)]

    rows = [[name, *row(d)] for name, d in section["datasets"].items()]
    if len(rows) > 1:
        rows.append(["**mix**", *row(section["mix"])])
    missing = {name: d["shards_not_counted"] for name, d in section["datasets"].items()
               if d.get("shards_not_counted")}
    note = ([f"Not counted: {', '.join(f'{name} {n} shards' for name, n in missing.items())} (a slot committed "
             "twice, or markers older than the counts): `tokenmill report URI` recounts them from their rows.", ""]
            if missing else [])
    return ["## Draft vocabulary coverage", "",
            "Share of the loss tokens (every generated id, the stop token included) that the K most frequent ids "
            "cover: the ceiling a draft vocabulary of K ids puts on acceptance. `tokenmill export --format vocab` "
            "writes the maps.", "",
            *table(["dataset", "loss tokens", "distinct ids", *(f"top {int(k):,}" for k in sizes),
                    *(f"ids for {float(share):.1%}" for share in shares)], rows), *note]


def mix_lines(report: dict[str, Any]) -> list[str]:
    section = report.get("mix")
    if not section:
        return []
    duplicates = (section.get("duplicates") or {}).get("datasets", {})
    overlap = (section.get("eval_overlap") or {}).get("datasets", {})
    rows = []
    for name, share in section["shares"].items():
        dup, hit = duplicates.get(name), overlap.get(name)
        shared = ", ".join(f"{other} {n}" for other, n in dup["shared_with"].items()) if dup else "-"
        rows.append([name, str(share["samples"]), _pct(share["sample_share"]), _num(share["loss_tokens"]),
                     _pct(share["loss_token_share"]), str(dup["repeated_within"]) if dup else "-", shared or "0",
                     f"{hit['overlapping']} ({_pct(hit['share'])})" if hit else "-"])
    lines = ["## Mix", "",
             *table(["dataset", "samples", "share", "loss tokens", "share", "repeated prompts", "shared with",
                     "overlapping eval"], rows)]
    if "duplicates" not in section:
        lines += ["Duplicates and evaluation overlap: `tokenmill report URI --mix [--eval FILE.jsonl]` reads the "
                  "prompt sources.", ""]
    elif "eval_overlap" in section:
        files = section["eval_overlap"]["eval_files"]
        lines += [f"Evaluation overlap: runs of {section['eval_overlap']['ngram']} words; "
                  + ", ".join(f"{file}: {v['overlapped']} of {v['prompts']} prompts overlapped"
                              for file, v in files.items()) + ".", ""]
    return lines


def render(report: dict[str, Any], images: list[str]) -> str:
    lines = [f"# tokenmill report: {report.get('name') or report['output_uri']}", "",
             f"Verdict: **{MARKS[report['verdict']]}** · output `{report['output_uri']}` · "
             f"context length {report['context_length']} · generated {report['generated_at']}", "",
             "## Findings", "", *findings_lines(report),
             "## Completion length (tokens)", "", *completion_table(report),
             "## Length shares", "",
             *table(["dataset", "<100", "<300", "<500", ">1000", ">5000", "hit maxNewTokens", "at cap"],
                    _per_dataset(report, _shares_row)),
             "## Finish reasons", "",
             *table(["dataset", "stop", "length", "abort", "stop tokens matched"],
                    _per_dataset(report, _finish_row)),
             f"## Reasoning ({_end_tokens_title(report['tokenizer'])}) and tool calls", "",
             *table(["dataset", "with end token", "reasoning median", "reasoning p90", "answer median", "answer p90",
                     "truncated while reasoning", "tool calls", "ended by"], _per_dataset(report, _reasoning_row)),
             "## Prompts and context budget", "",
             *table(["dataset", "prompt median", "prompt p99", "prompt max", "max prompt + cap", "context",
                     "headroom"], _per_dataset(report, _prompt_row)),
             "## Prefix cache and SGLang's accounting", "",
             "Share of the prompt tokens sent that SGLang found in its prefix cache (meta_info.cached_tokens), and "
             "the generations whose meta_info.reasoning_tokens disagrees with the recorded reasoning end.", "",
             *table(["dataset", "prefix-cache share", "cached tokens", "prompt tokens sent",
                     "reasoning_tokens disagree"], _per_dataset(report, _cache_row)),
             "## Order drift (completion tokens, mean / median)", "",
             *table(["dataset", "first committed", "rest", "p-value", "differs"], _drift_rows(report))]
    conversations = list(_conversation_rows(report))
    if conversations:
        lines += ["## Conversations (mode all-turns)", "",
                  "Completion lengths above are per conversation (every turn); the finish, reasoning and cap "
                  "figures describe each conversation's last turn.", "",
                  *table(["dataset", "conversations", "turns", "turns mean", "turns max", "ended by"], conversations)]
    lines += vocabulary_lines(report) + mix_lines(report)
    errors = list(_error_rows(report))
    lines += ["## Errors", ""] + (table(["dataset", "reason", "count"], errors) if errors else ["none", ""])
    if images:
        lines += ["## Plots", ""] + [f"![{image}]({image})" for image in images] + [""]
    return "\n".join(lines)


def summary(report: dict[str, Any]) -> str:
    """What `tokenmill report` and `make demo` print: the verdict, the findings, the length table."""
    lines = [f"Report verdict: {MARKS[report['verdict']]}", *findings_lines(report), *completion_table(report)]
    return "\n".join(lines)
