"""The tokenizer fixtures, how each is configured in a spec, and the chat-template argument variants tested."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers"
PROMPTS = FIXTURES / "prompts.jsonl"


@dataclass(frozen=True)
class Variant:
    name: str  # fixture folder, plus "+suffix" for a chat-template argument variant
    family: str  # fixture folder
    trust_remote_code: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat template arguments
    end_token: str | None = "</think>"  # spec.model.reasoning.endToken for this model

    @property
    def path(self) -> Path:
        return FIXTURES / self.family

    def reference_request(self) -> dict[str, Any]:
        return {"path": str(self.path), "trust_remote_code": self.trust_remote_code, "kwargs": self.kwargs}


VARIANTS = [
    Variant("kimi-k2.5", "kimi-k2.5", trust_remote_code=True),
    Variant("kimi-k2.5+instant", "kimi-k2.5", trust_remote_code=True, kwargs={"thinking": False}),
    Variant("qwen3", "qwen3"),
    Variant("qwen3+no-thinking", "qwen3", kwargs={"enable_thinking": False}),
    Variant("llama-3.1", "llama-3.1", end_token=None),
    Variant("llama-3.1+date", "llama-3.1", kwargs={"date_string": "14 Mar 2025"}, end_token=None),
    Variant("deepseek-r1", "deepseek-r1"),
    Variant("gpt-oss", "gpt-oss", end_token="<|end|>"),
    Variant("gpt-oss+high", "gpt-oss", kwargs={"reasoning_effort": "high"}, end_token="<|end|>"),
    Variant("mistral-tekken", "mistral-tekken", end_token="[/THINK]"),
    Variant("qwen3-coder", "qwen3-coder", end_token=None),
    Variant("deepseek-v3.1", "deepseek-v3.1"),
    Variant("deepseek-v3.1+thinking", "deepseek-v3.1", kwargs={"thinking": True}),
    Variant("deepseek-v3.2", "deepseek-v3.2"),
    Variant("deepseek-v3.2+thinking", "deepseek-v3.2", kwargs={"thinking": True}),
    Variant("glm-4.5", "glm-4.5"),
    Variant("glm-4.5+no-thinking", "glm-4.5", kwargs={"enable_thinking": False}),
]
BY_NAME = {variant.name: variant for variant in VARIANTS}
