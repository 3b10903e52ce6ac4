"""The simulator's /generate wire format release by release (tokenmill_sim/protocol.py), pure. Each assertion
names the release's own file:line (wheel sglang/srt/... unless said otherwise)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill_runner.facts.releases import SUPPORTED_RELEASES, release, version_key
from tokenmill_sim.protocol import (
    INTERNAL_SERVER_ERROR,
    Accounting,
    ApiError,
    ServerLimits,
    admit,
    parse_generate,
    response_item,
)
from tokenmill_sim.tokens import NAN_MATCHED, Finished, SamplingParams, with_nan

LATEST = SUPPORTED_RELEASES[-1]


def parse(body: Any, version: str = LATEST, context: int = 4096) -> Any:
    return parse_generate(body, release(version), context)


def refusal(body: Any, version: str = LATEST, context: int = 4096) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, version, context)
    return caught.value


def message(body: Any, **kwargs: Any) -> str:
    error = refusal(body, **kwargs)
    assert error.status == 400
    return error.body["error"]["message"]


def test_single_and_batched_requests_parse() -> None:
    single = parse({"input_ids": [1, 2, 3], "rid": "a"})
    assert not single.batch and single.items[0].rid == "a"
    assert single.items[0].params == SamplingParams(max_new_tokens=128)  # 0.5.9 sampling/sampling_params.py:42
    batch = parse({"input_ids": [[1], [2, 3]], "rid": "r",
                   "sampling_params": [{"max_new_tokens": 5}, {"max_new_tokens": 6, "ignore_eos": True,
                                                              "stop_token_ids": [7]}]})
    assert batch.batch and [i.rid for i in batch.items] == ["r_0", "r_1"]
    assert batch.items[1].params == SamplingParams(6, frozenset({7}), ignore_eos=True)
    broadcast = parse({"input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 9}, "rid": ["x", "y"]})
    assert [i.params.max_new_tokens for i in broadcast.items] == [9, 9] and broadcast.items[1].rid == "y"
    assert len({i.rid for i in parse({"input_ids": [[1], [2]]}).items}) == 2


def test_validation_messages_follow_sglang() -> None:
    # GenerateReqInput (0.5.9 managers/io_struct.py:321, 336); TokenizerManager (0.5.9
    # managers/tokenizer_manager.py:761-800).
    assert message({"input_ids": []}) == "input_ids cannot be empty."
    assert message({"input_ids": [[1], []]}) == "input_ids cannot be empty."
    assert message({"input_ids": [1] * 10}, context=10) == \
        "The input (10 tokens) is longer than the model's context length (10 tokens)."
    assert message({"input_ids": [1] * 6, "sampling_params": {"max_new_tokens": 5}}, context=10) == (
        "Requested token count exceeds the model's maximum context length of 10 tokens. You requested a total of "
        "11 tokens: 6 tokens from the input messages and 5 tokens for the completion. Please reduce the number of "
        "tokens in the input messages or the completion to fit within the limit.")
    parse({"input_ids": [1] * 6}, context=10)  # without an explicit max_new_tokens SGLang does not check the total
    assert "input_ids" in message({"text": "hello"})
    assert "max_new_tokens" in message({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}})
    assert message({"input_ids": [[1], [2]], "rid": ["a", "a"]}) == "Duplicate request ID detected"
    assert "length" in message({"input_ids": [[1], [2]], "sampling_params": [{}]})
    assert "integers" in message({"input_ids": [1, "2"]})


def test_sampling_seed_is_read_and_checked_like_sglang() -> None:
    # sampling_seed is a SamplingParams key in every supported release (0.5.9 sampling/sampling_params.py:66; 0.5.23
    # sampling/sampling_params.py:179); verify() wants an int in int64 (0.5.23 sampling/sampling_params.py:302-311).
    assert parse({"input_ids": [1], "sampling_params": {"sampling_seed": 7}}).items[0].params.sampling_seed == 7
    assert parse({"input_ids": [1]}).items[0].params.sampling_seed is None
    assert message({"input_ids": [1], "sampling_params": {"sampling_seed": 1.5}}, version="0.5.21") == \
        "sampling_seed must be an integer, got float."


def test_out_of_vocabulary_prompt_ids_are_not_refused() -> None:
    # _validate_input_ids_in_vocab is defined but never called (0.5.9 managers/tokenizer_manager.py; deleted 0.5.21).
    assert parse({"input_ids": [1, 10**7]}).items[0].input_ids == [1, 10**7]


@pytest.mark.parametrize("version", ["0.5.10.post1", "0.5.11"])
def test_the_context_rule_at_equality_follows_the_release(version: str) -> None:
    # prompt + max_new_tokens == context: >= refuses until 0.5.10.post1 (managers/tokenizer_manager.py:815), > from
    # 0.5.11 (managers/tokenizer_manager.py:845).
    body = {"input_ids": [1] * 6, "sampling_params": {"max_new_tokens": 4}}
    if version == "0.5.10.post1":
        assert "You requested a total of 10 tokens" in message(body, version=version, context=10)
    else:
        assert parse(body, version, context=10).items[0].params.max_new_tokens == 4


@pytest.mark.parametrize("version", ["0.5.9", "0.5.21"])
def test_an_unknown_sampling_key_is_a_500_until_0_5_21(version: str) -> None:
    # SamplingParams(**kwargs) raises TypeError (0.5.9 managers/tokenizer_manager.py:911) and /generate catches only
    # ValueError (0.5.9 entrypoints/http_server.py:681; 0.5.21 entrypoints/http_server.py:958): Starlette's 500.
    error = refusal({"input_ids": [1], "sampling_params": {"max_tokens": 5}}, version=version)
    assert (error.status, error.body) == (500, INTERNAL_SERVER_ERROR)


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23"])
def test_an_unknown_sampling_key_is_refused_by_the_contract_gate_from_0_5_22(version: str) -> None:
    # generate_contract_error before the request is built (0.5.22 entrypoints/http_server.py:921); serde's wording
    # (0.5.23 sglang/api/v1/api_types.py:97-108); the gate's list gains `choice` in 0.5.23 (0.5.23 sglang/api/v1/api_types.py:207).
    error = refusal({"input_ids": [1], "sampling_params": {"max_tokens": 5}}, version=version)
    assert error.status == 400 and isinstance(error.body["error"], str)
    assert error.body["error"].startswith("unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`")
    assert error.body["error"].endswith("`watermark`" if version == "0.5.22" else "`watermark`, `choice`")
    typed = refusal({"input_ids": [1], "sampling_params": {"max_new_tokens": 4.0}}, version=version)
    assert typed.body == {"error": "invalid type: floating point `4.0`, expected i64"}


@pytest.mark.parametrize(("version", "accepted"), [
    ("0.5.14", False), ("0.5.15.post1", True), ("0.5.21", True), ("0.5.22", False)])
def test_internal_sampling_fields_are_accepted_only_while_the_struct_takes_them(version: str, accepted: bool) -> None:
    # 0.5.15.post1 makes SamplingParams a msgspec.Struct whose internal fields are keywords too (0.5.15.post1
    # sampling/sampling_params.py:75,116); the 0.5.22 gate lists only the API fields.
    body = {"input_ids": [1], "sampling_params": {"is_normalized": True}}
    if accepted:
        assert parse(body, version).items
    else:
        assert refusal(body, version=version).status in (400, 500)


def item(prompt: int, max_new: int) -> Any:
    return parse({"input_ids": [1] * prompt, "sampling_params": {"max_new_tokens": max_new}}, context=10**6).items[0]


def test_the_scheduler_aborts_long_inputs_and_clamps_max_new_tokens() -> None:
    limits = ServerLimits(context_length=1000, max_total_tokens=600)
    # max_req_len = min(999, 599) = 599, max_req_input_len = 594 (0.5.23 managers/tp_worker.py:568-572); a prompt
    # that long is aborted with 400 (0.5.23 managers/utils.py:272).
    with pytest.raises(ApiError) as caught:
        admit(item(594, 1), limits, release(LATEST))
    assert caught.value.body["error"]["message"] == (
        "Input length (594 tokens) exceeds the maximum allowed length (594 tokens). Use a shorter input or enable "
        "--allow-auto-truncate.")
    # max_new_tokens is cut to max_req_len - prompt - 1 without a word (0.5.23 managers/scheduler.py:2714).
    assert admit(item(500, 1000), limits, release("0.5.20")) == 599 - 500 - 1
    assert admit(item(500, 10), limits, release("0.5.20")) == 10


def test_from_0_5_21_the_clamp_also_fits_an_empty_pool_in_pages() -> None:
    # max_new_tokens_for_memory: pool - prompt rounded up to pages - one page - 1 (0.5.23
    # mem_cache/allocator/base.py:102-105).
    limits = ServerLimits(context_length=10_000, max_total_tokens=1000, page_size=64)
    assert admit(item(100, 5000), limits, release("0.5.21")) == 1000 - 128 - 64 - 1
    assert admit(item(100, 5000), limits, release("0.5.20")) == 999 - 100 - 1


def finished(ids: list[int], reason: dict[str, Any]) -> Finished:
    return Finished(ids, reason, reason.get("matched") if isinstance(reason.get("matched"), int) else None)


@pytest.mark.parametrize("version", SUPPORTED_RELEASES)
def test_meta_info_keys_per_release(version: str) -> None:
    # total_retractions through 0.5.11 (managers/tokenizer_manager.py:1666), num_retractions from 0.5.12.post1
    # (managers/tokenizer_manager.py:1687); reasoning_tokens from 0.5.10.post1.
    facts = release(version)
    body = response_item(item(3, 4), finished([4, 5, 9], {"type": "stop", "matched": 9}), "x",
                         Accounting(1.5, 2, 1, 3), facts)
    meta = body["meta_info"]
    assert meta[facts.retractions_key] == 1 and meta["cached_tokens"] == 3 and meta["completion_tokens"] == 3
    other = "num_retractions" if facts.retractions_key == "total_retractions" else "total_retractions"
    assert other not in meta
    assert ("reasoning_tokens" in meta) == facts.has_reasoning_tokens
    renamed = version_key(version) >= version_key("0.5.12.post1")
    assert facts.retractions_key == ("num_retractions" if renamed else "total_retractions")


def test_nan_replaces_the_token_with_eos_unless_the_length_check_runs_first() -> None:
    # _check_vocab_boundary_finish (0.5.9 managers/schedule_batch.py:1056-1070); through 0.5.17 the length check
    # runs first (0.5.9 managers/schedule_batch.py:1081-1086), from 0.5.18 the vocabulary check does (0.5.23
    # managers/schedule_batch.py:2019).
    out = finished([10, 11, 12, 13, 99], {"type": "stop", "matched": 99})
    early = with_nan(out, 2, 8, eos=99, bad_id=5000, nan_first=False)
    assert early.output_ids == [10, 11, 99] and early.finish_reason == {"type": "stop", "matched": NAN_MATCHED}
    long = finished([10, 11, 12, 13], {"type": "length", "length": 4})
    at_cap_old = with_nan(long, 3, 4, eos=99, bad_id=5000, nan_first=False)
    assert at_cap_old.output_ids == [10, 11, 12, 5000] and at_cap_old.finish_reason["type"] == "length"
    at_cap_new = with_nan(long, 3, 4, eos=99, bad_id=5000, nan_first=True)
    assert at_cap_new.output_ids == [10, 11, 12, 99] and at_cap_new.finish_reason["matched"] == NAN_MATCHED


@pytest.mark.parametrize("version", SUPPORTED_RELEASES)
def test_prompt_ids_are_echoed_when_asked_from_0_5_13_post1(version: str) -> None:
    # return_prompt_token_ids: GenerateReqInput field and the tokenizer manager's echo from 0.5.13.post1
    # (managers/tokenizer_manager.py:616-617, 1960-1961); earlier releases ignore the key.
    facts = release(version)
    asked = parse({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_prompt_token_ids": True},
                  version).items[0]
    answer = response_item(asked, finished([4, 9], {"type": "stop", "matched": 9}), "x", Accounting(1.0, 0, 0, 2),
                           facts)
    echoes = version_key(version) >= version_key("0.5.13.post1")
    assert facts.echoes_prompt_ids == echoes
    assert answer.get("prompt_token_ids") == ([1, 2, 3] if echoes else None)
    plain = parse({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}, version).items[0]
    unasked = response_item(plain, finished([4, 9], {"type": "stop", "matched": 9}), "x", Accounting(1.0, 0, 0, 2),
                            facts)
    assert "prompt_token_ids" not in unasked


def test_reasoning_tokens_count_through_the_end_token_only_when_required() -> None:
    from tokenmill_sim.protocol import reasoning_token_count

    required = parse({"input_ids": [1, 2], "require_reasoning": True}).items[0]
    assert reasoning_token_count(required, [5, 6, 77, 8], 77) == 3
    assert reasoning_token_count(required, [5, 6, 8], 77) == 3  # never ended: all of the output
    assert reasoning_token_count(parse({"input_ids": [1, 2]}).items[0], [5, 6, 77, 8], 77) == 0
