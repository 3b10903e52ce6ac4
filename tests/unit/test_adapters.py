"""Input adapters: ShareGPT, OpenAI multi-part content and plain prompts become the messages the template renders;
bad rows name the line and the field."""

from __future__ import annotations

import json

import orjson
import pytest

from tests.reference.families import FIXTURES
from tokenmill_runner.render.content_format import template_content_format
from tokenmill_runner.render.pretokenize import PromptEncoder, load_tokenizer
from tokenmill_runner.source.adapters import RowLayout
from tokenmill_runner.source.prompts import Prompt, RowError, parse_line

SHAREGPT = {"id": "sg-1", "system": "Be terse.", "conversations": [
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
    {"from": "observation", "value": "18 C"},
    {"from": "gpt", "value": "18 C and sunny."},
    {"from": "user", "value": "And tomorrow?"},
], "tools": '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]'}


def test_sharegpt_turns_become_openai_messages_with_the_system_column_first() -> None:
    prompt = parse_line(3, orjson.dumps(SHAREGPT), RowLayout(format="sharegpt", id="id"))
    assert isinstance(prompt, Prompt), prompt
    assert prompt.sample_id == "sg-1"
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert prompt.messages[0]["content"] == "Be terse."
    call = prompt.messages[2]
    assert call["content"] is None
    assert call["tool_calls"] == [{"type": "function",
                                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert prompt.tools is not None and prompt.tools[0]["function"]["name"] == "get_weather"


def test_auto_reads_sharegpt_messages_and_prompt_rows_alike() -> None:
    layout = RowLayout()
    rows = [{"conversations": [{"from": "human", "value": "hi"}]},
            {"messages": [{"role": "user", "content": "hi"}]},
            {"prompt": "hi"}]
    for line, row in enumerate(rows, start=1):
        prompt = parse_line(line, row, layout)
        assert isinstance(prompt, Prompt), prompt
        assert prompt.messages == [{"role": "user", "content": "hi"}]
        assert prompt.sample_id == f"L{line}"


def test_field_mapping_names_the_columns() -> None:
    layout = RowLayout(format="prompt", prompt="question", system="sys", id="uid")
    prompt = parse_line(1, {"uid": 7, "question": "2+2?", "sys": "math tutor"}, layout)
    assert isinstance(prompt, Prompt)
    assert prompt.sample_id == "7"
    assert prompt.messages == [{"role": "system", "content": "math tutor"}, {"role": "user", "content": "2+2?"}]
    chat = parse_line(2, {"dialog": [{"role": "user", "content": "x"}]}, RowLayout(messages="dialog"))
    assert isinstance(chat, Prompt) and chat.messages == [{"role": "user", "content": "x"}]


def test_a_conversation_with_its_own_system_message_keeps_it() -> None:
    row = {"system": "column", "messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "x"}]}
    prompt = parse_line(1, row)
    assert isinstance(prompt, Prompt) and [m["content"] for m in prompt.messages] == ["own", "x"]


@pytest.mark.parametrize(("row", "layout", "reason", "fragment"), [
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}, RowLayout(format="sharegpt"),
     "unknown_role", "conversations[1].from is 'bot'"),
    ({"conversations": [{"from": "human", "value": ["a"]}]}, RowLayout(format="sharegpt"),
     "non_string_content", "conversations[0].value is a list"),
    ({"conversations": [{"from": "function_call", "value": "get_weather(Paris)"}]}, RowLayout(format="sharegpt"),
     "invalid_tool_calls", "conversations[0].value of a function_call turn must be JSON"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": "x.png"}}]}]},
     RowLayout(format="openai"), "unsupported_content", "messages[0].content[1] is a 'image_url' part"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}, RowLayout(format="messages"),
     "non_string_content", "set input.format: openai"),
    ({"question": "x"}, RowLayout(), "missing_messages", "no 'messages' or 'conversations' or 'prompt' field"),
    ({"prompt": ""}, RowLayout(format="prompt"), "invalid_prompt", "'prompt' must be a non-empty string"),
    ({"prompt": "x", "system": 3}, RowLayout(), "invalid_system", "'system' must be a string"),
    ({"uid": 1.5, "prompt": "x"}, RowLayout(id="uid"), "invalid_sample_id", "uid must be a string or an integer"),
])
def test_bad_rows_name_the_line_and_the_field(row, layout, reason, fragment) -> None:
    error = parse_line(9, row, layout)
    assert isinstance(error, RowError)
    assert (error.reason, error.line) == (reason, 9)
    assert "line 9" in error.message and fragment in error.message, error.message


def test_template_content_format_follows_sglang() -> None:
    # SGLang detect_jinja_template_content_format (0.5.23 parser/jinja_template_utils.py:83): media words or a loop
    # over message content -> "openai" (the list is passed); anything else -> "string" (parts joined with " ").
    qwen3 = json.loads((FIXTURES / "qwen3" / "tokenizer_config.json").read_text())["chat_template"]
    kimi = (FIXTURES / "kimi-k2.5" / "chat_template.jinja").read_text()
    assert template_content_format(qwen3) == "string"
    assert template_content_format(kimi) == "openai"
    assert template_content_format("{% for p in message['content'] %}{{ p.text }}{% endfor %}") == "openai"
    assert template_content_format("{{ messages[0]['content'] }}") == "string"


MULTI_PART = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]


def test_multi_part_text_renders_as_sglang_renders_it_for_a_string_template() -> None:
    # Qwen3's template renders list content as "" (tokenizer_config.json: `{%- set content = '' %}`): SGLang joins the
    # text parts with one space first (0.5.23 parser/jinja_template_utils.py:335), and so does tokenmill.
    tokenizer = load_tokenizer(str(FIXTURES / "qwen3"))
    encoder = PromptEncoder(tokenizer)
    prompt = parse_line(1, {"messages": MULTI_PART}, RowLayout(format="openai"))
    assert isinstance(prompt, Prompt)
    [ids] = encoder.encode_batch([prompt])
    joined = tokenizer.apply_chat_template([{"role": "user", "content": "Hello world"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    assert ids == joined


def test_multi_part_text_goes_to_a_list_template_as_a_list() -> None:
    # Kimi-K2.5's template loops over the parts and concatenates them (chat_template.jinja:6-11); SGLang passes the
    # list through for it (content format "openai"), so the prompt reads "Helloworld".
    tokenizer = load_tokenizer(str(FIXTURES / "kimi-k2.5"), trust_remote_code=True)
    prompt = parse_line(1, {"messages": MULTI_PART}, RowLayout(format="openai"))
    assert isinstance(prompt, Prompt)
    [ids] = PromptEncoder(tokenizer).encode_batch([prompt])
    assert "Helloworld" in tokenizer.decode(ids)
