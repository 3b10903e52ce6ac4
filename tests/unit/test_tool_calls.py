"""Tool calls read from a model's own output text, per family, and the rule that pairs them with the source's.

Formats as the families' chat templates write an assistant's calls and SGLang's detectors read them
(v0.5.23 python/sglang/srt/function_call/kimik2_detector.py:47, qwen25_detector.py, deepseekv3_detector.py,
deepseekv31_detector.py:47-51, deepseekv32_detector.py:85-100, qwen3_coder_detector.py:27-42,
glm4_moe_detector.py:175-183, glm47_moe_detector.py:316-324, mistral_detector.py, gpt_oss_detector.py; the same
detectors ship in v0.5.9)."""

from __future__ import annotations

import pytest

from tokenmill_runner.generate.tool_calls import (
    ToolCall,
    calls_start,
    divergence,
    has_call_opener,
    parse_tool_calls,
    same_call,
    source_calls,
)

KIMI = ('I will look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Porto"}<|tool_call_end|><|tool_call_begin|>functions.convert:1<|tool_call_argument_begin|>'
        '{"amount": 3}<|tool_call_end|><|tool_calls_section_end|>')
QWEN = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Porto"}}\n</tool_call>'
DEEPSEEK = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Porto"}\n```'
            '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Porto"}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Porto"}'
HARMONY = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Porto"}<|call|>'
DEEPSEEK_V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Porto"}<｜tool▁call▁end｜>'
                '<｜tool▁calls▁end｜>')
DSML = ('Let me check.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Porto</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '</｜DSML｜function_calls>')
DSML_JSON = '<｜DSML｜function_calls><｜DSML｜invoke name="get_weather">{"city": "Porto"}</｜DSML｜invoke></｜DSML｜function_calls>'
QWEN3_CODER = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nPorto\n</parameter>\n</function>\n'
               '</tool_call>')
GLM45 = '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Porto</arg_value>\n</tool_call>'
GLM47 = '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Porto</arg_value></tool_call>'
DSML_V4 = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
           'Porto</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
DSML_V41 = ('<｜DSML｜ calls><｜DSML｜ invoke name="get_weather"><｜DSML｜ parameter name="city" string="true">Porto'
            '</｜DSML｜ parameter></｜DSML｜ invoke></｜DSML｜ calls>')
MINIMAX = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Porto</parameter>\n</invoke>\n'
           '</minimax:tool_call>')


@pytest.mark.parametrize("text", [QWEN, DEEPSEEK, MISTRAL, MISTRAL_V11, HARMONY, DEEPSEEK_V31, DSML, DSML_JSON,
                                  QWEN3_CODER, GLM45, GLM47, DSML_V4, DSML_V41, MINIMAX])
def test_each_family_yields_the_function_and_its_json_arguments(text: str) -> None:
    (call,) = parse_tool_calls(text)
    assert call.name == "get_weather"
    assert call.parsed_arguments() == {"city": "Porto"}


def test_kimi_calls_keep_their_order_and_the_ids_the_format_carries() -> None:
    calls = parse_tool_calls(KIMI)
    assert [(c.name, c.id, c.parsed_arguments()) for c in calls] == [
        ("get_weather", "functions.get_weather:0", {"city": "Porto"}), ("convert", "functions.convert:1", {"amount": 3})]
    assert KIMI[:calls_start(KIMI)] == "I will look."


def test_text_without_markers_has_no_calls() -> None:
    assert parse_tool_calls("The weather is fine; no tool needed.") == []
    assert calls_start("plain") is None


def test_source_calls_accept_arguments_as_string_or_object() -> None:
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"type": "function", "function": {"name": "g", "arguments": {"y": 2}}}]}
    assert [(c.name, c.parsed_arguments(), c.id) for c in source_calls(message)] == [("f", {"x": 1}, "a"),
                                                                                      ("g", {"y": 2}, None)]


