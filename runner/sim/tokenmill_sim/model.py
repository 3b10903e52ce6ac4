"""What the simulator knows about a model: its config.json and generation_config.json facts, and the loaded
model (vocabulary, token bank, codec) the output generator uses. `loader.py` builds it with the tokenizer."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .tokens import Decode, Encode, TokenBank, Vocabulary

logger = logging.getLogger(__name__)

FALLBACK_CONTEXT_LENGTH = 32768


@dataclass(frozen=True)
class ModelFiles:
    model_path: str
    config: dict[str, Any]
    generation_config: dict[str, Any]

    @classmethod
    def read(cls, model_path: str) -> ModelFiles:
        folder = Path(model_path)
        return cls(model_path, _read_json(folder / "config.json"), _read_json(folder / "generation_config.json"))

    def _text_config(self) -> dict[str, Any]:
        # Multimodal configs (Kimi-K2.5 and friends) keep the language model's fields under text_config.
        nested = self.config.get("text_config")
        return nested if isinstance(nested, dict) else self.config

    def _field(self, name: str) -> Any:
        return self.config.get(name, self._text_config().get(name))

    @property
    def context_length(self) -> int:
        for name in ("max_position_embeddings", "max_sequence_length", "seq_length"):
            value = self._field(name)
            if isinstance(value, int) and value > 0:
                return value
        logger.warning("no max_position_embeddings in %s/config.json; assuming %d", self.model_path,
                       FALLBACK_CONTEXT_LENGTH)
        return FALLBACK_CONTEXT_LENGTH

    @property
    def vocab_size(self) -> int | None:
        value = self._field("vocab_size")
        return value if isinstance(value, int) else None

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    def eos_ids(self) -> set[int]:
        """config.json eos_token_id ∪ generation_config.json eos_token_id (SGLang's hf_eos_token_id)."""
        ids: set[int] = set()
        for source in (self._field("eos_token_id"), self.generation_config.get("eos_token_id")):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(i for i in source if isinstance(i, int))
        return ids


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open() as handle:
        loaded = json.load(handle)
    return loaded if isinstance(loaded, dict) else {}


@dataclass(frozen=True)
class LoadedModel:
    files: ModelFiles
    vocab: Vocabulary
    bank: TokenBank
    encode: Encode
    decode: Decode
    vocab_size: int
