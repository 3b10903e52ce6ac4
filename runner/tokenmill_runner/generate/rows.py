"""The row a generated sample becomes, and the per-sample error record. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..render.tokenizer_info import TokenizerInfo
from ..source.prompts import Prompt, RowError
from .results import Generation, GenerationFailure

# The row's fields read off its output ids (where reasoning ends, a tool call, SGLang's reasoning count checked):
# `pending_row` leaves them out and `finish_rows` fills them for a whole shard at once, off the event loop.
ANSWER_FIELDS = ("reasoning_end", "reasoning_end_token_id", "has_tool_call", "reasoning_agrees",
                 "reasoning_disagreements")


def pending_row(dataset: str, prompt: Prompt, prompt_ids: Sequence[int], generation: Generation,
                max_new_tokens: int, sample_index: int = 0, seed: int | None = None) -> dict[str, Any]:
    """`build_row` without ANSWER_FIELDS, which `finish_rows` adds: what the runner's loop does per answer, the
    scans of the output ids left to one vectorised pass per shard (each list.index over an answer's ids cost
    ~0.01 ms a scan on the loop, three scans a sample)."""
    return {
        "sample_id": prompt.sample_id,
        "dataset": dataset,
        "line": prompt.line,
        "sample_index": sample_index,
        "prompt_ids": prompt_ids,
        "output_ids": generation.output_ids if generation.packed_ids is None else generation.packed_ids,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": generation.completion_tokens,
        "finish_reason": generation.finish_reason,
        "matched_stop": generation.matched_stop,
        "cached_tokens": generation.cached_tokens,
        "server_reasoning_tokens": generation.reasoning_tokens,
        "sent_prompt_tokens": len(prompt_ids),
        "max_new_tokens": max_new_tokens,
        "latency_s": round(generation.latency_s, 4),
        "attempts": generation.attempts,
        "seed": seed,
    }


def finish_rows(rows: list[dict[str, Any]], info: TokenizerInfo) -> None:
    """Add ANSWER_FIELDS to the rows `pending_row` built (rows that have them are left alone), with the values
    `build_row` gives, for all of them in one pass over their concatenated output ids.

    SGLang's meta_info.reasoning_tokens is checked against the output (`reasoning_agrees`, None when SGLang counted
    nothing: a release before 0.5.10.post1, a server without a reasoning parser, or no reasoning). SGLang counts
    through its parser's end token and all of the output when that token never comes (0.5.23
    managers/schedule_batch.py:2240-2259, the end ids encoded from the detector's think_end_token, scheduler.py:940-950
    and parser/reasoning_parser.py:118). That is spec.model.reasoning's first end token (`reasoning_end_id`), never an
    alternative: Kimi's kimi_k2 detector ends its *text* split at <|tool_calls_section_begin|> too
    (parser/reasoning_parser.py:516-557, tool_start_token at :552), but its count runs to </think>, so an output that
    leaves reasoning at the tool-call section is counted whole. A disagreement therefore means the server's parser
    counts to another token than the spec names. Where reasoning ends (`reasoning_end`) is the first of any of its end
    tokens (Kimi-K2.5 may end reasoning at the tool-call section instead of </think>; whichever comes first)."""
    pending = [row for row in rows if "reasoning_end" not in row]
    if not pending:
        return
    parts = [np.asarray(row["output_ids"]) for row in pending]  # the 4-byte arrays without a copy, lists as int64
    lengths = np.fromiter((part.size for part in parts), dtype=np.int64, count=len(parts))
    starts = np.zeros(len(parts), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    flat = np.concatenate(parts).astype(np.int64, copy=False)
    end_ids = [int(i) for i in info.reasoning_end_tokens] or info.reasoning_end_id
    ends = [end_ids] if isinstance(end_ids, int) else list(end_ids or ())
    counted = [] if info.reasoning_end_id is None else [info.reasoning_end_id]
    tools = [] if info.tool_call_id is None else [info.tool_call_id]
    # One scan of every id for any token of interest; each question then looks only at those hits.
    interesting = np.asarray(sorted({*ends, *counted, *tools}), dtype=np.int64)
    hits = np.flatnonzero(np.isin(flat, interesting)) if interesting.size and flat.size else np.zeros(0, np.int64)
    ended_at, ended_token = _first_of(flat, starts, hits, ends)
    counted_at = _first_of(flat, starts, hits, counted)[0].tolist()
    tool_at = _first_of(flat, starts, hits, tools)[0].tolist()
    sizes = lengths.tolist()
    for number, (row, at, token) in enumerate(zip(pending, ended_at.tolist(), ended_token.tolist(), strict=True)):
        row["reasoning_end"] = None if at < 0 else at
        row["reasoning_end_token_id"] = None if at < 0 else token
        row["has_tool_call"] = bool(tools) and tool_at[number] >= 0
        server_count = row.get("server_reasoning_tokens")
        if not server_count:
            agrees = None
        else:
            agrees = (counted_at[number] + 1 if counted_at[number] >= 0 else sizes[number]) == server_count
        row["reasoning_agrees"] = agrees
        row["reasoning_disagreements"] = int(agrees is False)


def _first_of(flat: np.ndarray, starts: np.ndarray, hits: np.ndarray,
              tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per row (its ids at flat[starts[i]:starts[i + 1]]): the index of the first of `tokens` in it and that token,
    or -1 and -1; `hits` (ascending) are the positions in `flat` that may hold one of them."""
    first = np.full(starts.size, -1, dtype=np.int64)
    token = np.full(starts.size, -1, dtype=np.int64)
    if tokens and hits.size:
        hits = hits[np.isin(flat[hits], np.asarray(tokens, dtype=np.int64))]
    if tokens and hits.size:
        owners = np.searchsorted(starts, hits, side="right") - 1
        owners, earliest = np.unique(owners, return_index=True)  # hits ascend: each row's first hit is its first
        first[owners] = hits[earliest] - starts[owners]
        token[owners] = flat[hits[earliest]]
    return first, token


