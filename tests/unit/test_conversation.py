"""Multi-turn regeneration rules (mode all-turns): which turns a source asks for, what history each turn sees, when
a conversation stops. The demo tokenizer (examples/demo-model, Kimi's special tokens) reads generated turns back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill_runner.generate.conversation import Answer, Conversation, history_exact, read_answer, start
from tokenmill_runner.generate.tool_calls import ToolCall
from tokenmill_runner.render.pretokenize import load_tokenizer
from tokenmill_runner.source.prompts import Prompt, RowError

DEMO_MODEL = Path(__file__).resolve().parents[2] / "examples" / "demo-model"
WEATHER = {"name": "get_weather", "arguments": '{"city": "Porto"}'}


def source(*messages: dict) -> Prompt:
    return Prompt(1, "s1", list(messages), None)


def tool_turn() -> Prompt:
    return source(
        {"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "src0", "type": "function", "function": WEATHER}]},
        {"role": "tool", "tool_call_id": "src0", "content": "18 C"},
        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"},
        {"role": "assistant", "content": "A2"})


def started(prompt: Prompt) -> Conversation:
    conversation = start(prompt)
    assert isinstance(conversation, Conversation)
    return conversation


def test_each_turn_sees_the_model_answers_and_the_source_tool_result_under_the_model_call_id() -> None:
    conversation = started(tool_turn())
    assert [m["content"] for m in conversation.next_prompt().messages] == ["S", "U1"]
    conversation.advance(Answer("", "thinking", [ToolCall("get_weather", '{"city": "Lisbon"}', "functions.get_weather:0")]),
                         "stop")
    history = conversation.next_prompt().messages
    assert history[2]["tool_calls"][0]["id"] == "functions.get_weather:0"
    assert history[2]["reasoning_content"] == "thinking"
    assert history[3] == {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C"}
    conversation.advance(Answer("mine 1", None, []), "stop")
    assert [m["content"] for m in conversation.next_prompt().messages][-2:] == ["mine 1", "U2"]
    assert "A1" not in [m["content"] for m in conversation.next_prompt().messages]
    conversation.advance(Answer("mine 2", None, []), "stop")
    assert conversation.stop_reason == "complete" and conversation.turn == 3


@pytest.mark.parametrize(("answer", "finish", "reason"), [
    (Answer("no call", None, []), "stop", "diverged_no_call"),
    (Answer("", None, [ToolCall("get_time", "{}")]), "stop", "tool_divergence"),
    (Answer("", None, [ToolCall("get_weather", '{"town": "Porto"}')]), "stop", "tool_divergence"),
    (Answer("cut", None, []), "length", "truncated"),
])
def test_a_turn_that_cannot_continue_stops_the_conversation_with_its_reason(answer: Answer, finish: str,
                                                                           reason: str) -> None:
    conversation = started(tool_turn())
    conversation.advance(answer, finish)
    assert conversation.stop_reason == reason and conversation.stop_detail


def test_a_call_where_the_source_answered_in_prose_stops_it() -> None:
    conversation = started(source({"role": "user", "content": "U"}, {"role": "assistant", "content": "A"},
                                  {"role": "user", "content": "U2"}))
    conversation.advance(Answer("", None, [ToolCall("f", "{}")]), "stop")
    assert conversation.stop_reason == "tool_divergence"


def test_a_trailing_user_message_gets_one_more_turn_and_a_single_prompt_one_turn() -> None:
    conversation = started(source({"role": "user", "content": "U"}, {"role": "assistant", "content": "A"},
                                  {"role": "user", "content": "U2"}))
    assert conversation.targets == [1, -1]
    assert started(source({"role": "user", "content": "only"})).targets == [-1]


def test_rows_that_cannot_be_regenerated_turn_by_turn_name_the_problem() -> None:
    leading = start(source({"role": "assistant", "content": "A"}, {"role": "user", "content": "U"}))
    assert isinstance(leading, RowError) and leading.reason == "no_user_turn" and "line 1" in leading.message
    twice = start(source({"role": "user", "content": "U"}, {"role": "assistant", "content": "A"},
                         {"role": "assistant", "content": "B"}))
    assert isinstance(twice, RowError) and "messages[1] and messages[2]" in twice.message


def test_history_exact_means_the_prompt_extends_the_previous_prompt_and_output() -> None:
    assert history_exact([1, 2], [3, 4], [1, 2, 3, 4, 5])
    assert not history_exact([1, 2], [3, 4], [1, 2, 4, 5])  # the template dropped a token (e.g. reasoning)


def test_a_generated_kimi_turn_reads_back_as_reasoning_content_and_calls() -> None:
    tokenizer = load_tokenizer(str(DEMO_MODEL))
    text = ("Need the weather.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Porto"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    ids = tokenizer.encode(text, add_special_tokens=False)
    end = ids.index(tokenizer.convert_tokens_to_ids("</think>"))
    tool = tokenizer.convert_tokens_to_ids("<|tool_calls_section_begin|>")
    decode = lambda i, skip: tokenizer.decode(list(i), skip_special_tokens=skip)  # noqa: E731
    answer = read_answer(ids, "stop", end, False, tool, decode)
    assert (answer.reasoning, answer.content) == ("Need the weather.", "Checking.")
    assert [(c.name, c.id) for c in answer.calls] == [("get_weather", "functions.get_weather:0")]
    # Kimi-K2.5 may leave reasoning by opening the section: that token then belongs to the answer
    direct = tokenizer.encode(text.replace("</think>Checking.", ""), add_special_tokens=False)
    answer = read_answer(direct, "stop", direct.index(tool), True, tool, decode)
    assert answer.reasoning == "Need the weather." and answer.content == "" and len(answer.calls) == 1


def test_a_gpt_oss_turn_reads_back_by_channel() -> None:
    # harmony as GPT-OSS writes it (tests/fixtures/tokenizers/gpt-oss: the analysis channel, then a call on the
    # commentary channel, or a final answer)
    tokenizer = load_tokenizer(str(DEMO_MODEL.parents[1] / "tests" / "fixtures" / "tokenizers" / "gpt-oss"))
    decode = lambda i, skip: tokenizer.decode(list(i), skip_special_tokens=skip)  # noqa: E731
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    call = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Porto"}<|call|>')
    ids = tokenizer.encode(call, add_special_tokens=False)
    answer = read_answer(ids, "stop", ids.index(end), False, None, decode)
    assert (answer.reasoning, answer.content) == ("Need weather.", "")
    assert [(c.name, c.parsed_arguments()) for c in answer.calls] == [("get_weather", {"city": "Porto"})]
    final = tokenizer.encode("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
                             "<|message|>It is 18 C.<|return|>", add_special_tokens=False)
    answer = read_answer(final, "stop", final.index(end), False, None, decode)
    assert (answer.reasoning, answer.content, answer.calls) == ("Easy.", "It is 18 C.", [])
    assert answer.message(0)["thinking"] == "Easy."


def parallel_calls(*results: dict) -> Prompt:
    calls = [{"id": "c_weather", "type": "function", "function": WEATHER},
             {"id": "c_time", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Porto"}'}}]
    return source({"role": "user", "content": "Weather and time in Porto?"},
                  {"role": "assistant", "content": "", "tool_calls": calls}, *results,
                  {"role": "assistant", "content": "Sunny, 14:05."})


MODEL_CALLS = [ToolCall("get_weather", '{"city": "Porto"}'), ToolCall("get_time", '{"city": "Porto"}')]


def test_parallel_results_answered_out_of_order_reach_the_call_with_their_id() -> None:
    conversation = started(parallel_calls({"role": "tool", "tool_call_id": "c_time", "content": "14:05"},
                                          {"role": "tool", "tool_call_id": "c_weather", "content": "sunny, 21C"}))
    conversation.advance(Answer("", None, MODEL_CALLS), "stop")
    history = conversation.next_prompt().messages
    calls = {call["id"]: call["function"]["name"] for call in history[1]["tool_calls"]}
    answered = {calls[m["tool_call_id"]]: m["content"] for m in history if m["role"] == "tool"}
    assert answered == {"get_weather": "sunny, 21C", "get_time": "14:05"}


def test_a_result_for_an_id_the_source_never_called_stops_with_tool_divergence() -> None:
    conversation = started(parallel_calls({"role": "tool", "tool_call_id": "c_time", "content": "14:05"},
                                          {"role": "tool", "tool_call_id": "c_other", "content": "sunny, 21C"}))
    conversation.advance(Answer("", None, MODEL_CALLS), "stop")
    assert conversation.stop_reason == "tool_divergence" and "c_other" in (conversation.stop_detail or "")


def test_results_without_ids_go_by_position_and_extra_results_are_left_out() -> None:
    conversation = started(parallel_calls({"role": "tool", "content": "sunny, 21C"}, {"role": "tool", "content": "14:05"},
                                          {"role": "tool", "tool_call_id": "stale", "content": "extra"}))
    conversation.advance(Answer("", None, MODEL_CALLS), "stop")
    tools = [m for m in conversation.next_prompt().messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tools] == [("call_0_0", "sunny, 21C"), ("call_0_1", "14:05")]
    short = started(parallel_calls({"role": "tool", "content": "sunny, 21C"}))
    short.advance(Answer("", None, MODEL_CALLS), "stop")
    assert short.stop_reason == "no_tool_result"


def test_an_opened_call_that_no_parser_reads_stops_as_unparsed_not_as_no_call() -> None:
    tokenizer = load_tokenizer(str(DEMO_MODEL.parents[1] / "tests" / "fixtures" / "tokenizers" / "qwen3"))
    decode = lambda i, skip: tokenizer.decode(list(i), skip_special_tokens=skip)  # noqa: E731
    ids = tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call><|im_end|>',
                           add_special_tokens=False)
    answer = read_answer(ids, "stop", None, False, tokenizer.convert_tokens_to_ids("<tool_call>"), decode)
    assert answer.calls == [] and answer.unparsed is not None
    for prompt in (tool_turn(), source({"role": "user", "content": "U"})):  # where the source called, or answered
        conversation = started(prompt)
        conversation.advance(answer, "stop")
        assert conversation.stop_reason == "unparsed_tool_call" and "<tool_call>" in (conversation.stop_detail or "")
