"""The runner renders a chat to the very text transformers' apply_chat_template renders, skipping its copies only for
plain JSON (render/chat_render.py); anything else goes through apply_chat_template itself, errors included.
tests/unit/test_tokenizer_families.py holds the ids of both ways to each family's reference."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.reference.families import FIXTURES, PROMPTS
from tokenmill_runner.render.chat_render import ChatRenderer, is_plain
from tokenmill_runner.render.content_format import flatten
from tokenmill_runner.render.pretokenize import PromptEncoder, load_tokenizer

# The families whose tokenizer is transformers' own class (remote code and mistral_common have their own calls).
FAMILIES = ["qwen3", "llama-3.1", "deepseek-r1", "gpt-oss", "qwen3-coder", "glm-4.5", "deepseek-v3.1",
            "deepseek-v3.2"]
KWARGS: dict[str, list[dict[str, Any]]] = {"qwen3": [{}, {"enable_thinking": False}],
                                            "llama-3.1": [{}, {"date_string": "14 Mar 2025"}],
                                            "gpt-oss": [{}, {"reasoning_effort": "high"}]}


class Counted:
    """A tokenizer whose apply_chat_template calls are counted (everything else is the tokenizer's)."""

    def __init__(self, tokenizer: Any) -> None:
        self.calls = 0
        self._tokenizer = tokenizer
        original = tokenizer.apply_chat_template

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        tokenizer.apply_chat_template = counted  # on the instance: the class's own method is what is compared


def rendered(call: Any) -> str:
    try:
        return str(call())
    except Exception as error:  # noqa: BLE001 - both ways must refuse alike
        return f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_plain_chat_renders_as_apply_chat_template_without_calling_it(family: str) -> None:
    tokenizer = load_tokenizer(str(FIXTURES / family), False)
    encoder = PromptEncoder(tokenizer)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    expected = {}
    for kwargs in KWARGS.get(family, [{}]):
        for row in rows:
            messages = flatten(row["messages"], encoder.content_format)
            expected[row["sample_id"], str(kwargs)] = rendered(lambda m=messages, r=row, k=kwargs: (
                tokenizer.apply_chat_template(m, tools=r.get("tools"), add_generation_prompt=True, tokenize=False,
                                              **k)))
    counter = Counted(tokenizer)
    for kwargs in KWARGS.get(family, [{}]):
        for row in rows:
            messages = flatten(row["messages"], encoder.content_format)
            got = rendered(lambda m=messages, r=row, k=kwargs: encoder.renderer.render(m, r.get("tools"), k))
            assert got == expected[row["sample_id"], str(kwargs)], (family, row["sample_id"], kwargs)
    assert counter.calls == 0  # every fixture prompt is plain JSON: none went through the slow way
    assert sum(not text.startswith(("TemplateError", "TypeError", "ValueError")) for text in expected.values()) >= 8


def test_what_is_not_plain_json_goes_through_apply_chat_template() -> None:
    tokenizer = load_tokenizer(str(FIXTURES / "qwen3"), False)
    renderer = ChatRenderer(tokenizer)
    counter = Counted(tokenizer)
    cases: list[tuple[Any, Any, dict[str, Any]]] = [
        ([{"role": "user", "content": "hi", "sent": datetime(2026, 12, 6, tzinfo=UTC)}], None, {}),  # "<datetime>"
        ([{"role": "user", "content": ("a", "tuple")}], None, {}),
        ([["role", "user"]], None, {}),  # not a dict: transformers' TypeError
        ([{"role": "user", "content": "hi"}], ["not a schema"], {}),  # transformers' ValueError
        ([{"role": "user", "content": "hi"}], None, {"enable_thinking": datetime(2026, 1, 1)}),
        ([], None, {}),  # an empty chat: transformers' ValueError
    ]
    for messages, tools, kwargs in cases:
        got = rendered(lambda m=messages, t=tools, k=kwargs: renderer.render(m, t, k))
        want = rendered(lambda m=messages, t=tools, k=kwargs: tokenizer.apply_chat_template(
            m, tools=t, add_generation_prompt=True, tokenize=False, **k))
        assert got == want, (messages, tools, kwargs)
    assert counter.calls == 2 * len(cases)


def test_plain_json_is_exactly_the_standard_library_types() -> None:
    assert is_plain({"a": [1, 2.5, True, None, "x", {"b": []}]}) and is_plain(None)
    assert not is_plain({1: "int key"})
    assert not is_plain([("tuple",)])

    class Text(str):
        pass

    assert not is_plain([Text("a str subclass")])
