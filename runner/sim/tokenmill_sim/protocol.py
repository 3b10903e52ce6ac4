"""SGLang's /generate wire format, release by release: request parsing and validation, and response bodies. Pure.

Messages and statuses follow the release's own code (cited where each rule is applied), so a client tested here
sees what it will see in production. Order of the checks, as in SGLang: the JSON contract gate (0.5.22+), the
request's own validation (`GenerateReqInput`), the tokenizer manager's length checks, the SamplingParams
constructor (an unknown key is a TypeError there: HTTP 500 until 0.5.21), and the scheduler's input limit and
max_new_tokens clamp (`admit`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from tokenmill_runner.facts.releases import Release

from .tokens import Finished, SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams' default (0.5.9 sampling/sampling_params.py:42)
# A scheduler abort with status 400 becomes a ValueError and this message format (0.5.9
# managers/schedule_batch.py:1180-1190 set_finish_with_abort, managers/utils.py:111-124).
INPUT_TOO_LONG = ("Input length ({n} tokens) exceeds the maximum allowed length ({m} tokens). Use a shorter input or "
                  "enable --allow-auto-truncate.")
# What Starlette answers for an exception the route does not catch (a TypeError before 0.5.22).
INTERNAL_SERVER_ERROR = "Internal Server Error"


class ApiError(Exception):
    """An HTTP error answer: a JSON body, or plain text."""

    def __init__(self, status: int, body: dict[str, Any] | str) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def bad_request(message: str) -> ApiError:
    """A ValueError inside SGLang's /generate: HTTP 400 {"error": {"message": ...}} (_create_error_response,
    0.5.9 entrypoints/http_server.py:1636; 0.5.23 entrypoints/http_server.py:2246)."""
    return ApiError(HTTPStatus.BAD_REQUEST, {"error": {"message": message}})


def abort_error(status: int, message: str) -> ApiError:
    """A scheduler abort with status 500/503 (queue full, out of memory): raised as fastapi.HTTPException (0.5.9
    managers/tokenizer_manager.py:1157-1185) and rendered by SGLang's handler as an OpenAI-style ErrorResponse
    (0.5.9 entrypoints/http_server.py:399-405; 0.5.23 entrypoints/http_server.py:578)."""
    return ApiError(status, {"object": "error", "message": message, "type": str(status), "param": None,
                             "code": status})


def contract_error(message: str) -> ApiError:
    """0.5.22+: the JSON contract gate runs before anything else and answers 400 with the error as a string
    (0.5.22 entrypoints/http_server.py:921; 0.5.23 entrypoints/http_server.py:937-939)."""
    return ApiError(HTTPStatus.BAD_REQUEST, {"error": message})


@dataclass(frozen=True)
class ServerLimits:
    """What the server was started with, as the scheduler sees it."""

    context_length: int
    max_total_tokens: int  # the KV pool
    page_size: int = 1

    @property
    def max_req_len(self) -> int:
        """min(context - 1, pool - 1) (0.5.9 managers/tp_worker.py:287; 0.5.23 managers/tp_worker.py:568)."""
        return min(self.context_length - 1, self.max_total_tokens - 1)

    @property
    def max_req_input_len(self) -> int:
        """max_req_len - 5 (0.5.9 managers/tp_worker.py:291; 0.5.23 managers/tp_worker.py:572)."""
        return self.max_req_len - 5


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


def parse_generate(body: Any, release: Release, context_length: int) -> GenerateRequest:
    """Validate a /generate body like that release does; raise ApiError with its status and body otherwise."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if release.unknown_sampling_key_status == 400:
        _contract_gate(body.get("sampling_params"), release)
    prompts, batch = _prompts(body)
    if body.get("stream"):
        raise bad_request("The tokenmill simulator does not stream; send stream=false.")
    raw_params = _raw_params(body.get("sampling_params"), len(prompts), batch)
    rids = _rids(body.get("rid"), len(prompts), batch)
    items = []
    for rid, input_ids, raw in zip(rids, prompts, raw_params, strict=True):
        given = raw.get("max_new_tokens") is not None
        _check_lengths(input_ids, raw.get("max_new_tokens") if given else None, release, context_length)
        params = _sampling(raw, release)
        items.append(GenerateItem(rid, input_ids, params, given, bool(body.get("return_prompt_token_ids")),
                                  bool(body.get("require_reasoning"))))
    return GenerateRequest(items, batch)


