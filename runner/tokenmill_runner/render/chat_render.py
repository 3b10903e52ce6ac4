"""A chat rendered to text as transformers' apply_chat_template(tokenize=False) renders it, without its per-call
copies.

For a short chat apply_chat_template spent about two thirds of its time outside the template (44 us, of which the
template's own render was 16, on the demo model; hack/bench/bench_chat_render.py): every message, tool and variable
is copied twice (objects to dicts, then everything to plain JSON types so that the sandbox never sees a rich
object), and the special tokens map is rebuilt. The runner's chats are plain JSON already (read from JSONL or
Parquet, flattened for the template), and for plain JSON those copies are equal to what they copy. So for a chat that is plain JSON this
does only what is left, as transformers 5.24.0 does it (pinned in pyproject.toml; tokenization_utils_base.py
`apply_chat_template` and utils/chat_template_utils.py `render_jinja_template`): the template `get_chat_template`
picks (a `tool_use` one when tools are given), top-level None values dropped from each message
(`_normalize_chat_messages`), reasoning fields aliased by transformers' own `_alias_reasoning_fields`, the template
compiled by its own cached `_compile_jinja_template` (the same immutable sandbox, filters and globals), and
`**special_tokens_map, **kwargs` as the template's variables. Anything else (a value that is not plain JSON, a
tokenizer with its own apply_chat_template such as remote code) goes through apply_chat_template itself.
tests/unit/test_chat_render.py holds both ways to the same text, tests/unit/test_tokenizer_families.py to each
family's reference ids.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_SCALARS = (str, int, float, bool)


def is_plain(value: Any) -> bool:
    """Whether `value` is JSON as the standard library builds it: dicts with str keys, lists, str, int, float, bool
    and None, exactly those types (a subclass, a tuple, a datetime or a numpy scalar is not)."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if item is None or kind in _SCALARS:
            continue
        if kind is dict:
            if any(type(key) is not str for key in item):
                return False
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
        else:
            return False
    return True


class ChatRenderer:
    """`render(messages, tools, kwargs)`: the tokenizer's apply_chat_template(..., add_generation_prompt=True,
    tokenize=False), skipping its copies for a plain JSON chat where the tokenizer's apply_chat_template is
    transformers' own."""

    def __init__(self, tokenizer: Any) -> None:
        # transformers is imported where a tokenizer is: a second of start-up that not every import of render needs
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.utils.chat_template_utils import _alias_reasoning_fields, _compile_jinja_template

        self._alias, self._compile = _alias_reasoning_fields, _compile_jinja_template
        self.tokenizer = tokenizer
        own = (isinstance(tokenizer, PreTrainedTokenizerBase)
               and type(tokenizer).apply_chat_template is PreTrainedTokenizerBase.apply_chat_template
               and type(tokenizer).get_chat_template is PreTrainedTokenizerBase.get_chat_template)
        special = dict(tokenizer.special_tokens_map) if own else {}
        self._direct = own and is_plain(special)
        self._special = special
        self._templates: dict[bool, Callable[..., str]] = {}  # by whether tools are given

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any]) -> str:
        if not (self._direct and messages and all(type(message) is dict for message in messages)
                and (tools is None or all(type(tool) is dict for tool in tools))
                and is_plain(messages) and is_plain(tools) and is_plain(kwargs)):
            # As it answers: mistral_common's returns ids whatever `tokenize` says (its callers decode them).
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False, **kwargs)
        template = self._templates.get(tools is not None)
        if template is None:
            compiled = self._compile(self.tokenizer.get_chat_template(None, tools))
            template = self._templates[tools is not None] = compiled.render
        chat = self._alias([{key: value for key, value in message.items() if value is not None}
                            for message in messages])
        return template(messages=chat, tools=tools, documents=None, add_generation_prompt=True,
                        **{**self._special, **kwargs})
