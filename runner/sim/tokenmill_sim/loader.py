"""Loading a model folder for the simulator: its config files and its tokenizer, through the runner's loader (every
family's packaging; local files only: the simulator never downloads)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill_runner.render.pretokenize import load_tokenizer

from .model import LoadedModel, ModelFiles
from .tokens import Decode, Encode, TokenBank, Vocabulary

logger = logging.getLogger(__name__)


def load_model(model_path: str, trust_remote_code: bool = False) -> LoadedModel:
    """Read the model folder and the tokenizer (local files only: the simulator never downloads), whatever its
    packaging: tokenizer.json, remote code over tiktoken.model (Kimi), tekken.json (Mistral)."""
    if not Path(model_path).is_dir():
        raise FileNotFoundError(f"model path {model_path!r} is not a folder with config.json and tokenizer files")
    files = ModelFiles.read(model_path)
    tokenizer = load_tokenizer(model_path, trust_remote_code)
    encode, decode = _codec(tokenizer)
    eos_ids = files.eos_ids()
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    eos_ids.update(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    vocab = Vocabulary.resolve(tokenizer.get_vocab(), encode, eos_ids, tokenizer.eos_token_id)
    vocab_size = files.vocab_size or len(tokenizer)
    logger.info("simulated model %s: vocab %d, context %d, stop ids %s, end-of-reasoning id %s", model_path, vocab_size,
                files.context_length, sorted(vocab.eos_ids), vocab.think_end)
    return LoadedModel(files, vocab, TokenBank.build(encode, decode), encode, decode, vocab_size)


def _codec(tokenizer: Any) -> tuple[Encode, Decode]:
    # The Rust tokenizer under a fast tokenizer decodes about twice as fast as the transformers wrapper.
    backend = getattr(tokenizer, "backend_tokenizer", None)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
        if backend is not None:
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    return encode, decode
