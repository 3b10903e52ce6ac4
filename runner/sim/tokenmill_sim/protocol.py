"""SGLang's /generate wire format: request parsing and validation, and response bodies. Pure functions.

Messages follow SGLang's TokenizerManager word for word where the source gives them (see reference/sglang.md), so a
client tested here sees what it will see in production.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from .tokens import Finished, SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128

# SamplingParams keys SGLang accepts; an unknown key is a TypeError there, so a typo never silently defaults.
KNOWN_SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
})


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def bad_request(message: str) -> ApiError:
    """A ValueError inside SGLang's /generate: HTTP 400 {"error": {"message": ...}} (_create_error_response)."""
    return ApiError(HTTPStatus.BAD_REQUEST, {"error": {"message": message}})


def abort_error(status: int, message: str) -> ApiError:
    """An abort with status 500/503 (queue full, out of memory): raised as fastapi.HTTPException by SGLang and
    rendered by its HTTPException handler as an OpenAI-style ErrorResponse."""
    return ApiError(status, {"object": "error", "message": message, "type": str(status), "param": None,
                             "code": status})


@dataclass(frozen=True)
class GenerateItem:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens_given: bool  # SGLang checks prompt + max_new_tokens only when the client set it
    return_prompt_token_ids: bool
    require_reasoning: bool


@dataclass(frozen=True)
class GenerateRequest:
    items: list[GenerateItem]
    batch: bool  # 2-D input_ids: the answer is a JSON list, even for one item


def parse_generate(body: Any, vocab_size: int, context_length: int) -> GenerateRequest:
    """Validate a /generate body like SGLang does; raise ApiError(400) with SGLang's message otherwise."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    prompts, batch = _prompts(body)
    if body.get("stream"):
        raise bad_request("The tokenmill simulator does not stream; send stream=false.")
    params = _sampling_params(body.get("sampling_params"), len(prompts), batch)
    rids = _rids(body.get("rid"), len(prompts), batch)
    items = []
    for rid, input_ids, (sampling, given) in zip(rids, prompts, params, strict=True):
        _check_prompt(input_ids, sampling, given, vocab_size, context_length)
        items.append(GenerateItem(rid, input_ids, sampling, given, bool(body.get("return_prompt_token_ids")),
                                  bool(body.get("require_reasoning"))))
    return GenerateRequest(items, batch)


def _prompts(body: dict[str, Any]) -> tuple[list[list[int]], bool]:
    input_ids = body.get("input_ids")
    if input_ids is None:
        if body.get("text") is not None:
            raise bad_request("The tokenmill simulator needs input_ids: text prompts are not supported "
                              "(pre-tokenize with the model's chat template and send input_ids).")
        raise bad_request("Either text, input_ids or input_embeds should be provided.")
    if not isinstance(input_ids, list) or not input_ids:
        raise bad_request("input_ids cannot be empty.")
    batch = isinstance(input_ids[0], list)
    prompts = input_ids if batch else [input_ids]
    for prompt in prompts:
        if not isinstance(prompt, list) or not prompt:
            raise bad_request("input_ids cannot be empty.")
        if not all(type(token) is int for token in prompt):
            raise bad_request("input_ids must be a list of integers or a list of lists of integers.")
    return prompts, batch


def _sampling_params(raw: Any, count: int, batch: bool) -> list[tuple[SamplingParams, bool]]:
    if raw is None:
        raw = {}
    if isinstance(raw, dict):
        return [_one_sampling(raw)] * count
    if isinstance(raw, list) and len(raw) == count and all(isinstance(p, dict) for p in raw):
        return [_one_sampling(p) for p in raw]
    what = "the batch size" if batch else "1"
    raise bad_request(f"sampling_params must be a dict, or a list of dicts whose length equals {what}.")


def _one_sampling(raw: dict[str, Any]) -> tuple[SamplingParams, bool]:
    unknown = sorted(set(raw) - KNOWN_SAMPLING_KEYS)
    if unknown:
        raise bad_request(f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")
    if (raw.get("n") or 1) != 1:
        raise bad_request("The tokenmill simulator does not support parallel sampling (n > 1); repeat the prompt.")
    given = raw.get("max_new_tokens") is not None
    max_new = raw["max_new_tokens"] if given else DEFAULT_MAX_NEW_TOKENS
    if type(max_new) is not int or max_new < 0:
        raise bad_request(f"max_new_tokens must be at least 0, got {max_new}.")
    stop_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(type(i) is int for i in stop_ids):
        raise bad_request("stop_token_ids must be a list of integers.")
    return SamplingParams(
        max_new_tokens=max_new,
        stop_token_ids=frozenset(stop_ids),
        ignore_eos=bool(raw.get("ignore_eos", False)),
        skip_special_tokens=bool(raw.get("skip_special_tokens", True)),
        no_stop_trim=bool(raw.get("no_stop_trim", False)),
    ), given


def _rids(raw: Any, count: int, batch: bool) -> list[str]:
    if raw is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(raw, str):
        return [f"{raw}_{i}" for i in range(count)] if batch else [raw]
    if isinstance(raw, list) and len(raw) == count and all(isinstance(r, str) for r in raw):
        if len(set(raw)) != len(raw):
            raise bad_request("Duplicate request ID detected")
        return list(raw)
    raise bad_request("The rid should be a string or a list of strings with the same length as the batch.")


def _check_prompt(input_ids: list[int], params: SamplingParams, given: bool, vocab_size: int,
                  context_length: int) -> None:
    if max(input_ids) >= vocab_size:
        raise bad_request(f"The input_ids {input_ids} contains values greater than the vocab size ({vocab_size}).")
    if min(input_ids) < 0:
        raise bad_request(f"The input_ids {input_ids} contains negative values.")
    prompt = len(input_ids)
    if prompt >= context_length:
        raise bad_request(f"The input ({prompt} tokens) is longer than the model's context length "
                          f"({context_length} tokens).")
    if given and prompt + params.max_new_tokens > context_length:
        raise bad_request(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {prompt + params.max_new_tokens} tokens: {prompt} tokens from the input "
            f"messages and {params.max_new_tokens} tokens for the completion. Please reduce the number of tokens "
            "in the input messages or the completion to fit within the limit.")


def response_item(item: GenerateItem, finished: Finished, text: str, e2e_latency: float,
                  reasoning_tokens: int) -> dict[str, Any]:
    """One item of a /generate answer, with SGLang's keys (HEAD names: num_retractions, reasoning_tokens)."""
    out: dict[str, Any] = {
        "text": text,
        "output_ids": finished.output_ids,
        "meta_info": {
            "id": item.rid,
            "finish_reason": finished.finish_reason,
            "prompt_tokens": len(item.input_ids),
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": reasoning_tokens,
            "completion_tokens": len(finished.output_ids),
            "cached_tokens": 0,
            "e2e_latency": e2e_latency,
        },
    }
    if item.return_prompt_token_ids:
        out["prompt_token_ids"] = item.input_ids
    return out


def reasoning_token_count(item: GenerateItem, output_ids: list[int], think_end: int) -> int:
    """meta_info.reasoning_tokens: SGLang counts through </think> only when the request sets require_reasoning."""
    if not item.require_reasoning:
        return 0
    try:
        return output_ids.index(think_end) + 1
    except ValueError:
        return len(output_ids)
