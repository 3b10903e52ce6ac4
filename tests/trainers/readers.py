"""Readers of the export formats, written from the trainers' own reader code, not from tokenmill's writer.

Each function restates the rules of one trainer's reader, cited as `SF` = SpecForge 0.2.0 (PyPI wheel;
specforge/data/* equals GitHub sgl-project/SpecForge a6b6b0230009) and `SP` = speculators 0.9.0 (PyPI wheel).
Nothing here imports tokenmill: a test compares what these readers get with the committed rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ReaderError(ValueError):
    pass


# --- SpecForge pre-tokenized (data.prompts_path): SF data/prompt_builder.py ------------------------------------

def _records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    # A JSON array or JSON lines, blank lines skipped, each record an object (SF data/prompt_builder.py:294-333).
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return list(enumerate(json.loads(text), start=1))
    return [(n, json.loads(line)) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]


def _int_sequence(value: Any, field: str, where: str, binary: bool) -> list[int]:
    # SF data/prompt_builder.py:255-287: a 1-D integer sequence ([[...]] squeezed), bools refused as ids,
    # the mask 0 or 1.
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise ReaderError(f"{where} field {field} must be a sequence")
    items = list(value)
    if len(items) == 1 and isinstance(items[0], list):
        items = items[0]
    out = []
    for index, item in enumerate(items):
        if not isinstance(item, int) or (field == "input_ids" and isinstance(item, bool)):
            raise ReaderError(f"{where} field {field}[{index}] must be an integer")
        if binary and item not in (0, 1):
            raise ReaderError(f"{where} field {field}[{index}] must be 0 or 1, got {item}")
        out.append(int(item))
    return out


def specforge_pretokenized(path: Path, max_length: int = 1 << 20, min_loss_tokens: int = 1) -> list[dict[str, Any]]:
    """[{input_ids, loss_mask, record}] as SpecForge's online trainer takes them; rows under min_loss_tokens are
    skipped silently, as SpecForge does (SF data/prompt_builder.py:243-246)."""
    records = _records(path)
    if not records:
        return []
    first = records[0][1]
    if "input_ids" not in first or "loss_mask" not in first:  # the first record decides the path (:57-83)
        raise ReaderError(f"{path}: the first record has no input_ids/loss_mask: not a pre-tokenized file")
    rows = []
    for number, record in records:
        where = f"{path}:{number}"
        if "input_ids" not in record or "loss_mask" not in record:
            raise ReaderError(f"{where} must contain both input_ids and loss_mask")
        ids = _int_sequence(record["input_ids"], "input_ids", where, binary=False)
        mask = _int_sequence(record["loss_mask"], "loss_mask", where, binary=True)
        if len(ids) != len(mask):
            raise ReaderError(f"{where} has mismatched input_ids/loss_mask lengths: {len(ids)} != {len(mask)}")
        if not ids:
            raise ReaderError(f"{where} contains an empty token sequence")
        ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask) >= min_loss_tokens:
            rows.append({"input_ids": ids, "loss_mask": mask, "record": record})
    return rows


# --- speculators prepare-data, speculator-format rows: SP data_generation/preprocessing.py ----------------------

def speculators_rows(folder: Path, max_length: int = 1 << 20) -> list[dict[str, Any]]:
    """Rows `speculators prepare-data --data FOLDER` trains on: every *.json/*.jsonl under the folder, sorted, read
    by datasets' JSON loader as one dataset (SP preprocessing.py:764-772); rows with input_ids and loss_mask pass
    through: equal lengths or ValueError, cut to --seq-length, rows without a supervised token dropped
    (:458-483, :378-400). SP does not check that the mask is 0/1 (its loss multiplies by it, SP
    losses/utils.py:292-293); this reader refuses anything else, as a trainer-ready file must."""
    from datasets import load_dataset

    files = sorted(str(p) for p in (*folder.rglob("*.json"), *folder.rglob("*.jsonl")))
    if not files:
        raise ReaderError(f"No .json/.jsonl files found in directory: {folder}")
    dataset = load_dataset("json", data_files=files, split="train")
    if not {"input_ids", "loss_mask"} <= set(dataset.column_names):
        raise ReaderError(f"{folder}: not speculator-format rows (columns {dataset.column_names})")
    rows = []
    for row in dataset:
        ids, mask = row["input_ids"], row["loss_mask"]
        if len(ids) != len(mask):
            raise ReaderError(f"Speculator-format row shape mismatch: input_ids={len(ids)}, loss_mask={len(mask)}")
        if set(mask) - {0, 1}:
            raise ReaderError(f"{row.get('id')}: loss_mask holds {sorted(set(mask) - {0, 1})}")
        ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask):
            rows.append({"input_ids": ids, "loss_mask": mask, "seq_len": len(ids), "record": row})
    return rows


# --- SpecForge text forms: SF data/preprocessing.py, data/parse.py, data/template.py ----------------------------

@dataclass(frozen=True)
class SFTemplate:
    """The fields of a SpecForge ChatTemplate registration these readers use (SF data/template.py)."""

    assistant_header: str
    end_of_turn_token: str
    system_prompt: str | None
    thinking: bool  # parser_type "thinking"
    enable_thinking: bool


SF_TEMPLATES = {
    # SF data/template.py:194-204
    "qwen3-thinking": SFTemplate("<|im_start|>assistant\n", "<|im_end|>\n", "You are a helpful assistant.", True,
                                 True),
    # SF data/template.py:230-240
    "kimi-k2-thinking": SFTemplate("<|im_assistant|>assistant<|im_middle|>", "<|im_end|>",
                                   "You are a helpful assistant.", True, True),
}


def _mask(tokenizer: Any, text: str, ids: list[int], template: SFTemplate, last_turn_only: bool) -> list[int]:
    # SF data/parse.py:176-185, 286-314: spans from just after each assistant header through the end-of-turn token
    # (or the end of the text), token positions by re-encoding the text before each span's start and end.
    pattern = re.escape(template.assistant_header) + r"([\s\S]*?(?:" + re.escape(template.end_of_turn_token) + "|$))"
    matches = list(re.finditer(pattern, text, re.DOTALL))
    if last_turn_only and matches:
        matches = matches[-1:]
    mask = [0] * len(ids)
    for match in matches:
        start = len(tokenizer.encode(text[:match.start(1)], add_special_tokens=False))
        end = len(tokenizer.encode(text[:match.end(1)], add_special_tokens=False))
        for position in range(min(start, len(ids)), min(end, len(ids))):
            mask[position] = 1
    return mask


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def specforge_preformatted(path: Path, tokenizer: Any, template: SFTemplate,
                           last_turn_only: bool = True) -> list[dict[str, Any]]:
    """data.is_preformatted: a `text` column (else ValueError, SF preprocessing.py:237-242), tokenized as it is
    (SF parse.py:272-279), masked by the template's header/end pattern."""
    from datasets import load_dataset

    dataset = load_dataset("json", data_files=str(path), split="train")
    if "text" not in dataset.column_names:
        raise ReaderError(f"Expected 'text' column for is_preformatted=True, but found columns: "
                          f"{dataset.column_names}")
    rows = []
    for row in dataset:
        ids = _encode(tokenizer, row["text"])
        rows.append({"id": row.get("id"), "input_ids": ids,
                     "loss_mask": _mask(tokenizer, row["text"], ids, template, last_turn_only)})
    return rows


def _normalize(message: dict[str, Any]) -> dict[str, Any]:
    # SF data/parse.py:105-117
    role = message.get("role", message.get("from", ""))
    role = "user" if role in ("human", "user") else "assistant" if role in ("gpt", "assistant") else role
    out = {**message, "role": role, "content": message.get("content") or message.get("value") or ""}
    out.pop("from", None)
    out.pop("value", None)
    return out


def _sanitize(message: dict[str, Any], thinking: bool) -> dict[str, Any]:
    # SF data/parse.py:24, 40-103, 470-477: the parser's keys; tool_calls from a JSON string; each call's id, type,
    # function {name, arguments}, string arguments parsed.
    keys = {"role", "content", "tool_calls"} | ({"reasoning_content", "name", "tool_call_id"} if thinking else set())
    clean = {k: v for k, v in message.items() if k in keys}
    calls = clean.get("tool_calls")
    if isinstance(calls, str):
        calls = json.loads(calls)
    if isinstance(calls, list):
        fixed = []
        for call in calls:
            entry = {"id": call.get("id", ""), "type": call.get("type", "function")}
            function = call.get("function", {})
            if isinstance(function, dict):
                arguments = function.get("arguments", {})
                entry["function"] = {"name": function.get("name", ""),
                                     "arguments": json.loads(arguments) if isinstance(arguments, str) else arguments}
            fixed.append(entry)
        clean["tool_calls"] = fixed
    return clean


def _sf_messages(conversation: list[dict[str, Any]], template: SFTemplate) -> list[dict[str, Any]]:
    # SF data/parse.py:197-239
    conversation = [_normalize(m) for m in conversation]
    messages = []
    if conversation[0]["role"] == "system":
        messages.append({"role": "system", "content": conversation[0]["content"]})
        conversation = conversation[1:]
    elif template.system_prompt:
        messages.append({"role": "system", "content": template.system_prompt})
    while conversation and conversation[0]["role"] != "user":
        conversation = conversation[1:]
    for j, message in enumerate(conversation):
        if j:
            previous = conversation[j - 1]["role"]
            if message["role"] == "tool" and previous not in ("assistant", "tool"):
                break
            if message["role"] == "assistant" and previous not in ("user", "tool"):
                break
        messages.append(_sanitize(message, template.thinking))
    return messages


def specforge_conversations(path: Path, tokenizer: Any, template: SFTemplate,
                            last_turn_only: bool = True) -> list[dict[str, Any]]:
    """data.train_data_path with conversations: read by datasets' JSON loader (SF prompt_builder.py:125), `id`
    popped, `tools` a list or JSON string, every other column a chat template argument (SF preprocessing.py:252-293),
    messages prepared as SF data/parse.py does and rendered with the model's template (tokenize=False,
    add_generation_prompt=False; the thinking parser adds enable_thinking=True, SF parse.py:479-504)."""
    from datasets import load_dataset

    dataset = load_dataset("json", data_files=str(path), split="train")
    if "conversations" not in dataset.column_names:
        raise ReaderError(f"Expected 'conversations' column, found {dataset.column_names}")
    rows = []
    for row in dataset:
        row = dict(row)
        conversation, row_id = row.pop("conversations"), row.pop("id", None)
        tools = row.pop("tools", None)
        tools = json.loads(tools) if isinstance(tools, str) else tools or []
        kwargs = dict(row)
        if template.thinking:
            kwargs["add_special_tokens"] = False
            if template.enable_thinking:
                kwargs["enable_thinking"] = True
        text = tokenizer.apply_chat_template(_sf_messages(conversation, template), tokenize=False,
                                             add_generation_prompt=False, tools=tools or None, **kwargs)
        ids = _encode(tokenizer, text)
        rows.append({"id": row_id, "input_ids": ids,
                     "loss_mask": _mask(tokenizer, text, ids, template, last_turn_only), "text": text})
    return rows
