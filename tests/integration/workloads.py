"""Prompt rows and specs for integration tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import yaml


def chat(i: int, text: str | None = None) -> dict[str, Any]:
    return {"sample_id": f"s{i:04d}", "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": text or f"Question {i}: what is {i} times {i + 3}? Explain your steps."}]}


def tool_chat(i: int) -> dict[str, Any]:
    row = chat(i, f"What is the weather in city number {i}?")
    row["tools"] = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    return row


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    lines = [row if isinstance(row, bytes) else orjson.dumps(row) for row in rows]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def spec_document(demo_model: Path, datasets: list[dict[str, Any]], output: str, **spec: Any) -> dict[str, Any]:
    body = {
        "model": {"path": str(demo_model)},
        "sampling": {"maxNewTokens": 2048, "temperature": "0.6"},
        "datasets": datasets,
        "runner": {"concurrency": 32, "shardMaxSamples": 16, "shardMaxSeconds": 2, "maxAttempts": 8},
        "output": {"uri": output},
    }
    body.update(spec)
    return {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "it"},
            "spec": body}


def write_spec(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(document))
    return path
