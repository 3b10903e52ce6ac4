"""What the runner reads from /server_info and which requests it refuses before sending (server_info.py,
request_fit.py). The /server_info shape is SGLang's own: ServerArgs fields, the scheduler's status,
max_total_num_tokens and max_req_input_len (0.5.9 managers/scheduler.py:3144; 0.5.23 managers/scheduler.py:1946),
one internal state per data-parallel scheduler (0.5.9 managers/scheduler.py:2650-2661), and version (0.5.9
entrypoints/http_server.py:593-610)."""

import pytest

from tokenmill_runner.facts.server_info import ServerFacts, UnsupportedServer, runnable_requests
from tokenmill_runner.render.request_fit import ServerLimits


def server_info(version, context=None, pool=200_000, max_input=None, dp=1, slots=512, passed_slots=None,
                page_size=1):
    max_req_len = min((context or 10**9) - 1, pool - 1)
    return {
        "context_length": context, "max_running_requests": passed_slots, "page_size": page_size,
        "status": "ready", "max_total_num_tokens": pool,
        "max_req_input_len": max_input if max_input is not None else max_req_len - 5,
        "internal_states": [{"effective_max_running_requests_per_dp": slots,
                             "memory_usage": {"token_capacity": pool}} for _ in range(dp)],
        "version": version,
    }


def facts(version, **kwargs):
    return ServerFacts.read("http://s", server_info(version, **kwargs))


def test_facts_from_server_info_per_release():
    one = facts("0.5.23", context=32768, pool=100_000)
    assert one.release.version == "0.5.23" and one.max_req_len == 32767 and one.slots == 512
    dp = facts("0.5.9", pool=70_000, dp=8, slots=64)
    assert dp.slots == 8 * 64 and dp.kv_pools == (70_000,) * 8, "each attention-DP scheduler has its own"


def test_slots_fall_back_to_what_was_passed_then_to_a_small_default():
    info = server_info("0.5.9", passed_slots=300)
    info["internal_states"] = [{}]
    assert ServerFacts.read("u", info).slots == 300
    info["max_running_requests"] = None
    assert ServerFacts.read("u", info).slots is None
    assert runnable_requests([ServerFacts.read("u", info)], 2, 100.0) == 2 * 256


def test_runnable_requests_are_bound_by_slots_or_by_the_kv_pool():
    assert runnable_requests([facts("0.5.23", slots=100, pool=100_000)], 3, 100.0) == 300
    assert runnable_requests([facts("0.5.23", slots=100, pool=5_000)], 1, 100.0) == 50


def test_a_release_that_corrupts_output_ids_is_refused_at_the_start():
    # 0.5.0rc0-0.5.4.post2 prepend prompt tokens to output_ids (sgl-project/sglang#17240, fixed by #12628).
    with pytest.raises(UnsupportedServer, match="0.5.4.post2"):
        facts("0.5.4.post2")
    assert facts("0.5.8").release.version == "0.5.8"


def test_unknown_versions_get_no_release_facts():
    assert facts("1.2.3-custom").release is None
    assert facts("0.9.0").release is None


def limits(version, context, pool=10**6, page_size=1):
    return ServerLimits.of(context, [facts(version, context=context, pool=pool, page_size=page_size)])


def test_the_context_rule_at_equality_follows_the_release_without_the_scheduler_limit():
    # prompt + max_new_tokens == context: refused (>=) through 0.5.10.post1 (managers/tokenizer_manager.py:815),
    # accepted (>) from 0.5.11 (managers/tokenizer_manager.py:845).
    old = ServerLimits(1000, context_rule=">=")
    new = ServerLimits(1000, context_rule=">")
    assert "refuses" in old.misfit(400, 600) and old.misfit(400, 599) is None
    assert new.misfit(400, 600) is None and new.misfit(400, 601) is not None
    assert limits("0.5.10.post1", 1000).context_rule == ">=" and limits("0.5.11", 1000).context_rule == ">"


def test_the_scheduler_would_cut_max_new_tokens_two_below_the_context_so_that_is_refused():
    # max_new_tokens is clamped to max_req_len - prompt - 1 with max_req_len = min(context - 1, pool - 1)
    # (0.5.23 managers/scheduler.py:2714): on 0.5.23 a request reaching context - 1 tokens is silently cut.
    fit = limits("0.5.23", 1000)
    assert fit.most_new_tokens(400) == 598
    assert fit.misfit(400, 598) is None
    why = fit.misfit(400, 599)
    assert "silently cut maxNewTokens to 598" in why and "context length 1000" in why


def test_a_kv_pool_smaller_than_the_context_limits_prompts_and_outputs():
    # max_req_input_len = min(context - 1, pool - 1) - 5 (0.5.23 managers/tp_worker.py:572); a prompt that long or
    # longer is aborted with 400 (0.5.23 managers/utils.py:272).
    fit = limits("0.5.23", 32768, pool=4000)
    assert "fewer than 3994" in fit.misfit(3994, 1) and "KV pool holds 4000" in fit.misfit(3994, 1)
    assert fit.misfit(3000, 998) is None and "KV pool 4000" in fit.misfit(3000, 999)


def test_from_0_5_21_an_empty_pool_must_hold_the_request_in_whole_pages():
    # pool - prompt rounded up to pages - one page - 1 (0.5.23 mem_cache/allocator/base.py:88-105).
    paged = limits("0.5.21", 4096, pool=4096, page_size=64)
    assert paged.most_new_tokens(100) == 4096 - 128 - 64 - 1
    unpaged = limits("0.5.20", 4096, pool=4096, page_size=64)
    assert unpaged.most_new_tokens(100) == 4095 - 100 - 1


def test_the_strictest_replica_and_rule_win():
    both = ServerLimits.of(8000, [facts("0.5.23", context=8000, pool=5000), facts("0.5.10.post1", context=8000)])
    assert both.context_rule == ">=" and both.max_req_len == 4999 and both.release == "0.5.10.post1/0.5.23"
    unknown = ServerLimits.of(8000, [facts("custom", context=8000)])
    assert unknown.context_rule == ">=" and unknown.release is None


def test_a_prompt_as_long_as_the_context_is_refused_whatever_the_rest():
    assert "not less than the context length 1000" in ServerLimits(1000).misfit(1000, 0)
