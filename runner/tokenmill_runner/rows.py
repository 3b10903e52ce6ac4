"""The row a generated sample becomes, and the per-sample error record. Pure functions."""

from __future__ import annotations

from typing import Any

from .prompts import Prompt, RowError
from .results import Generation, GenerationFailure
from .tokenizer_info import TokenizerInfo


def reasoning_end(output_ids: list[int], end_id: int | None) -> int | None:
    """Index of the end-of-reasoning token in the output, or None (no reasoning, or truncated while reasoning)."""
    if end_id is None:
        return None
    try:
        return output_ids.index(end_id)
    except ValueError:
        return None


def build_row(dataset: str, prompt: Prompt, prompt_ids: list[int], generation: Generation,
              max_new_tokens: int, info: TokenizerInfo) -> dict[str, Any]:
    output_ids = generation.output_ids
    return {
        "sample_id": prompt.sample_id,
        "dataset": dataset,
        "line": prompt.line,
        "prompt_ids": prompt_ids,
        "output_ids": output_ids,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": generation.completion_tokens,
        "finish_reason": generation.finish_reason,
        "matched_stop": generation.matched_stop,
        "reasoning_end": reasoning_end(output_ids, info.reasoning_end_id),
        "has_tool_call": info.tool_call_id is not None and info.tool_call_id in output_ids,
        "max_new_tokens": max_new_tokens,
        "latency_s": round(generation.latency_s, 4),
        "attempts": generation.attempts,
    }


def failure_record(dataset: str, prompt: Prompt, failure: GenerationFailure) -> dict[str, Any]:
    error = RowError(prompt.line, prompt.sample_id, failure.reason,
                     f"line {prompt.line} (sample {prompt.sample_id}): {failure.message}")
    return {**error.as_record(dataset), "attempts": failure.attempts}


def too_long_record(dataset: str, prompt: Prompt, prompt_tokens: int, max_new_tokens: int,
                    context_length: int, dataset_index: int) -> dict[str, Any]:
    return RowError(
        prompt.line, prompt.sample_id, "prompt_too_long",
        f"line {prompt.line} (sample {prompt.sample_id}): prompt is {prompt_tokens} tokens; with "
        f"maxNewTokens {max_new_tokens} that is {prompt_tokens + max_new_tokens} > context length "
        f"{context_length}. Lower spec.datasets[{dataset_index}].sampling.maxNewTokens, raise "
        "spec.server.contextLength, or shorten the prompt",
    ).as_record(dataset)
