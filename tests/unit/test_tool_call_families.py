"""A regenerated turn's tool call, put back into the history, renders through each family's own template in the
form the family's parser reads back (tests/fixtures/tokenizers: the families' published tokenizer files and
templates). Arguments go to the template as JSON objects, as SGLang's chat API passes history calls (v0.5.23
entrypoints/openai/serving_chat.py:198-214), or as the model's text where the template concatenates strings
(DeepSeek-R1)."""

from __future__ import annotations

import pytest

from tests.reference.families import BY_NAME, VARIANTS, Variant
from tokenmill_runner.generate.conversation import Answer, Conversation, start
from tokenmill_runner.generate.tool_calls import ToolCall, parse_tool_calls
from tokenmill_runner.prepare import call_format_problem
from tokenmill_runner.render.pretokenize import PromptEncoder, load_tokenizer
from tokenmill_runner.source.prompts import Prompt

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SOURCE = Prompt(1, "s1", [
    {"role": "user", "content": "Weather in Porto?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Porto"}'}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "18 C"},
    {"role": "assistant", "content": "It is 18 C."}], TOOLS)
# Families whose templates render an assistant's calls with markers (Llama 3.1 writes bare JSON between headers).
FAMILIES = [v for v in VARIANTS if not v.name.startswith("llama")]


@pytest.mark.parametrize("variant", FAMILIES, ids=lambda v: v.name)
def test_the_model_call_in_the_history_renders_as_the_family_writes_calls(variant: Variant) -> None:
    tokenizer = load_tokenizer(str(variant.path), variant.trust_remote_code)
    encoder = PromptEncoder(tokenizer)
    conversation = start(SOURCE)
    assert isinstance(conversation, Conversation)
    # Kimi's call ids are functions.NAME:IDX (what its parser returns); other families get call_<turn>_<index>;
    # Mistral's template wants 9-character ids, so the test gives those.
    call_id = "functions.get_weather:0" if "kimi" in variant.name else ("a1b2c3d4e" if "mistral" in variant.name
                                                                        else None)
    conversation.advance(Answer("", None, [ToolCall("get_weather", '{"city": "Lisbon"}', call_id)]), "stop")
    rendered = encoder.render(conversation.next_prompt(), variant.kwargs)
    if not isinstance(rendered, str):
        rendered = encoder.render(conversation.next_prompt(arguments_as_text=True), variant.kwargs)
    if isinstance(rendered, list):  # mistral_common renders to ids whatever tokenize says
        rendered = tokenizer.decode(rendered, skip_special_tokens=False)
    assert isinstance(rendered, str), rendered
    history = rendered[rendered.index("Weather in Porto?"):rendered.index("18 C")]
    calls = parse_tool_calls(history)
    assert [(c.name, c.parsed_arguments()) for c in calls] == [("get_weather", {"city": "Lisbon"})], history


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_every_fixture_family_writes_calls_that_read_back_so_all_turns_may_start(variant: Variant) -> None:
    encoder = PromptEncoder(load_tokenizer(str(variant.path), variant.trust_remote_code))
    assert call_format_problem(encoder, variant.kwargs, "d", variant.family) is None


def test_all_turns_is_refused_at_start_for_a_template_whose_calls_no_parser_reads() -> None:
    tokenizer = load_tokenizer(str(BY_NAME["qwen3"].path))
    # A family tokenmill has no parser for: calls written as <<call NAME ARGS>> (ChatML otherwise)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<<call {{ c.function.name }} {{ c.function.arguments | tojson }}>>{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    why = call_format_problem(PromptEncoder(tokenizer), {}, "M1_tools", "acme_lm")
    assert why is not None and "M1_tools" in why and "acme_lm" in why and "<<call get_weather" in why
    assert "last-turn" in why
