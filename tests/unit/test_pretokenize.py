import pytest

from tokenmill_runner.render.pretokenize import PromptEncoder, TokenizerError, describe_tokenizer
from tokenmill_runner.source.prompts import Prompt, RowError

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_generation_prompt_with_tools_ends_with_start_of_reasoning(tokenizer):
    prompt = Prompt(1, "a", [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Weather in Paris?"}], TOOLS)
    [ids] = PromptEncoder(tokenizer).encode_batch([prompt])
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == "<think>"
    assert "tool_declare" in tokenizer.decode(ids)


def test_batch_ids_equal_apply_chat_template_token_for_token(tokenizer):
    prompts = [
        Prompt(1, "a", [{"role": "user", "content": "What is 2 + 2? Explain."}], None),
        Prompt(2, "b", [{"role": "system", "content": "You call tools."},
                        {"role": "user", "content": "Weather in Paris, in celsius?"}], TOOLS),
        Prompt(3, "c", [{"role": "user", "content": "book it"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "call_0", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                        {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
                        {"role": "user", "content": "ünïcödé ✓ 天气"}], TOOLS),
    ]
    encoded = PromptEncoder(tokenizer).encode_batch(prompts)
    for prompt, ids in zip(prompts, encoded, strict=True):
        expected = tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        assert ids == expected


def test_template_failure_is_a_row_error_and_the_batch_goes_on(tokenizer):
    bad = Prompt(4, "bad", [{"role": "narrator", "content": "x"}], None)
    good = Prompt(5, "good", [{"role": "user", "content": "x"}], None)
    first, second = PromptEncoder(tokenizer).encode_batch([bad, good])
    assert isinstance(first, RowError) and first.reason == "template_error" and "line 4" in first.message
    assert isinstance(second, list) and second


def test_special_tokens_are_looked_up_not_hard_coded(tokenizer, demo_model):
    info = describe_tokenizer(tokenizer, "demo", "</think>", None, str(demo_model))
    assert info.reasoning_end_id == tokenizer.convert_tokens_to_ids("</think>")
    assert info.tool_call_token == "<|tool_calls_section_begin|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in info.eos_token_ids
    assert info.model_context_length == 32768


def test_wrong_end_token_is_explained(tokenizer, demo_model):
    with pytest.raises(TokenizerError, match="endToken '</reasoning>' is not a single token"):
        describe_tokenizer(tokenizer, "demo", "</reasoning>", None, str(demo_model))