def _contract_gate(raw: Any, release: Release) -> None:
    """The 0.5.22+ gate's checks on sampling_params that the simulator models: unknown keys and max_new_tokens'
    type (serde's messages, 0.5.23 sglang/api/v1/api_types.py:97-108, 1259-1264)."""
    for params in raw if isinstance(raw, list) else [raw]:
        if not isinstance(params, dict):
            continue
        for key in params:
            if key not in release.sampling_keys:
                listed = ", ".join(f"`{k}`" for k in release.sampling_keys)
                raise contract_error(f"unknown field `{key}`, expected one of {listed}")
        value = params.get("max_new_tokens")
        if value is not None and type(value) is not int:
            kind = "floating point" if isinstance(value, float) else type(value).__name__
            raise contract_error(f"invalid type: {kind} `{value}`, expected i64")


def _prompts(body: dict[str, Any]) -> tuple[list[list[int]], bool]:
    # GenerateReqInput's own checks (0.5.9 managers/io_struct.py:321, 336).
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
    # No range check: SGLang defines _validate_input_ids_in_vocab but never calls it (0.5.9
    # managers/tokenizer_manager.py; deleted in 0.5.21), so out-of-vocabulary ids are not refused.
    return prompts, batch


def _raw_params(raw: Any, count: int, batch: bool) -> list[dict[str, Any]]:
    if raw is None:
        raw = {}
    if isinstance(raw, dict):
        return [raw] * count
    if isinstance(raw, list) and len(raw) == count and all(isinstance(p, dict) for p in raw):
        return raw
    what = "the batch size" if batch else "1"
    raise bad_request(f"sampling_params must be a dict, or a list of dicts whose length equals {what}.")


def _check_lengths(input_ids: list[int], max_new: Any, release: Release, context_length: int) -> None:
    """TokenizerManager._validate_one_request (0.5.9 managers/tokenizer_manager.py:761-800; 0.5.23
    managers/tokenizer_manager.py:1338-1375): the prompt against the context, and prompt + max_new_tokens by the
    release's rule (>= until 0.5.10.post1, > from 0.5.11) when the request sets max_new_tokens."""
    prompt = len(input_ids)
    if prompt >= context_length:
        raise bad_request(f"The input ({prompt} tokens) is longer than the model's context length "
                          f"({context_length} tokens).")
    if type(max_new) is int and release.refuses_total(prompt, max_new, context_length):
        raise bad_request(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {prompt + max_new} tokens: {prompt} tokens from the input "
            f"messages and {max_new} tokens for the completion. Please reduce the number of tokens "
            "in the input messages or the completion to fit within the limit.")


