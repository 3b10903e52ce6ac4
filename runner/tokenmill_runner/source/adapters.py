"""Input adapters: a row in one of the common dataset layouts becomes the OpenAI `messages` the runner renders. Pure.

Layouts (`spec.datasets[].input.format`):
- `messages`: OpenAI chat messages whose content is a string (tokenmill's own layout);
- `openai`: the same, content may also be a list of parts; text parts are kept as a list of `{"type": "text"}`
  parts and flattened by `content_format.py` exactly as SGLang's chat endpoint does for the model's template;
  image/audio/video parts are refused (tokenmill sends token ids only);
- `sharegpt`: `conversations: [{from, value}]` (human/user, gpt/assistant, system, tool/observation,
  function_call as in LLaMA-Factory's ShareGPT layout);
- `prompt`: one string column, a single user turn;
- `auto`: decided per row: a messages column, else ShareGPT conversations, else a prompt column.
A `system` column, when a row has one, goes before a conversation that has no system message of its own.
Every refusal is a `RowError` that names the line and the field to fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

FORMATS = ("auto", "messages", "sharegpt", "openai", "prompt")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "observation": "tool", "function_call": "assistant"}
TEXT_PARTS = ("text", "input_text")  # the part types SGLang treats as text (0.5.23 parser/jinja_template_utils.py:303)


@dataclass(frozen=True)
class RowLayout:
    """Which layout the rows have and which column holds what (the spec's `input`)."""

    format: str = "auto"
    messages: str | None = None  # None: "messages" (and "conversations" for ShareGPT)
    prompt: str = "prompt"
    system: str = "system"
    id: str = "sample_id"
    tools: str = "tools"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"input format {self.format!r} is not one of {', '.join(FORMATS)}")

    def columns(self) -> tuple[str, ...]:
        """Every column a row of this layout is read from: a Parquet reader decodes these and no other."""
        prompt = (self.prompt,) if self.format in ("prompt", "auto") else ()
        return (*self.conversation_columns(), *prompt, self.system, self.id, self.tools)

    def conversation_columns(self) -> tuple[str, ...]:
        if self.messages is not None:
            return (self.messages,)
        if self.format == "sharegpt":
            return ("conversations",)
        if self.format == "auto":
            return ("messages", "conversations")
        return ("messages",)


DEFAULT_LAYOUT = RowLayout()


class AdapterError(ValueError):
    """A row that the layout cannot read: `reason` is the stable code, the message says what to fix."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def to_messages(row: dict[str, Any], layout: RowLayout, where: str) -> list[Any]:
    """The row's conversation as OpenAI messages (not yet validated message by message; `prompts.py` does that).
    `where` starts every error message ("line 7 (sample a)")."""
    kind, column, value = _locate(row, layout, where)
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise AdapterError("invalid_prompt", f"{where}: '{column}' must be a non-empty string")
        messages: list[Any] = [{"role": "user", "content": value}]
    else:
        if not isinstance(value, list) or not value:
            raise AdapterError("empty_messages", f"{where}: '{column}' must be a non-empty list")
        messages = _from_sharegpt(value, column, where) if kind == "sharegpt" else list(value)
        if kind == "openai":
            messages = [_text_parts(message, f"{where}: {column}[{i}]") for i, message in enumerate(messages)]
    return _with_system(row, layout, messages, where)


def _locate(row: dict[str, Any], layout: RowLayout, where: str) -> tuple[str, str, Any]:
    """(kind, column, value): kind is messages, openai, sharegpt or prompt."""
    if layout.format == "prompt":
        return "prompt", layout.prompt, _required(row, layout.prompt, where)
    for column in layout.conversation_columns():
        if row.get(column) is not None:
            value = row[column]
            if layout.format in ("messages", "openai", "sharegpt"):
                return layout.format, column, value
            return ("sharegpt" if _looks_sharegpt(value) else "openai"), column, value
    if layout.format == "auto" and row.get(layout.prompt) is not None:
        return "prompt", layout.prompt, row[layout.prompt]
    tried = [*layout.conversation_columns(), *([layout.prompt] if layout.format == "auto" else [])]
    return "messages", tried[0], _required(row, tried[0], where, tried)


def _required(row: dict[str, Any], column: str, where: str, tried: list[str] | None = None) -> Any:
    if row.get(column) is None:
        names = " or ".join(f"'{name}'" for name in (tried or [column]))
        raise AdapterError("missing_messages", f"{where}: no {names} field (name the column in "
                                               "spec.datasets[].input.fields, or set input.format)")
    return row[column]


def _looks_sharegpt(value: Any) -> bool:
    first = value[0] if isinstance(value, list) and value else None
    return isinstance(first, dict) and "from" in first and "role" not in first


def _from_sharegpt(turns: list[Any], column: str, where: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for index, turn in enumerate(turns):
        at = f"{where}: {column}[{index}]"
        if not isinstance(turn, dict):
            raise AdapterError("invalid_message", f"{at} must be an object with 'from' and 'value'")
        speaker = turn.get("from")
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise AdapterError("unknown_role", f"{at}.from is {speaker!r}; use one of {', '.join(SHAREGPT_ROLES)}")
        value = turn.get("value")
        if not isinstance(value, str):
            kind = "missing" if "value" not in turn else f"a {type(value).__name__}"
            raise AdapterError("non_string_content", f"{at}.value is {kind}; ShareGPT turns need a string")
        if speaker == "function_call":
            messages.append({"role": "assistant", "content": None, "tool_calls": _tool_calls(value, at)})
        else:
            messages.append({"role": role, "content": value})
    return messages


def _tool_calls(value: str, at: str) -> list[dict[str, Any]]:
    """A function_call turn's value: a JSON object {name, arguments} or a list of them (LLaMA-Factory's layout)."""
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError:
        raise AdapterError("invalid_tool_calls", f"{at}.value of a function_call turn must be JSON "
                                                 "{\"name\": ..., \"arguments\": ...}") from None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise AdapterError("invalid_tool_calls", f"{at}.value: each function call needs a string 'name'")
        out.append({"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}})
    return out


def _text_parts(message: Any, at: str) -> Any:
    """A message whose content is a list of parts, checked: text parts only, kept as a list for `content_format`."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = []
    for index, part in enumerate(message["content"]):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
            continue
        if kind in TEXT_PARTS:
            raise AdapterError("non_string_content", f"{at}.content[{index}].text must be a string")
        raise AdapterError("unsupported_content", f"{at}.content[{index}] is a {kind!r} part; tokenmill sends text "
                                                  "prompts only (drop image/audio/video parts, or the row)")
    return {**message, "content": parts}


def _with_system(row: dict[str, Any], layout: RowLayout, messages: list[Any], where: str) -> list[Any]:
    system = row.get(layout.system)
    if system is None or system == "":
        return messages
    if not isinstance(system, str):
        raise AdapterError("invalid_system", f"{where}: '{layout.system}' must be a string")
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") == "system":
        return messages  # the conversation's own system message wins
    return [{"role": "system", "content": system}, *messages]
