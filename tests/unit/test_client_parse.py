import random

import pytest

from tokenmill_runner.client import RetryPolicy
from tokenmill_runner.results import Generation, GenerationFailure, Retry, parse_generation


def body(output_ids, completion, finish):
    return {"text": "x", "output_ids": output_ids,
            "meta_info": {"id": "r", "finish_reason": finish, "prompt_tokens": 3,
                          "completion_tokens": completion, "e2e_latency": 1.5}}


def test_stop_generation_is_parsed():
    result = parse_generation(body([4, 5, 9], 3, {"type": "stop", "matched": 9}), "s", 2)
    assert result == Generation([4, 5, 9], 3, 3, "stop", 9, 1.5, 2, "s")


def test_length_finish():
    result = parse_generation(body([4] * 5, 5, {"type": "length", "length": 5}), "s", 1)
    assert result.finish_reason == "length" and result.matched_stop is None


def test_prompt_tokens_prepended_by_old_sglang_is_caught():
    result = parse_generation(body([1, 2, 3, 4, 5, 9], 1, {"type": "stop", "matched": 9}), "s", 1)
    assert isinstance(result, GenerationFailure) and result.reason == "output_mismatch"
    assert "v0.5.5" in result.message


def test_abort_is_retried():
    with pytest.raises(Retry, match="aborted"):
        parse_generation(body([], 0, {"type": "abort", "message": "retracted"}), "s", 1)


def test_backoff_grows_and_is_capped():
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=8.0)
    rng = random.Random(1)
    for attempt, cap in [(1, 1.0), (2, 2.0), (3, 4.0), (6, 8.0)]:
        delays = [policy.delay(attempt, rng) for _ in range(200)]
        assert max(delays) <= cap and max(delays) > cap * 0.8