def build_row(dataset: str, prompt: Prompt, prompt_ids: Sequence[int], generation: Generation,
              max_new_tokens: int, info: TokenizerInfo, sample_index: int = 0,
              seed: int | None = None) -> dict[str, Any]:
    """One row, whole: `pending_row` finished at once (a turn of a conversation; the runner's single-turn rows are
    finished a shard at a time)."""
    row = pending_row(dataset, prompt, prompt_ids, generation, max_new_tokens, sample_index, seed)
    finish_rows([row], info)
    return row


TURN_FIELDS = ("prompt_ids", "output_ids", "prompt_tokens", "completion_tokens", "finish_reason", "matched_stop",
               "reasoning_end", "reasoning_end_token_id", "has_tool_call", "cached_tokens", "server_reasoning_tokens",
               "reasoning_agrees", "latency_s", "attempts")


def build_turn(dataset: str, prompt: Prompt, prompt_ids: list[int], generation: Generation, max_new_tokens: int,
               info: TokenizerInfo, history_exact: bool | None, tool_calls: str | None,
               seed: int | None = None) -> dict[str, Any]:
    """One generated turn of a multi-turn row: the single-turn row's per-generation facts, plus whether its prompt
    extends the previous turn's ids token for token, the calls parsed from it (JSON) and the seed it was drawn with."""
    row = build_row(dataset, prompt, prompt_ids, generation, max_new_tokens, info)
    return {**{name: row[name] for name in TURN_FIELDS}, "output_ids": generation.output_ids,  # a list: turns compare
            "history_exact": history_exact, "tool_calls": tool_calls, "seed": seed}


def build_conversation_row(dataset: str, prompt: Prompt, turns: list[dict[str, Any]], stop_reason: str,
                           stop_detail: str | None, max_new_tokens: int, sample_index: int = 0,
                           seed: int | None = None) -> dict[str, Any]:
    """A regenerated conversation (mode all-turns): every turn in `turns`; the row's own token columns and
    per-generation facts are its last turn's (whose prompt holds the whole history as rendered), except
    `completion_tokens` and `latency_s`, the conversation's totals."""
    last = turns[-1]
    return {
        "sample_id": prompt.sample_id, "dataset": dataset, "line": prompt.line, "sample_index": sample_index,
        **{name: last[name] for name in TURN_FIELDS
           if name not in ("completion_tokens", "latency_s", "cached_tokens")},
        "completion_tokens": sum(turn["completion_tokens"] for turn in turns),
        # The prefix cache over the whole conversation: what all its requests found cached, of all they sent.
        "cached_tokens": sum(turn["cached_tokens"] for turn in turns),
        "sent_prompt_tokens": sum(turn["prompt_tokens"] for turn in turns),
        "reasoning_disagreements": sum(turn["reasoning_agrees"] is False for turn in turns),
        "latency_s": round(sum(turn["latency_s"] for turn in turns), 4),
        "has_tool_call": any(turn["has_tool_call"] for turn in turns),
        "max_new_tokens": max_new_tokens, "seed": seed,
        "turns": turns, "turn_count": len(turns), "stop_reason": stop_reason, "stop_detail": stop_detail,
        # for the marker only (the shard has them inside `turns`)
        "last_turn_tokens": last["completion_tokens"],
        "reasoning_turns": sum(turn["reasoning_end"] is not None for turn in turns),
    }


def failure_record(dataset: str, prompt: Prompt, failure: GenerationFailure, sample_index: int = 0,
                   retry_round: int = 0) -> dict[str, Any]:
    error = RowError(prompt.line, prompt.sample_id, failure.reason,
                     f"line {prompt.line} (sample {prompt.sample_id}): {failure.message}", sample_index)
    record = {**error.as_record(dataset), "attempts": failure.attempts}
    return {**record, "retry_round": retry_round} if retry_round else record


def too_long_record(dataset: str, prompt: Prompt, why: str, dataset_index: int, sample_index: int = 0) -> dict[str, Any]:
    """The record of a prompt the server would refuse or cut (`why` from request_fit.ServerLimits.misfit)."""
    return RowError(
        prompt.line, prompt.sample_id, "prompt_too_long",
        f"line {prompt.line} (sample {prompt.sample_id}): {why}. Lower "
        f"spec.datasets[{dataset_index}].sampling.maxNewTokens, raise spec.server.contextLength (and the KV pool "
        "that holds it), or shorten the prompt", sample_index,
    ).as_record(dataset)
