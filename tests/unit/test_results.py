"""How one /generate answer is read: every body shape is classified by whose fault it is (results.py). The bodies
per SGLang release, with their file:line, are in tests/contract/; these pin the rules themselves."""

import random

import orjson
import pytest

from tokenmill_runner.generate.client import RetryPolicy
from tokenmill_runner.generate.results import (
    NAN_MATCHED,
    AttemptFailed,
    Fault,
    Generation,
    classify_error,
    error_message,
    parse_generation,
    transport_failure,
)


def body(output_ids, completion, finish, **meta):
    return {"text": "x", "output_ids": output_ids,
            "meta_info": {"id": "r", "finish_reason": finish, "prompt_tokens": 3,
                          "completion_tokens": completion, "e2e_latency": 1.5, **meta}}


def test_stop_generation_is_parsed_with_retractions_under_either_name():
    old = parse_generation(body([4, 5, 9], 3, {"type": "stop", "matched": 9}, total_retractions=2,
                                cached_tokens=7), "s", 2)
    assert old == Generation([4, 5, 9], 3, 3, "stop", 9, 1.5, 2, "s", retractions=2, cached_tokens=7)
    new = parse_generation(body([4, 5, 9], 3, {"type": "stop", "matched": 9}, num_retractions=1), "s", 1)
    assert new.retractions == 1 and new.cached_tokens == 0


def test_length_finish():
    result = parse_generation(body([4] * 5, 5, {"type": "length", "length": 5}), "s", 1)
    assert result.finish_reason == "length" and result.matched_stop is None


def test_a_nan_answer_is_never_a_clean_stop():
    result = parse_generation(body([4, 5, 9], 3, {"type": "stop", "matched": NAN_MATCHED}), "s", 1)
    assert isinstance(result, AttemptFailed)
    assert (result.fault, result.reason) == (Fault.SAMPLE, "nan_output")
    assert "NaN happened" in result.message


def test_an_id_outside_the_vocabulary_is_corrupt_even_as_length():
    # NaN on the last allowed token, 0.5.9-0.5.17: finish length, the bad id kept (tests/unit/test_sim_protocol.py).
    result = parse_generation(body([4, 5, 5001], 3, {"type": "length", "length": 3}), "s", 1, vocab_size=5000)
    assert (result.fault, result.reason) == (Fault.SAMPLE, "nan_output") and "5001" in result.message
    assert isinstance(parse_generation(body([4, 4999], 2, {"type": "length", "length": 2}), "s", 1, 5000),
                      Generation)


@pytest.mark.parametrize("ids", [[4, "5", 6], [4, 5.0, 6], [None], [True, [1]], "4,5"])
def test_output_ids_that_are_not_integers_are_a_bad_response(ids):
    result = parse_generation(body(ids, len(ids), {"type": "stop", "matched": 6}), "s", 1, vocab_size=5000)
    assert (result.fault, result.reason) == (Fault.SAMPLE, "bad_response") and "not a list of integers" in result.message


def test_an_id_past_32_bits_is_outside_any_vocabulary_and_kept_ids_are_packed_for_the_shard():
    huge = parse_generation(body([4, 2**40], 2, {"type": "length", "length": 2}), "s", 1)
    assert (huge.fault, huge.reason) == (Fault.SAMPLE, "nan_output") and str(2**40) in huge.message
    kept = parse_generation(body([4, 5, 9], 3, {"type": "stop", "matched": 9}), "s", 1, vocab_size=5000)
    assert list(kept.packed_ids) == kept.output_ids == [4, 5, 9] and kept.packed_ids.itemsize == 4


def test_a_stop_string_is_a_clean_stop_without_a_matched_token():
    result = parse_generation(body([4, 5], 2, {"type": "stop", "matched": "\n\n"}), "s", 1)
    assert isinstance(result, Generation) and result.matched_stop is None


def test_prompt_tokens_prepended_by_old_sglang_is_final():
    result = parse_generation(body([1, 2, 3, 4, 5, 9], 1, {"type": "stop", "matched": 9}), "s", 1)
    assert (result.fault, result.reason) == (Fault.FINAL, "output_mismatch")
    assert "0.5.4.post2" in result.message


@pytest.mark.parametrize(("status_code", "fault"), [
    (None, Fault.SAMPLE), (503, Fault.OVERLOAD), (500, Fault.REPLICA), (400, Fault.FINAL)])
def test_an_abort_is_classified_by_its_status(status_code, fault):
    finish = {"type": "abort", "message": "retracted", "status_code": status_code, "err_type": None}
    result = parse_generation(body([], 0, finish), "s", 1)
    assert isinstance(result, AttemptFailed) and result.fault is fault and "retracted" in result.message


@pytest.mark.parametrize(("body_", "message"), [
    ({"error": {"message": "bad top_p"}}, "bad top_p"),
    ({"error": "unknown field `foo`, expected one of `max_new_tokens`"}, "unknown field `foo`"),
    ({"object": "error", "message": "The request queue is full.", "type": "503", "param": None, "code": 503},
     "The request queue is full."),
    ({"detail": "Not Found"}, "Not Found"),
])
def test_error_messages_of_every_body_shape(body_, message):
    assert error_message(orjson.dumps(body_)).startswith(message)


