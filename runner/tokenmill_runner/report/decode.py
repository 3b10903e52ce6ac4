"""`tokenmill inspect`: decode committed samples into their parts with the run's own tokenizer.

Prompt parts come from splitting `prompt_ids` at end-of-turn tokens and reading each turn's role header; output
parts from the recorded `reasoning_end` index, the tool-call opener and the stop token. Splitting is pure; reading
shards and loading the tokenizer are at the edge (`select_rows`, `load_run_tokenizer`).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

import orjson

from ..render.pretokenize import flag_allows_remote_code, load_tokenizer, local_model_folder
from ..store.markers import markers_in_commit_order
from ..store.shards import read_shard
from ..store.storage import Storage
from .files import require_manifest

ROLE_LABELS = {"tool_declare": "tools", "system": "system", "user": "user", "assistant": "assistant",
               "tool": "tool result"}


@dataclass(frozen=True)
class Part:
    name: str
    start: int  # index of the part's first token in prompt_ids or output_ids
    ids: list[int]

    def as_dict(self, tokenizer: Any) -> dict[str, Any]:
        return {**asdict(self), "tokens": len(self.ids), "text": tokenizer.decode(self.ids, skip_special_tokens=False)}


def _turn_label(tokenizer: Any, ids: list[int], special: set[int]) -> tuple[str, int]:
    """(role label, index where the turn's content starts) from a turn's header, e.g. <|im_user|>user<|im_middle|>."""
    first = next((i for i, t in enumerate(ids) if t not in special), None)
    if first is None:
        return "special", 0
    header_end = next((i for i in range(first, len(ids)) if ids[i] in special), None)
    if header_end is None:
        text = tokenizer.decode(ids[first:], skip_special_tokens=False)
        header = text.split("\n", 1)[0].strip()
        return ROLE_LABELS.get(header, header or "text"), first
    header = tokenizer.decode(ids[first:header_end], skip_special_tokens=False).strip()
    return ROLE_LABELS.get(header, header or "text"), header_end + 1


def prompt_parts(tokenizer: Any, prompt_ids: list[int], end_of_turn: set[int]) -> list[Part]:
    special = set(tokenizer.all_special_ids)
    parts, start = [], 0
    for index, token in enumerate(prompt_ids + [None]):
        if token is None or token in end_of_turn:
            turn = prompt_ids[start:index]
            if turn:
                label, content = _turn_label(tokenizer, turn, special)
                name = label if token is not None else "generation prompt"
                body = turn if token is None else turn[content:]
                parts.append(Part(name, start + (0 if token is None else content), body))
            start = index + 1
    return parts


def output_parts(row: dict[str, Any], tool_call_id: int | None) -> list[Part]:
    output = row["output_ids"]
    stop = row["finish_reason"] == "stop" and row["matched_stop"] is not None and output[-1:] == [row["matched_stop"]]
    body_end = len(output) - 1 if stop else len(output)
    end = row["reasoning_end"]
    parts: list[Part] = []
    if end is None:
        label = "reasoning (truncated, no end token)" if row["finish_reason"] == "length" else "output (no end token)"
        if body_end:
            parts.append(Part(label, 0, output[:body_end]))
        rest_start = body_end
    elif tool_call_id is not None and row.get("reasoning_end_token_id") == tool_call_id:
        # Reasoning ended by opening the tool-call section without </think> (Kimi-K2.5): the opener belongs to
        # the tool calls, not to an end-of-reasoning part.
        parts.append(Part("reasoning (ended by a tool call)", 0, output[:end]))
        rest_start = end
    else:
        parts.append(Part("reasoning", 0, output[:end]))
        parts.append(Part("end of reasoning", end, output[end:end + 1]))
        rest_start = end + 1
    if rest_start < body_end:
        rest = output[rest_start:body_end]
        call = rest.index(tool_call_id) if tool_call_id is not None and tool_call_id in rest else None
        if call is None:
            parts.append(Part("answer", rest_start, rest))
        else:
            if call:
                parts.append(Part("answer", rest_start, rest[:call]))
            parts.append(Part("tool calls", rest_start + call, rest[call:]))
    if stop:
        parts.append(Part("stop token", body_end, output[body_end:]))
    return parts


def _elide(tokenizer: Any, ids: list[int], keep: int) -> str:
    if len(ids) <= 2 * keep + 20:
        return tokenizer.decode(ids, skip_special_tokens=False)
    head = tokenizer.decode(ids[:keep], skip_special_tokens=False)
    tail = tokenizer.decode(ids[-keep:], skip_special_tokens=False)
    return f"{head}\n      … [{len(ids) - 2 * keep} tokens hidden] …\n{tail}"


def _nth(row: dict[str, Any]) -> str:
    """Which sample of its prompt a row is, with its seed, when the dataset has several (spec samples)."""
    index = row.get("sample_index") or 0
    if not index and row.get("seed") is None:
        return ""
    return f", sample index {index}" + (f", seed {row['seed']}" if row.get("seed") is not None else "")


def _server_line(row: dict[str, Any]) -> str:
    """SGLang's own accounting of the generation: prompt tokens it found cached, its reasoning count ("-": not
    recorded, a shard from before these columns or a release that reports none)."""
    cached, counted, agrees = row.get("cached_tokens"), row.get("server_reasoning_tokens"), row.get("reasoning_agrees")
    verdict = "" if agrees is None else (" (agrees)" if agrees else " (DISAGREES with reasoning_end)")
    return (f"cached_tokens: {'-' if cached is None else cached} of {row['prompt_tokens']} prompt tokens · "
            f"SGLang reasoning_tokens: {'-' if counted is None else counted}{verdict} · reasoning_end: "
            f"{'-' if row.get('reasoning_end') is None else row['reasoning_end']}")


def render_sample(tokenizer: Any, row: dict[str, Any], prompt: list[Part], output: list[Part],
                  keep: int = 120) -> str:
    stop = f" ({tokenizer.decode([row['matched_stop']], skip_special_tokens=False)})" if row["matched_stop"] is not None else ""
    lines = [
        f"══ {row['dataset']} · sample {row['sample_id']} (line {row['line']}{_nth(row)}) ══",
        f"finish: {row['finish_reason']}{stop} · prompt {row['prompt_tokens']} tokens · completion "
        f"{row['completion_tokens']} tokens (max {row['max_new_tokens']}) · latency {row['latency_s']:.1f}s",
    ]
    lines.append(_server_line(row))
    if "history_exact" in row:
        lines.append(f"history exact: {row['history_exact']} · tool calls: {row.get('tool_calls') or '-'}")
    for title, parts in (("PROMPT", prompt), ("OUTPUT", output)):
        lines.append(f"┌─ {title}")
        for part in parts:
            lines.append(f"├── {part.name} · {len(part.ids)} tokens · at {part.start}")
            lines += ["│   " + text for text in _elide(tokenizer, part.ids, keep).splitlines() or [""]]
    return "\n".join(lines)


def sample_json(tokenizer: Any, row: dict[str, Any], prompt: list[Part], output: list[Part]) -> dict[str, Any]:
    return {
        "dataset": row["dataset"], "sample_id": row["sample_id"], "line": row["line"],
        "finish_reason": row["finish_reason"], "matched_stop": row["matched_stop"],
        "prompt_tokens": row["prompt_tokens"], "completion_tokens": row["completion_tokens"],
        "max_new_tokens": row["max_new_tokens"], "reasoning_end": row["reasoning_end"],
        "reasoning_end_token_id": row.get("reasoning_end_token_id"),
        "has_tool_call": row["has_tool_call"],
        "cached_tokens": row.get("cached_tokens"), "server_reasoning_tokens": row.get("server_reasoning_tokens"),
        "reasoning_agrees": row.get("reasoning_agrees"),
        **({"history_exact": row["history_exact"], "tool_calls": row.get("tool_calls")} if "history_exact" in row
           else {}),
        "prompt": [p.as_dict(tokenizer) for p in prompt], "output": [p.as_dict(tokenizer) for p in output],
    }


@dataclass(frozen=True)
class Selection:
    sample_id: str | None = None
    shortest: int | None = None
    longest: int | None = None
    random: int | None = None
    seed: int = 0


# A committed sample as the selection sees it: (dataset, its shard's key under the dataset, its row in the shard).
Candidate = tuple[str, str, int]
# Rows `--sample ID` shows at most (an id repeats once per sample of its prompt, and in markers written twice).
MAX_MATCHES = 1024


def _candidates(storage: Storage, datasets: list[str]) -> Iterator[tuple[Candidate, str, int]]:
    """(candidate, sample id, completion tokens) of every committed sample, streamed from the markers in commit
    order (a window of markers in memory, never all of them)."""
    for dataset in datasets:
        for marker in markers_in_commit_order(storage, dataset):
            samples = marker["samples"]
            for position, (sample_id, tokens) in enumerate(zip(samples["sample_id"], samples["completion_tokens"],
                                                              strict=True)):
                yield (dataset, str(marker["data"]), position), sample_id, tokens


def choose(storage: Storage, datasets: list[str], selection: Selection) -> list[Candidate]:
    """The samples a selection picks, holding only those (a heap for the shortest and longest, two passes for a
    seeded random draw, which picks what `random.Random(seed).sample` of the whole list would)."""
    stream = _candidates(storage, datasets)
    if selection.sample_id is not None:
        return list(islice((c for c, sample_id, _ in stream if sample_id == selection.sample_id), MAX_MATCHES))
    if selection.shortest:
        return [c for c, _, _ in heapq.nsmallest(selection.shortest, stream, key=lambda item: item[2])]
    if selection.longest:
        return [c for c, _, _ in heapq.nlargest(selection.longest, stream, key=lambda item: item[2])]
    total = sum(1 for _ in stream)
    picked = random.Random(selection.seed).sample(range(total), min(selection.random or 1, total))
    order = {index: rank for rank, index in enumerate(picked)}
    chosen: list[Candidate | None] = [None] * len(picked)
    for index, (candidate, _, _) in enumerate(_candidates(storage, datasets)):
        if index in order:
            chosen[order[index]] = candidate
    return [c for c in chosen if c is not None]


def select_rows(storage: Storage, datasets: list[str], selection: Selection) -> list[dict[str, Any]]:
    """Pick samples from the markers, then read only the shards that hold them, keeping only the rows picked."""
    chosen = choose(storage, datasets, selection)
    wanted: dict[tuple[str, str], set[int]] = {}
    for dataset, data, position in chosen:
        wanted.setdefault((dataset, data), set()).add(position)
    found: dict[Candidate, dict[str, Any]] = {}
    for (dataset, data), positions in wanted.items():
        for position, row in enumerate(read_shard(storage, f"{dataset}/{data}")):
            if position in positions:
                found[(dataset, data, position)] = row
    return [found[c] for c in chosen if c in found]


def turn_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A single-turn row as is; a conversation (mode all-turns) as one row per turn, named `<id> turn k/n`, with
    whether its prompt extends the previous turn's ids and the calls parsed from it."""
    turns = row.get("turns")
    if not turns:
        return [row]
    return [{**row, **turn, "sample_id": f"{row['sample_id']} turn {index}/{len(turns)}"}
            for index, turn in enumerate(turns)]


