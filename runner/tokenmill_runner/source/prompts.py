"""Prompt rows validated one by one: a parsed row becomes a Prompt, or a RowError naming its line. Pure.

A row is `{"sample_id": ..., "messages": [{role, content, tool_calls?}], "tools": [...]?}`, or another layout that
`adapters.py` turns into one (ShareGPT, OpenAI multi-part content, a plain prompt; column names from the spec's
`input.fields`). A bad row becomes a `RowError` naming its line and what to fix; it never stops the stream. Reading
the rows is `reader.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ..store.work_split import WorkShare, id_hash
from .adapters import DEFAULT_LAYOUT, AdapterError, RowLayout, to_messages

__all__ = ["Prompt", "RowError", "belongs_to_worker", "duplicate_error", "id_hash", "parse_line", "validate_row"]

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Prompt:
    line: int  # 1-based line (JSONL) or row (Parquet) number in the source
    sample_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


@dataclass(frozen=True)
class RowError:
    line: int
    sample_id: str | None
    reason: str  # a stable code, counted in summaries and reports
    message: str  # what is wrong and what to do
    sample_index: int = 0  # with the line, the slot this error is the outcome of

    def as_record(self, dataset: str) -> dict[str, Any]:
        return {"dataset": dataset, "line": self.line, "sample_index": self.sample_index,
                "sample_id": self.sample_id, "reason": self.reason, "message": self.message}


def parse_line(line: int, raw: bytes | dict[str, Any], layout: RowLayout = DEFAULT_LAYOUT) -> Prompt | RowError:
    if isinstance(raw, dict):
        row = raw
    else:
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError as error:
            return RowError(line, None, "invalid_json", f"line {line}: not valid JSON ({error})")
    if not isinstance(row, dict):
        return RowError(line, None, "not_an_object", f"line {line}: expected a JSON object, got {type(row).__name__}")
    return validate_row(line, row, layout)


def _sample_id(line: int, row: dict[str, Any], column: str = "sample_id") -> str | RowError:
    value = row.get(column)
    if value is None:
        # Many public datasets have no ids; the line number is stable for an unchanged file.
        return f"L{line}"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return RowError(line, None, "invalid_sample_id",
                        f"line {line}: {column} must be a string or an integer, got {type(value).__name__}")
    text = str(value)
    if not text:
        return RowError(line, None, "invalid_sample_id", f"line {line}: {column} is empty")
    return text


def _message_error(line: int, sample_id: str, index: int, message: Any, parts_ok: bool) -> RowError | None:
    where = f"line {line} (sample {sample_id}): messages[{index}]"
    if not isinstance(message, dict):
        return RowError(line, sample_id, "invalid_message", f"{where} must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        return RowError(line, sample_id, "unknown_role",
                        f"{where}.role is {role!r}; use one of {', '.join(ROLES)}")
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        return None
    if parts_ok and isinstance(content, list):
        return None  # text parts, checked by the adapter
    if not isinstance(content, str):
        kind = "missing" if "content" not in message else f"a {type(content).__name__}"
        hint = " (set input.format: openai for lists of text parts)" if isinstance(content, list) else ""
        return RowError(line, sample_id, "non_string_content", f"{where}.content is {kind}; tokenmill needs a "
                        f"string{hint}")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        return RowError(line, sample_id, "invalid_tool_calls", f"{where}.tool_calls must be a list")
    return None


def validate_row(line: int, row: dict[str, Any], layout: RowLayout = DEFAULT_LAYOUT) -> Prompt | RowError:
    sample_id = _sample_id(line, row, layout.id)
    if isinstance(sample_id, RowError):
        return sample_id
    try:
        messages = to_messages(row, layout, f"line {line} (sample {sample_id})")
    except AdapterError as error:
        return RowError(line, sample_id, error.reason, str(error))
    parts_ok = layout.format != "messages"
    for index, message in enumerate(messages):
        if refused := _message_error(line, sample_id, index, message, parts_ok):
            return refused
    tools = row.get(layout.tools)
    if isinstance(tools, str):  # Parquet exports (and ShareGPT datasets) often keep tools as a JSON string
        try:
            tools = orjson.loads(tools)
        except orjson.JSONDecodeError:
            return RowError(line, sample_id, "invalid_tools",
                            f"line {line} (sample {sample_id}): {layout.tools} is not JSON")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        return RowError(line, sample_id, "invalid_tools",
                        f"line {line} (sample {sample_id}): '{layout.tools}' must be a list of objects")
    return Prompt(line, sample_id, messages, tools or None)


def duplicate_error(line: int, sample_id: str, first_line: int) -> RowError:
    return RowError(line, sample_id, "duplicate_sample_id",
                    f"line {line}: sample_id {sample_id!r} already appeared on line {first_line}; only the first "
                    "line with an id is generated (give each prompt its own id, or remove the copy)")


def belongs_to_worker(item: Prompt | RowError, index: int, count: int) -> bool:
    """Whether the row is this worker's: the one split every pass uses (store/work_split.py)."""
    return WorkShare(index, count).owns(item.sample_id, item.line)