def test_plain_text_error_bodies_are_read_too():
    assert error_message(b"Internal Server Error") == "Internal Server Error"


@pytest.mark.parametrize(("status", "fault"), [
    (400, Fault.FINAL), (422, Fault.FINAL), (401, Fault.FATAL), (403, Fault.FATAL), (404, Fault.FATAL),
    (429, Fault.OVERLOAD), (503, Fault.OVERLOAD), (500, Fault.REPLICA), (502, Fault.REPLICA), (504, Fault.REPLICA)])
def test_http_errors_are_classified_by_status(status, fault):
    assert classify_error(status, b'{"error": "x"}', "s").fault is fault


def test_a_refused_connection_means_the_replica_is_down_a_dropped_one_that_it_failed():
    assert transport_failure("s", "ConnectError", "refused", connect=True).fault is Fault.UNREACHABLE
    assert transport_failure("s", "ReadError", "", connect=False).fault is Fault.REPLICA


def test_backoff_grows_and_is_capped():
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=8.0)
    rng = random.Random(1)
    for attempt, cap in [(1, 1.0), (2, 2.0), (3, 4.0), (6, 8.0), (500, 8.0)]:
        delays = [policy.delay(attempt, rng) for _ in range(200)]
        assert max(delays) <= cap and max(delays) > cap * 0.8


def test_echoed_prompt_ids_that_differ_from_the_ids_sent_are_an_input_mismatch():
    """return_prompt_token_ids (0.5.13.post1+): the ids the scheduler got come back as prompt_token_ids; others than
    were sent mean a proxy or the server re-encoded the prompt. Final, like output_mismatch; retryable in the
    ledger (the slot is given up, not the input's fault)."""
    from tokenmill_runner.store.ledger import RETRYABLE_REASONS

    good = {**body([4, 9], 2, {"type": "stop", "matched": 9}), "prompt_token_ids": [1, 2, 3]}
    assert isinstance(parse_generation(good, "s", 1, None, [1, 2, 3]), Generation)
    bad = {**good, "prompt_token_ids": [1, 2, 4]}
    failed = parse_generation(bad, "s", 1, None, [1, 2, 3])
    assert isinstance(failed, AttemptFailed) and (failed.fault, failed.reason) == (Fault.FINAL, "input_mismatch")
    assert "3 ids echoed for 3 sent, first difference at position 2 (sent 3, echoed 4)" in failed.message
    shorter = parse_generation({**good, "prompt_token_ids": [1, 2]}, "s", 1, None, [1, 2, 3])
    assert "2 ids echoed for 3 sent, first difference at position 2 (sent 3, echoed nothing)" in shorter.message
    # Not asked (sent_ids None), or a replica of a release without the echo: nothing to compare.
    assert isinstance(parse_generation(bad, "s", 1), Generation)
    assert isinstance(parse_generation(body([4, 9], 2, {"type": "stop", "matched": 9}), "s", 1, None, [1, 2, 3]),
                      Generation)
    assert "input_mismatch" in RETRYABLE_REASONS


def test_sglangs_reasoning_count_is_read_where_the_release_reports_it():
    counted = parse_generation(body([4, 8, 9], 3, {"type": "stop", "matched": 9}, reasoning_tokens=2), "s", 1)
    assert counted.reasoning_tokens == 2
    assert parse_generation(body([4, 9], 2, {"type": "stop", "matched": 9}), "s", 1).reasoning_tokens is None


def test_reasoning_agreement_follows_sglangs_count_through_the_end_token():
    from tokenmill_runner.generate.rows import finish_rows
    from tokenmill_runner.render.tokenizer_info import TokenizerInfo

    def reasoning_agrees(output: list[int], end: int, count: int | None) -> bool | None:
        row = {"output_ids": output, "server_reasoning_tokens": count}
        finish_rows([row], TokenizerInfo(location="x", vocab_size=100, eos_token_ids=[2], eos_tokens={"2": "</s>"},
                                         reasoning_end_token="</think>", reasoning_end_id=end,
                                         reasoning_end_tokens={str(end): "</think>", "7": "<|tool_calls_section_begin|>"},
                                         tool_call_token=None, tool_call_id=None, model_context_length=None))
        return row["reasoning_agrees"]

    think, section = 9, 7  # </think> and Kimi's <|tool_calls_section_begin|>
    ended = [1, 2, 3, 4, 5, think, 6, 8]
    assert reasoning_agrees(ended, think, 6) is True  # </think> at index 5: SGLang counts 6 tokens
    assert reasoning_agrees(ended, think, 9) is False  # its parser counted to another token
    truncated = [1] * 20
    assert reasoning_agrees(truncated, think, 20) is True  # truncated while reasoning: all of the output
    assert reasoning_agrees(truncated, think, 7) is False
    # Reasoning left at the tool-call section without </think>: SGLang 0.5.23 counts to </think> only
    # (managers/schedule_batch.py:2240-2259; the ids from parser/reasoning_parser.py:118), so all of the output.
    tool_ended = [1, 2, 3, section, 40, 41, 2]
    assert reasoning_agrees(tool_ended, think, len(tool_ended)) is True
    assert reasoning_agrees(tool_ended, think, 4) is False
    assert reasoning_agrees(ended, think, 0) is None and reasoning_agrees(ended, think, None) is None  # none counted
