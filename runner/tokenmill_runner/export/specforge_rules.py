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
"""

from __future__ import annotations

import json
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

    @property
    def keys(self) -> frozenset[str]:
        return THINKING_KEYS if self.thinking_parser else GENERAL_KEYS


HELPFUL = "You are a helpful assistant."

# Templates that render through the model's own chat template with the general or thinking parser. Not listed:
# gpt-oss (harmony parser), glm-5.2 (its own parser), longcat/inkling (other span patterns), kimi-k3 (XTML renderer).
SPECFORGE_TEMPLATES: dict[str, SpecForgeTemplate] = {t.name: t for t in (
    SpecForgeTemplate("llama4", 102, HELPFUL, False, False),
    SpecForgeTemplate("qwen", 112, HELPFUL, False, False),
    SpecForgeTemplate("lfm", 122, "", False, False),
    SpecForgeTemplate("phi4", 142, HELPFUL, False, False),
    SpecForgeTemplate("deepseek-r1-distill", 184, None, False, False),
    SpecForgeTemplate("qwen3-thinking", 194, HELPFUL, True, True),
    SpecForgeTemplate("qwen3-instruct", 207, HELPFUL, False, False),
    SpecForgeTemplate("qwen3-next-thinking", 218, HELPFUL, True, True),
    SpecForgeTemplate("kimi-k2-thinking", 230, HELPFUL, True, True),
    SpecForgeTemplate("kimi-k2-instruct", 242, HELPFUL, False, False),
    SpecForgeTemplate("deepseek-v3", 271, HELPFUL, False, False),
    SpecForgeTemplate("deepseek-v2", 284, None, False, False),
    SpecForgeTemplate("deepseek-v32", 304, "", True, True),
    SpecForgeTemplate("qwen3.5", 361, "", True, True),
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
