"""What SpecForge 0.2.0 does to a conversation before its chat template renders it. Pure.

Facts from SpecForge 0.2.0 (PyPI wheel; `specforge/data/*` equals GitHub sgl-project/SpecForge a6b6b0230009), cited
as `SF <file>:<line>`; the rules are re-stated here, not copied:
- the first message, if it is a system message, is kept as {role, content}; otherwise the SpecForge template's
  `system_prompt`, when non-empty, is inserted as a system message (SF data/parse.py:202-212);
- leading non-user messages after that are dropped; a `tool` message not after an assistant/tool message, or an
  `assistant` message not after a user/tool message, ends the conversation there (SF data/parse.py:214-239);
- each message keeps only the parser's keys: role, content, tool_calls for the general parser, plus
  reasoning_content, name, tool_call_id for the thinking parser (SF data/parse.py:24, 470-477); `tool_calls` given
  as a JSON string is parsed, each call keeps id, type and function {name, arguments}, string arguments are parsed
  to a dict (SF data/parse.py:40-103); role/content may also be spelled from/value (SF data/parse.py:105-117);
- the thinking parser passes `enable_thinking=True` to the template when the SpecForge template says so
  (SF data/parse.py:503-504); the render is apply_chat_template(tokenize=False, add_generation_prompt=False,
  tools=tools or None, **the row's other columns) (SF data/parse.py:136-144, 479-491; SF data/preprocessing.py:293).
- the loss mask: the rendered (or pre-formatted) text is tokenized without special tokens; every match of
  `assistant_header` + the shortest text up to and including `end_of_turn_token` (or the end) is supervised, only
  the last match with `train_only_last_turn`; the token span of a match is the length of the tokenized text before
  it and through it; then every occurrence of an `ignore_token` is unsupervised again (SF data/parse.py:179-185,
  266-347; the headers per template in SF data/template.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GENERAL_KEYS = frozenset({"role", "content", "tool_calls"})
THINKING_KEYS = GENERAL_KEYS | {"reasoning_content", "name", "tool_call_id"}


@dataclass(frozen=True)
class SpecForgeTemplate:
    """The parts of a SpecForge `ChatTemplate` registration that change what is rendered."""

    name: str
    line: int  # of its TEMPLATE_REGISTRY.register in SF data/template.py
    system_prompt: str | None
    thinking_parser: bool  # parser_type "thinking": reasoning_content reaches the chat template
    enable_thinking: bool
    assistant_header: str
    end_of_turn: str
    ignore: tuple[str, ...] = ()

    @property
    def keys(self) -> frozenset[str]:
        return THINKING_KEYS if self.thinking_parser else GENERAL_KEYS


HELPFUL = "You are a helpful assistant."

# Templates that render through the model's own chat template with the general or thinking parser. Not listed:
# gpt-oss (harmony parser), glm-5.2 (its own parser), longcat/inkling (other span patterns), kimi-k3 (XTML renderer).
# deepseek-r1-distill is left out: its end_of_turn_token is None, which SpecForge's mask pattern cannot escape.
IM = ("<|im_start|>assistant\n", "<|im_end|>\n")
KIMI = ("<|im_assistant|>assistant<|im_middle|>", "<|im_end|>")
DEEPSEEK = ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")
SPECFORGE_TEMPLATES: dict[str, SpecForgeTemplate] = {t.name: t for t in (
    SpecForgeTemplate("llama4", 102, HELPFUL, False, False, "<|header_start|>assistant<|header_end|>\n\n", "<|eot|>"),
    SpecForgeTemplate("qwen", 112, HELPFUL, False, False, *IM),
    SpecForgeTemplate("lfm", 122, "", False, False, *IM),
    SpecForgeTemplate("phi4", 142, HELPFUL, False, False, "<|im_start|>assistant<|im_sep|>", "<|im_end|>"),
    SpecForgeTemplate("qwen3-thinking", 194, HELPFUL, True, True, *IM),
    SpecForgeTemplate("qwen3-instruct", 207, HELPFUL, False, False, *IM, ("<think>\n\n</think>\n\n",)),
    SpecForgeTemplate("qwen3-next-thinking", 218, HELPFUL, True, True, "<|im_start|>assistant\n<think>\n",
                      "<|im_end|>\n"),
    SpecForgeTemplate("kimi-k2-thinking", 230, HELPFUL, True, True, *KIMI),
    SpecForgeTemplate("kimi-k2-instruct", 242, HELPFUL, False, False, *KIMI),
    SpecForgeTemplate("deepseek-v3", 271, HELPFUL, False, False, *DEEPSEEK),
    SpecForgeTemplate("deepseek-v2", 284, None, False, False, "Assistant: ", "<｜end▁of▁sentence｜>"),
    SpecForgeTemplate("deepseek-v32", 304, "", True, True, *DEEPSEEK),
    SpecForgeTemplate("qwen3.5", 361, "", True, True, "<|im_start|>assistant\n<think>\n", "<|im_end|>\n"),
)}


class UnknownTemplate(ValueError):
    pass


def specforge_template(name: str) -> SpecForgeTemplate:
    try:
        return SPECFORGE_TEMPLATES[name]
    except KeyError:
        raise UnknownTemplate(f"--specforge-template {name!r} is not one tokenmill can check; use one of "
                              f"{', '.join(sorted(SPECFORGE_TEMPLATES))}") from None


def _normalized(message: dict[str, Any]) -> dict[str, Any]:
    role = message.get("role", message.get("from", ""))
    role = {"human": "user", "gpt": "assistant"}.get(role, role)
    content = message.get("content") or message.get("value") or ""
    normalized = {**message, "role": role, "content": content}
    normalized.pop("from", None)
    normalized.pop("value", None)
    return normalized


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    clean: dict[str, Any] = {"id": call.get("id", ""), "type": call.get("type", "function")}
    function = call.get("function", {})
    if isinstance(function, dict):
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        clean["function"] = {"name": function.get("name", ""), "arguments": arguments}
    return clean


def _sanitized(message: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    clean = {key: value for key, value in message.items() if key in keys}
    calls = clean.get("tool_calls")
    if isinstance(calls, str):
        try:
            calls = json.loads(calls)
        except json.JSONDecodeError:
            clean.pop("tool_calls")
            return clean
    if isinstance(calls, list):
        clean["tool_calls"] = [_tool_call(call) for call in calls if isinstance(call, dict)]
    return clean


@dataclass(frozen=True)
class Prepared:
    messages: list[dict[str, Any]]
    inserted_system_prompt: bool
    template_kwargs: dict[str, Any]


def prepare(conversation: list[dict[str, Any]], template: SpecForgeTemplate,
            row_kwargs: dict[str, Any]) -> Prepared:
    """The messages and template arguments SpecForge renders for one conversations-file row."""
    remaining = [_normalized(message) for message in conversation]
    messages: list[dict[str, Any]] = []
    inserted = False
    if remaining and remaining[0]["role"] == "system":
        messages.append({"role": "system", "content": remaining[0]["content"]})
        remaining = remaining[1:]
    elif template.system_prompt:
        messages.append({"role": "system", "content": template.system_prompt})
        inserted = True
    while remaining and remaining[0]["role"] != "user":
        remaining = remaining[1:]
    for index, message in enumerate(remaining):
        previous = remaining[index - 1]["role"] if index else None
        if index and message["role"] == "tool" and previous not in ("assistant", "tool"):
            break
        if index and message["role"] == "assistant" and previous not in ("user", "tool"):
            break
        messages.append(_sanitized(message, template.keys))
    kwargs = dict(row_kwargs)
    if template.thinking_parser:
        kwargs["add_special_tokens"] = False
        if template.enable_thinking:
            kwargs["enable_thinking"] = True
    return Prepared(messages, inserted, kwargs)


def loss_mask(encode: Callable[[str], list[int]], text: str, template: SpecForgeTemplate,
              train_only_last_turn: bool = True, tokens: int | None = None) -> list[int]:
    """The loss mask SpecForge builds for a rendered or pre-formatted text (SF data/parse.py:266-347); `tokens`:
    the text's length in tokens, when the caller has already tokenized it."""
    mask = [0] * (len(encode(text)) if tokens is None else tokens)
    pattern = re.escape(template.assistant_header) + r"([\s\S]*?(?:" + re.escape(template.end_of_turn) + "|$))"
    matches = list(re.finditer(pattern, text, re.DOTALL))
    for match in matches[-1:] if train_only_last_turn else matches:
        _set(mask, encode, text, match.start(1), match.end(1), 1)
    for token in template.ignore:
        start = text.find(token)
        while start != -1:
            _set(mask, encode, text, start, start + len(token), 0)
            start = text.find(token, start + len(token))
    return mask