def test_same_function_with_the_same_argument_names_pairs_whatever_the_values() -> None:
    assert same_call(ToolCall("f", '{"city": "Lisbon"}'), ToolCall("f", '{"city": "Porto"}'))
    assert not same_call(ToolCall("f", '{"city": "Porto", "unit": "c"}'), ToolCall("f", '{"city": "Porto"}'))
    assert not same_call(ToolCall("g", '{"city": "Porto"}'), ToolCall("f", '{"city": "Porto"}'))
    assert not same_call(ToolCall("f", '{"city": '), ToolCall("f", '{"city": "Porto"}'))  # invalid JSON never pairs


def test_divergence_names_what_the_model_did_instead() -> None:
    source = [ToolCall("f", '{"a": 1}')]
    assert divergence([ToolCall("f", '{"a": 2}')], source) is None
    assert "without a tool call" in (divergence([], source) or "")
    assert "g" in (divergence([ToolCall("g", "{}")], source) or "")
    assert "answered without a tool call" in (divergence([ToolCall("g", "{}")], []) or "")
    assert divergence([], []) is None
    assert divergence([ToolCall("f", '{"a": 1}')] * 2, source) is not None


def test_llama_answers_that_are_only_a_call_and_kimi_bare_ids() -> None:
    (call,) = parse_tool_calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Porto"}}<|eom_id|>')
    assert (call.name, call.parsed_arguments()) == ("get_weather", {"city": "Porto"})
    assert parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')[1].name == "b"
    assert parse_tool_calls("The JSON {\"name\": \"x\"} appears mid-answer") == []
    (bare,) = parse_tool_calls('<|tool_calls_section_begin|><|tool_call_begin|>get_weather:3<|tool_call_argument_begin|>'
                               '{}<|tool_call_end|><|tool_calls_section_end|>')
    assert (bare.name, bare.id) == ("get_weather", "get_weather:3")


def test_xml_formats_type_values_that_read_as_json_and_keep_the_rest_as_text() -> None:
    coder = ('<tool_call>\n<function=book>\n<parameter=seats>\n2\n</parameter>\n<parameter=note>\nwindow, please\n'
             '</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
             '<function=get_time>\n</function>\n</tool_call>')
    assert [(c.name, c.parsed_arguments()) for c in parse_tool_calls(coder)] == [
        ("book", {"seats": 2, "note": "window, please", "tags": ["a", "b"]}), ("get_time", {})]
    glm = ('I will book.<tool_call>book\n<arg_key>seats</arg_key>\n<arg_value>2</arg_value>\n<arg_key>note</arg_key>\n'
           '<arg_value>aisle</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>')
    calls = parse_tool_calls(glm)
    assert [(c.name, c.parsed_arguments()) for c in calls] == [("book", {"seats": 2, "note": "aisle"}),
                                                               ("get_time", {})]
    assert glm[:calls_start(glm)] == "I will book."
    # DSML: string="false" values are JSON, string="true" values text, stripped (deepseekv32_detector.py:160-168)
    dsml = ('<｜DSML｜function_calls><｜DSML｜invoke name="book"><｜DSML｜parameter name="seats" string="false">2'
            '</｜DSML｜parameter><｜DSML｜parameter name="code" string="true"> 007 </｜DSML｜parameter></｜DSML｜invoke>'
            '<｜DSML｜invoke name="get_time"/></｜DSML｜function_calls>')
    assert [(c.name, c.parsed_arguments()) for c in parse_tool_calls(dsml)] == [("book", {"seats": 2, "code": "007"}),
                                                                              ("get_time", {})]


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>",  # cut JSON
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nPorto",  # never closed
    "<tool_call>the weather in <b>Porto</b></tool_call>",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\"",
    '<｜DSML｜function_calls><｜DSML｜invoke name="get_weather">Porto</｜DSML｜invoke></｜DSML｜function_calls>',
    '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Porto',
])
def test_an_opened_call_that_does_not_parse_is_told_apart_from_no_call(text: str) -> None:
    assert parse_tool_calls(text) == []
    assert has_call_opener(text)
    assert not has_call_opener("The weather is fine; no tool needed.")