class NothingToInspect(LookupError):
    """No committed sample matches the selection."""


def inspect_samples(storage: Storage, selection: Selection, datasets: list[str] | None = None, *,
                    as_json: bool = False, keep: int = 120, tokenizer_folder: str | None = None,
                    endpoint: str | None = None, trust_remote_code: bool = False) -> str:
    """Decode the selected samples of a run with the tokenizer recorded in its run.json; its own code runs only
    with `trust_remote_code` (the command's flag, never run.json's)."""
    recorded = require_manifest(storage)
    run = recorded.model_dump(mode="json", exclude_none=True)
    names = datasets or recorded.dataset_names
    rows = select_rows(storage, names, selection)
    if not rows:
        raise NothingToInspect(f"no committed sample matches in {', '.join(names)} under {storage.root_uri}")
    info = run["tokenizer"]
    folder = tokenizer_folder or local_model_folder(info["location"], endpoint)
    tokenizer = load_tokenizer(folder, trust_remote_code, flag_allows_remote_code(tokenizer_folder or info["location"]))
    end_of_turn = set(info["eos_token_ids"])
    as_objects: list[dict[str, Any]] = []
    as_text: list[str] = []
    for row in rows:
        parts = [(turn, prompt_parts(tokenizer, turn["prompt_ids"], end_of_turn),
                  output_parts(turn, info["tool_call_id"])) for turn in turn_rows(row)]
        if as_json:
            objects = [sample_json(tokenizer, turn, prompt, output) for turn, prompt, output in parts]
            as_objects += objects if not row.get("turns") else [{
                "dataset": row["dataset"], "sample_id": row["sample_id"], "line": row["line"],
                "stop_reason": row["stop_reason"], "stop_detail": row.get("stop_detail"), "turns": objects}]
            continue
        texts = [render_sample(tokenizer, turn, prompt, output, keep) for turn, prompt, output in parts]
        if not row.get("turns"):
            as_text += texts
        else:
            detail = f" ({row['stop_detail']})" if row.get("stop_detail") else ""
            as_text.append(f"══ {row['dataset']} · conversation {row['sample_id']} (line {row['line']}) · "
                           f"{row['turn_count']} turns · ended: {row['stop_reason']}{detail} ══\n\n"
                           + "\n\n".join(texts))
    if as_json:
        return orjson.dumps(as_objects, option=orjson.OPT_INDENT_2).decode()
    return "\n\n".join(as_text)