def _set(mask: list[int], encode: Callable[[str], list[int]], text: str, begin: int, end: int, value: int) -> None:
    # Character offsets become token offsets by tokenizing the text before them, as SpecForge does.
    first, last = (min(len(encode(text[:offset])), len(mask)) for offset in (begin, end))
    mask[first:last] = [value] * max(last - first, 0)


@dataclass(frozen=True)
class MaskDifference:
    """Where SpecForge's mask and the target's (1 on exactly the generated tokens) disagree, in tokens."""

    prompt_supervised: int  # prompt tokens SpecForge trains on (a generation prompt's <think>, history answers)
    output_unsupervised: int  # generated tokens SpecForge does not train on
    suffix_supervised: int  # tokens after the generated ones (a template's end-of-turn suffix) it trains on
    first: int | None  # first index where they differ

    @property
    def tokens(self) -> int:
        return self.prompt_supervised + self.output_unsupervised + self.suffix_supervised


def mask_difference(target: list[int], trainer: list[int], prompt_tokens: int) -> MaskDifference:
    """Compare the target's mask with the trainer's over the trainer's ids (which may add a suffix)."""
    wanted = target + [0] * max(len(trainer) - len(target), 0)
    differing = [i for i, (want, got) in enumerate(zip(wanted, trainer, strict=False)) if want != got]
    return MaskDifference(
        prompt_supervised=sum(1 for i in differing if i < prompt_tokens),
        output_unsupervised=sum(1 for i in differing if prompt_tokens <= i < len(target)),
        suffix_supervised=sum(1 for i in differing if i >= len(target)),
        first=differing[0] if differing else None)
