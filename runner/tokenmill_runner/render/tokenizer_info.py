"""The tokenizer's facts (found by `pretokenize.describe_tokenizer`), for rows and run.json without a tokenizer.
Pure."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TokenizerInfo:
    """What the rest of tokenmill needs to know about the tokenizer, recorded in the run's metadata."""

    location: str
    vocab_size: int
    eos_token_ids: list[int]
    eos_tokens: dict[str, str]  # id (as a JSON key) -> token text, so reports can name the stop tokens
    reasoning_end_token: str | None  # the first of reasoning_end_tokens (older readers use these two)
    reasoning_end_id: int | None
    reasoning_end_tokens: dict[str, str]  # id (as a JSON key) -> token text, every token that ends reasoning
    tool_call_token: str | None
    tool_call_id: int | None
    model_context_length: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
