"""The simulator's pure parts: length profiles, token structure, the flags (the capacity model is in
test_sim_capacity.py, the wire format per release in test_sim_protocol.py)."""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from tokenmill_sim.config import SimConfig, add_arguments, config_from_args
from tokenmill_sim.loader import load_model
from tokenmill_sim.model import LoadedModel
from tokenmill_sim.profiles import AUTO, CLARIFICATION_SHARE, PROFILES, SWE_PROMPT_TOKENS, choose_profile
from tokenmill_sim.tokens import OutputGenerator, SamplingParams, declared_tools, prompt_digest

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
                   "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search_restaurants", "description": "Find restaurants",
    "parameters": {"type": "object", "properties": {"cuisine": {"type": "string"}, "max_results": {
        "type": "integer"}}, "required": ["cuisine", "max_results"]}}}


# ---- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(demo_model: Path) -> LoadedModel:
    return load_model(str(demo_model))


@pytest.fixture(scope="module")
def hf_tokenizer(demo_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model), local_files_only=True)


def generator(model: LoadedModel, seed: int = 0, profile: str = AUTO) -> OutputGenerator:
    return OutputGenerator(model.vocab, model.bank, model.encode, model.decode, seed, profile)


def chat_ids(tokenizer: Any, text: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def random_prompts(count: int, seed: int, length: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[5] + [rng.randrange(16, 1100) for _ in range(length)] + [8, 14] for _ in range(count)]


def quantile(values: list[int], share: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


# ---- profiles ---------------------------------------------------------------------------------------------------
def test_profile_figures_match_the_seeds() -> None:
    glaive = PROFILES["glaive"]
    assert glaive.quantile(0.5) == pytest.approx(470, rel=0.05)
    assert glaive.quantile(0.9) == pytest.approx(3700, rel=0.06)
    assert glaive.quantile(0.1) == pytest.approx(113, rel=0.15)
    assert 0.025 <= 1 - glaive.cdf(10240) <= 0.035  # ~3 % run past the B1 cap
    reasoning = PROFILES["reasoning"]
    assert reasoning.quantile(0.5) == pytest.approx(2500, rel=0.02)
    assert reasoning.quantile(0.9) == pytest.approx(9000, rel=0.05)
    assert PROFILES["swe"].quantile(0.5) == pytest.approx(1200, rel=0.02)
    for profile in PROFILES.values():
        assert sum(c.weight for c in profile.components) == pytest.approx(1.0)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_draws_follow_the_profile(name: str) -> None:
    profile = PROFILES[name]
    rng = random.Random(7)
    draws = [profile.draw(rng) for _ in range(20_000)]
    for share in (0.25, 0.75, 0.9):
        assert quantile(draws, share) == pytest.approx(profile.quantile(share), rel=0.08)
    beyond = sum(d > 10240 for d in draws) / len(draws)
    assert beyond == pytest.approx(1 - profile.cdf(10240), abs=0.006)
    assert min(draws) >= profile.min_tokens and max(draws) <= profile.max_tokens


def test_generated_lengths_over_many_prompts_and_seeds(model: LoadedModel) -> None:
    lengths: list[int] = []
    kinds: list[str] = []
    for seed in range(3):
        gen = generator(model, seed, "glaive")
        for prompt in random_prompts(1500, seed + 50):
            lengths.append(len(gen.generate(prompt, SamplingParams(max_new_tokens=10240)).output_ids))
            kinds.append(gen.plan(prompt).kind)
    assert 330 <= statistics.median(lengths) <= 650  # the median sits between the two modes: it moves
    assert 3300 <= quantile(lengths, 0.9) <= 4300
    assert 0.02 <= sum(n == 10240 for n in lengths) / len(lengths) <= 0.045
    assert 0.5 * CLARIFICATION_SHARE <= kinds.count("clarification") / len(kinds) <= 2 * CLARIFICATION_SHARE
    assert 1150 <= statistics.mean(lengths) <= 1700


def test_auto_profile_follows_prompt_features(model: LoadedModel, hf_tokenizer: Any) -> None:
    assert choose_profile(AUTO, 100, declares_tools=True).name == "glaive"
    assert choose_profile(AUTO, SWE_PROMPT_TOKENS, declares_tools=False).name == "swe"
    assert choose_profile(AUTO, SWE_PROMPT_TOKENS - 1, declares_tools=False).name == "reasoning"
    assert choose_profile("swe", 10, declares_tools=True).name == "swe"
    gen = generator(model)
    assert gen.plan(chat_ids(hf_tokenizer, "Weather in Paris?", [WEATHER_TOOL])).profile == "glaive"
    assert gen.plan(chat_ids(hf_tokenizer, "Prove that 2 + 2 = 4.")).profile == "reasoning"
    assert gen.plan(chat_ids(hf_tokenizer, "fix this code: " + "x = 1\n" * 1000)).profile == "swe"


# ---- determinism --------------------------------------------------------------------------------------------------
def test_same_seed_and_prompt_give_the_same_output(model: LoadedModel) -> None:
    params = SamplingParams(max_new_tokens=20000)
    prompts = random_prompts(20, 1)
    first = [generator(model, 3).generate(p, params).output_ids for p in prompts]
    again = [generator(model, 3).generate(p, params).output_ids for p in prompts]
    other_seed = [generator(model, 4).generate(p, params).output_ids for p in prompts]
    assert first == again
    assert sum(a != b for a, b in zip(first, other_seed, strict=True)) >= 18
    assert len({tuple(ids) for ids in first}) == len(prompts)  # different prompts, different outputs
    assert prompt_digest(0, [1, 2]) != prompt_digest(0, [2, 1]) != prompt_digest(1, [2, 1])


def test_a_request_seed_draws_another_output_and_repeats_it(model: LoadedModel) -> None:
    # n samples of one prompt differ by their sampling_seed; the same seed gives the same output again, and a request
    # without one gets what it always got.
    prompts = random_prompts(10, 5)
    gen = generator(model, 3)

    def outputs(seed: int | None) -> list[list[int]]:
        return [gen.generate(p, SamplingParams(max_new_tokens=20000, sampling_seed=seed)).output_ids for p in prompts]

    assert outputs(11) == outputs(11)
    assert sum(a != b for a, b in zip(outputs(11), outputs(12), strict=True)) >= 9
    assert outputs(None) == [gen.generate(p, SamplingParams(max_new_tokens=20000)).output_ids for p in prompts]
    assert prompt_digest(3, [1, 2]) == prompt_digest(3, [1, 2], None) != prompt_digest(3, [1, 2], 0)


def test_a_cut_output_is_a_prefix_of_the_full_one(model: LoadedModel) -> None:
    gen = generator(model)
    for prompt in random_prompts(10, 2):
        full = gen.generate(prompt, SamplingParams(max_new_tokens=50_000)).output_ids
        for limit in (1, 7, len(full) // 2, len(full) - 1):
            assert gen.generate(prompt, SamplingParams(max_new_tokens=limit)).output_ids == full[:limit]


# ---- token structure ------------------------------------------------------------------------------------------
def test_reasoning_then_answer_then_eos(model: LoadedModel) -> None:
    gen = generator(model, profile="reasoning")
    eos, end = model.vocab.eos, model.vocab.think_end
    for prompt in random_prompts(200, 3):
        result = gen.generate(prompt, SamplingParams(max_new_tokens=100_000))
        ids = result.output_ids
        assert result.finish_reason == {"type": "stop", "matched": eos} and result.matched_stop == eos
        assert ids[-1] == eos and ids.count(eos) == 1
        assert ids.count(end) == 1 and 0 < ids.index(end) < len(ids) - 2
        assert not set(ids[:ids.index(end)]) & {eos, end, *(model.vocab.tool or {}).values()}
    text = gen.text(gen.generate(random_prompts(1, 4)[0], SamplingParams(max_new_tokens=100_000)), SamplingParams())
    assert re.fullmatch(r"[A-Za-z0-9 ,.:;?!'\-\n+=]+", text), text[:200]


def test_reasoning_share_follows_the_profile(model: LoadedModel) -> None:
    gen = generator(model, profile="reasoning")
    shares = []
    for prompt in random_prompts(200, 5):
        ids = gen.generate(prompt, SamplingParams(max_new_tokens=100_000)).output_ids
        if gen.plan(prompt).kind == "answer":
            shares.append(ids.index(model.vocab.think_end) / len(ids))
    low, high = PROFILES["reasoning"].reasoning_share
    assert low - 0.1 <= min(shares) and max(shares) <= high + 0.02
    assert statistics.mean(shares) == pytest.approx((low + high) / 2, abs=0.05)


def test_tool_calls_are_kimi_formatted_and_name_a_declared_tool(model: LoadedModel, hf_tokenizer: Any) -> None:
    gen = generator(model)
    tool = model.vocab.tool
    assert tool is not None
    calls = without_think_end = 0
    prompts = [chat_ids(hf_tokenizer, f"Plan a dinner number {i}", [WEATHER_TOOL, SEARCH_TOOL]) for i in range(150)]
    declared = {"get_weather": WEATHER_TOOL, "search_restaurants": SEARCH_TOOL}
    for prompt in prompts:
        ids = gen.generate(prompt, SamplingParams(max_new_tokens=100_000)).output_ids
        if tool["section_begin"] not in ids:
            continue
        calls += 1
        # Kimi-K2.5 sometimes leaves reasoning by opening the tool-call section without </think> (SGLang's
        # kimi_k2 reasoning parser accepts the section opener as the end of reasoning, KimiK2Detector).
        start = ids.index(tool["section_begin"])
        if model.vocab.think_end in ids:
            assert ids.index(model.vocab.think_end) == start - 1
        else:
            without_think_end += 1
        assert ids[-2] == tool["section_end"] and ids[-1] == model.vocab.eos
        section = model.decode(ids[start:-1], False)
        found = re.findall(r"<\|tool_call_begin\|>functions\.(\w+):(\d+)<\|tool_call_argument_begin\|>(.*?)"
                           r"<\|tool_call_end\|>", section)
        assert section.startswith("<|tool_calls_section_begin|><|tool_call_begin|>")
        assert found and [int(index) for _, index, _ in found] == list(range(len(found)))
        for name, _, arguments in found:
            schema = declared[name]["function"]["parameters"]
            assert set(schema["required"]) <= set(json.loads(arguments)) <= set(schema["properties"])
    assert 0.45 <= calls / len(prompts) <= 0.75  # ~60 % of prompts with tools answer with a call
    assert 0.15 <= without_think_end / calls <= 0.45  # ~30 % of calls leave reasoning without </think>


def test_tools_are_read_from_the_prompt(model: LoadedModel, hf_tokenizer: Any) -> None:
    ids = chat_ids(hf_tokenizer, "hi", [WEATHER_TOOL, SEARCH_TOOL])
    assert [t.name for t in declared_tools(ids, model.vocab, model.decode)] == ["get_weather", "search_restaurants"]
    assert declared_tools(chat_ids(hf_tokenizer, "hi"), model.vocab, model.decode) == ()
    # A user who merely types "tool_declare" declares nothing.
    assert declared_tools(chat_ids(hf_tokenizer, "tool_declare [1]"), model.vocab, model.decode) == ()


def test_max_new_tokens_truncates_even_mid_reasoning(model: LoadedModel) -> None:
    gen = generator(model, profile="reasoning")
    prompt = random_prompts(1, 6)[0]
    result = gen.generate(prompt, SamplingParams(max_new_tokens=20))
    assert len(result.output_ids) == 20 and model.vocab.think_end not in result.output_ids
    assert result.finish_reason == {"type": "length", "length": 20} and result.matched_stop is None
    empty = gen.generate(prompt, SamplingParams(max_new_tokens=0))
    assert empty.output_ids == [] and empty.finish_reason == {"type": "length", "length": 0}


def test_stop_token_ids_stop_at_the_first_match_and_keep_it(model: LoadedModel) -> None:
    gen = generator(model)
    end = model.vocab.think_end
    prompt = random_prompts(1, 7)[0]
    full = gen.generate(prompt, SamplingParams(max_new_tokens=100_000)).output_ids
    result = gen.generate(prompt, SamplingParams(max_new_tokens=100_000, stop_token_ids=frozenset({end})))
    assert result.output_ids == full[:full.index(end) + 1]
    assert result.finish_reason == {"type": "stop", "matched": end}
    word = full[3]  # an ordinary token stops too, at its first occurrence
    result = gen.generate(prompt, SamplingParams(max_new_tokens=100_000, stop_token_ids=frozenset({word, end})))
    assert result.output_ids == full[:full.index(word) + 1] and result.matched_stop == word


@pytest.mark.parametrize(("eos_at_cap", "finish"), [("length", "length"), ("stop", "stop")])
def test_eos_as_the_last_allowed_token(model: LoadedModel, eos_at_cap: str, finish: str) -> None:
    # Through 0.5.17 the length check runs before the stop-token check (0.5.9 managers/schedule_batch.py:1081-1086):
    # EOS sampled as the last allowed token finishes as `length`, EOS kept; from 0.5.18 it is `stop` (0.5.23
    # managers/schedule_batch.py:2034-2043).
    gen = OutputGenerator(model.vocab, model.bank, model.encode, model.decode, 0, AUTO, eos_at_cap)
    prompt = random_prompts(1, 7)[0]
    full = gen.generate(prompt, SamplingParams(max_new_tokens=100_000)).output_ids
    result = gen.generate(prompt, SamplingParams(max_new_tokens=len(full)))
    assert result.output_ids == full and full[-1] == model.vocab.eos
    assert result.finish_reason["type"] == finish


def test_ignore_eos_generates_exactly_max_new_tokens(model: LoadedModel) -> None:
    gen = generator(model)
    prompt = next(p for p in random_prompts(50, 8) if gen.plan(p).length < 1500)
    natural = gen.generate(prompt, SamplingParams(max_new_tokens=5000)).output_ids
    result = gen.generate(prompt, SamplingParams(max_new_tokens=5000, ignore_eos=True))
    assert len(result.output_ids) == 5000 and result.finish_reason == {"type": "length", "length": 5000}
    assert result.output_ids[:len(natural)] == natural  # the end token is generated, it just does not stop
    ignored = gen.generate(prompt, SamplingParams(max_new_tokens=300, ignore_eos=True,
                                                   stop_token_ids=frozenset({model.vocab.think_end})))
    assert len(ignored.output_ids) == 300  # ignore_eos disables every token stop


def test_text_matches_a_full_decode(model: LoadedModel, hf_tokenizer: Any) -> None:
    gen = generator(model)
    prompts = random_prompts(60, 9) + [chat_ids(hf_tokenizer, f"q{i}", [WEATHER_TOOL]) for i in range(20)]
    for prompt in prompts:
        natural = gen.generate(prompt, SamplingParams(max_new_tokens=100_000)).output_ids
        variants = [SamplingParams(max_new_tokens=100_000), SamplingParams(max_new_tokens=len(natural) // 2),
                    SamplingParams(max_new_tokens=100_000, no_stop_trim=True),
                    SamplingParams(max_new_tokens=100_000, skip_special_tokens=False),
                    SamplingParams(max_new_tokens=3000, ignore_eos=True),
                    SamplingParams(max_new_tokens=100_000, stop_token_ids=frozenset({natural[5]}))]
        for params in variants:
            result = gen.generate(prompt, params)
            trimmed = result.matched_stop is not None and not params.no_stop_trim
            ids = result.output_ids[:-1] if trimmed else result.output_ids
            assert gen.text(result, params) == hf_tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


def test_clarifications_are_short(model: LoadedModel) -> None:
    gen = generator(model)
    prompts = [p for p in random_prompts(800, 10) if gen.plan(p).kind == "clarification"]
    assert prompts
    for prompt in prompts:
        ids = gen.generate(prompt, SamplingParams(max_new_tokens=100_000)).output_ids
        assert 60 <= len(ids) <= 130 and ids[-1] == model.vocab.eos
        assert "?" in model.decode(ids[ids.index(model.vocab.think_end):], True)


# ---- flags --------------------------------------------------------------------------------------------------------
def test_every_config_field_has_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model-path", "m"])
    assert config_from_args(args) == SimConfig(model_path="m")
    assert (args.host, args.port) == ("127.0.0.1", 30000)
    argv = ["--model", "m", "--sglang-version", "0.5.9", "--seed", "3", "--max-running-requests", "7",
            "--max-total-tokens", "900", "--page-size", "16", "--context-length", "800", "--step-ms", "1.5",
            "--step-ms-per-request", "0.5", "--prefill-ms-per-1k-tokens", "2", "--time-scale", "100", "--profile",
            "swe", "--startup-seconds", "4", "--fault-503-rate", "0.1", "--fault-503-after-s", "3",
            "--fault-503-for-s", "2", "--fault-nan-rate", "0.05", "--fault-reset-rate", "0.2", "--fault-abort-rate",
            "0.3", "--fault-slow-rate", "0.4", "--fault-slow-seconds", "0.5", "--max-queued-requests", "9",
            "--api-key", "k", "--served-model-name", "kimi", "--host", "0.0.0.0", "--port", "1"]
    config = config_from_args(parser.parse_args(argv))
    flagged = {action.dest for action in parser._actions}
    assert {f.name for f in fields(SimConfig)} <= flagged
    assert config == SimConfig(
        "m", sglang_version="0.5.9", seed=3, max_running_requests=7, max_total_tokens=900, page_size=16,
        context_length=800, step_ms=1.5, step_ms_per_request=0.5, prefill_ms_per_1k_tokens=2.0, time_scale=100.0,
        profile="swe", startup_seconds=4.0, fault_503_rate=0.1, fault_503_after_s=3.0, fault_503_for_s=2.0,
        fault_nan_rate=0.05, fault_reset_rate=0.2, fault_abort_rate=0.3, fault_slow_rate=0.4,
        fault_slow_seconds=0.5, max_queued_requests=9, api_key="k", served_model_name="kimi")
    assert config.model_name == "kimi"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="profile"):
        SimConfig("m", profile="chat")
    with pytest.raises(ValueError, match="fault_abort_rate"):
        SimConfig("m", fault_abort_rate=2.0)
    with pytest.raises(ValueError, match="time_scale"):
        SimConfig("m", time_scale=0)
    with pytest.raises(ValueError, match="supported SGLang releases"):
        SimConfig("m", sglang_version="0.5.6")
    with pytest.raises(ValueError, match="not a release tokenmill knows"):
        SimConfig("m", sglang_version="0.4.0")


def test_typescript_tool_declarations_are_read_like_json_ones() -> None:
    # Kimi-K2.5's tokenizer code declares tools TypeScript-style (tests/fixtures/tokenizers/kimi-k2.5/
    # tool_declaration_ts.py); the simulator must still see which tools a prompt offers.
    from tokenmill_sim.tokens import typescript_tools

    text = ("# Tools\n\n## functions\nnamespace functions {\n// Get the weather.\ntype get_weather = (_: {\n"
            "  // City\n  location: string,\n  days?: number,\n  unit?: \"c\" | \"f\"\n}) => any;\n}\n")
    [tool] = typescript_tools(text)
    assert tool.name == "get_weather"
    assert tool.parameters == {"type": "object", "required": ["location"], "properties": {
        "location": {"type": "string"}, "days": {"type": "number"}, "unit": {"type": "string"}}}


# ---- conversations (mode all-turns) -------------------------------------------------------------------------------
def conversation_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def called(model: LoadedModel, ids: list[int]) -> list[str]:
    return re.findall(r"functions\.(\w+):\d+", model.decode(ids, False))


def test_a_user_message_naming_a_tool_gets_that_call_mostly_and_another_sometimes(model: LoadedModel,
                                                                                  hf_tokenizer: Any) -> None:
    gen = generator(model)
    outcomes: Counter[str] = Counter()
    for i in range(200):
        ids = conversation_ids(hf_tokenizer, [{"role": "user", "content": f"What's the weather in Porto, day {i}?"}],
                               [WEATHER_TOOL, SEARCH_TOOL])
        out = gen.generate(ids, SamplingParams(max_new_tokens=100_000)).output_ids
        names = called(model, out)
        outcomes[names[0] if names else "none"] += 1
        if names == ["get_weather"]:  # exactly the required arguments, as the source's call would have
            arguments = re.search(r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", model.decode(out, False))
            assert arguments and set(json.loads(arguments.group(1))) == {"city"}
        assert gen.generate(ids, SamplingParams(max_new_tokens=100_000)).output_ids == out  # deterministic
    share = outcomes["get_weather"] / 200
    assert 0.75 <= share <= 0.95, outcomes  # 15 % divergence (DIVERGENCE_SHARE), 2 % clarifications
    assert outcomes["search_restaurants"] >= 10, outcomes


def test_after_the_named_tool_answered_and_on_a_plain_follow_up_the_model_answers_without_a_call(
        model: LoadedModel, hf_tokenizer: Any) -> None:
    gen = generator(model)
    calls = 0
    for i in range(100):
        asked = [{"role": "user", "content": f"What's the weather in Porto, day {i}?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "functions.get_weather:0", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Porto"}'}}]},
                 {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C"}]
        follow_up = [*asked, {"role": "assistant", "content": "It is 18 C."}, {"role": "user", "content": "Thanks!"}]
        for messages in (asked, follow_up):
            out = gen.generate(conversation_ids(hf_tokenizer, messages, [WEATHER_TOOL, SEARCH_TOOL]),
                               SamplingParams(max_new_tokens=100_000)).output_ids
            calls += bool(called(model, out))
    assert calls == 0