def _sampling(raw: dict[str, Any], release: Release) -> SamplingParams:
    unknown = [key for key in raw if key not in release.sampling_keys]
    if unknown:
        # SamplingParams(**kwargs) raises TypeError, which the route does not catch (0.5.9
        # managers/tokenizer_manager.py:911, entrypoints/http_server.py:681): Starlette answers 500 in plain text.
        raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, INTERNAL_SERVER_ERROR)
    if (raw.get("n") or 1) != 1:
        raise bad_request("The tokenmill simulator does not support parallel sampling (n > 1); repeat the prompt.")
    max_new = raw.get("max_new_tokens")
    max_new = DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
    if type(max_new) is not int or max_new < 0:
        # SamplingParams.verify (0.5.9 sampling/sampling_params.py; 0.5.23 sampling/sampling_params.py:288).
        raise bad_request(f"max_new_tokens must be at least 0, got {max_new}.")
    stop_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(type(i) is int for i in stop_ids):
        raise bad_request("stop_token_ids must be a list of integers.")
    seed = raw.get("sampling_seed")
    # SamplingParams.verify (0.5.21+; 0.5.23 sampling/sampling_params.py:302-311).
    if seed is not None and type(seed) is not int:
        raise bad_request(f"sampling_seed must be an integer, got {type(seed).__name__}.")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise bad_request(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    return SamplingParams(
        sampling_seed=seed,
        max_new_tokens=max_new,
        stop_token_ids=frozenset(stop_ids),
        ignore_eos=bool(raw.get("ignore_eos", False)),
        skip_special_tokens=bool(raw.get("skip_special_tokens", True)),
        no_stop_trim=bool(raw.get("no_stop_trim", False)),
    )


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


def admit(item: GenerateItem, limits: ServerLimits, release: Release) -> int:
    """The scheduler's side: abort (400) a prompt of max_req_input_len tokens or more (0.5.9 managers/utils.py:111;
    0.5.23 managers/utils.py:272), else the max_new_tokens it will actually run: silently clamped to
    max_req_len - prompt - 1 (0.5.9 managers/scheduler.py:1392; 0.5.23 managers/scheduler.py:2714) and, from 0.5.21,
    to what an empty pool holds in whole pages (0.5.23 mem_cache/allocator/base.py:102-105)."""
    prompt = len(item.input_ids)
    if prompt >= limits.max_req_input_len:
        raise bad_request(INPUT_TOO_LONG.format(n=prompt, m=limits.max_req_input_len))
    max_new = max(0, min(item.params.max_new_tokens, limits.max_req_len - prompt - 1))
    if release.kv_memory_cap:
        paged = -(-prompt // limits.page_size) * limits.page_size
        max_new = max(0, min(max_new, limits.max_total_tokens - paged - limits.page_size - 1))
    return max_new


@dataclass(frozen=True)
class Accounting:
    """What the scheduler reports about a finished request besides its output."""

    e2e_latency: float
    reasoning_tokens: int
    retractions: int
    cached_tokens: int


def response_item(item: GenerateItem, finished: Finished, text: str, accounting: Accounting,
                  release: Release) -> dict[str, Any]:
    """One item of a /generate answer with that release's meta_info keys (0.5.9
    managers/tokenizer_manager.py:1497-1530, 2170-2187; 0.5.23 managers/tokenizer_manager.py:2510-2557, 3604-3628):
    the retraction counter is total_retractions until 0.5.11 and num_retractions from 0.5.12.post1;
    reasoning_tokens exists from 0.5.10.post1."""
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": finished.finish_reason,
        "prompt_tokens": len(item.input_ids),
        "weight_version": "default",
        release.retractions_key: accounting.retractions,
    }
    if release.has_reasoning_tokens:
        meta["reasoning_tokens"] = accounting.reasoning_tokens
    meta["completion_tokens"] = len(finished.output_ids)
    meta["cached_tokens"] = accounting.cached_tokens
    meta["e2e_latency"] = accounting.e2e_latency
    out: dict[str, Any] = {"text": text, "output_ids": finished.output_ids, "meta_info": meta}
    if item.return_prompt_token_ids and release.echoes_prompt_ids:
        # The ids the scheduler got, after the top-level keys of the answer (0.5.13.post1
        # managers/tokenizer_manager.py:616-617, 1960-1961; 0.5.23 managers/tokenizer_manager.py:948-949, 2673-2674).
        out["prompt_token_ids"] = list(item.input_ids)
    return out


def reasoning_token_count(item: GenerateItem, output_ids: list[int], think_end: int | None) -> int:
    """meta_info.reasoning_tokens: SGLang counts through </think> (all of the output when it never comes) only when
    the request sets require_reasoning (0.5.23 managers/schedule_batch.py:2240-2259 update_reasoning_tokens,
    managers/scheduler_components/batch_result_processor.py:1496-1522); the simulator always has the model's end
    token, as a server started with --reasoning-parser does. 0.5.23 also counts reasoning an output opens itself
    with the start tag (schedule_batch.py:2261-2283); the simulator's outputs never do (the template opens it)."""
    if not item.require_reasoning or think_end is None:
        return 0
    try:
        return output_ids.index(think_end) + 1
    except ValueError:
        return len(output_ids)
