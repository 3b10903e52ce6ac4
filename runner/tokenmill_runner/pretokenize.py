"""Pre-tokenization with the model's own tokenizer and chat template; no text round-trip after this point.

Every prompt becomes `apply_chat_template(messages, tools=tools, add_generation_prompt=True)` token ids. Special
tokens (end of reasoning, tool-call opener, EOS) are looked up in the tokenizer by their text, never by id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from .prompts import Prompt, RowError
from .storage import open_storage
from .tokenizer_info import TokenizerInfo

logger = logging.getLogger(__name__)

KNOWN_TOOL_CALL_TOKENS = ("<|tool_calls_section_begin|>", "<tool_call>", "<｜tool▁calls▁begin｜>", "<|python_tag|>")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
MAX_TOKENIZER_FILE_BYTES = 64 * 1024 * 1024


class TokenizerError(RuntimeError):
    """The tokenizer cannot be loaded or lacks a token the spec relies on."""


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def fetch_tokenizer_files(uri: str, endpoint: str | None = None) -> Path:
    """Copy the tokenizer and config files (never the weights) of an s3:// model prefix into the local cache."""
    storage = open_storage(uri, endpoint)
    target = cache_root() / "tokenizers" / hashlib.sha256(storage.root_uri.encode()).hexdigest()[:16]
    copied = 0
    for key in storage.list(""):
        if "/" in key or key.endswith(WEIGHT_SUFFIXES):
            continue
        path = target / key
        if not path.exists():
            data = storage.get(key)
            if len(data) > MAX_TOKENIZER_FILE_BYTES:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        copied += 1
    if copied == 0:
        raise TokenizerError(f"no tokenizer files under {storage.root_uri}; set spec.model.tokenizer")
    return target


def local_model_folder(location: str, endpoint: str | None = None) -> str:
    if location.startswith("s3://"):
        return str(fetch_tokenizer_files(location, endpoint))
    if location.startswith("pvc://"):
        raise TokenizerError(
            f"{location}: a PVC is only reachable inside the cluster; for a local run set spec.model.tokenizer "
            "to a folder or s3:// prefix with the tokenizer files"
        )
    return location.removeprefix("file://")


def offline_transformers() -> None:
    """Never reach for a hub, and keep transformers' 'PyTorch was not found' notice out of every command."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def load_tokenizer(folder: str, trust_remote_code: bool = False):
    """AutoTokenizer from a local folder (see `local_model_folder`) or a cached hub id, strictly offline."""
    offline_transformers()
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers raises OSError, ValueError, ImportError...
        raise TokenizerError(f"cannot load the tokenizer from {folder}: {error}") from error


def single_token_id(tokenizer: Any, token: str) -> int | None:
    ids = tokenizer.encode(token, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _eos_ids(tokenizer: Any, folder: str | None) -> list[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for name in ("config.json", "generation_config.json"):
        config = _read_json(folder, name)
        value = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return sorted(ids)


def _read_json(folder: str | None, name: str) -> dict[str, Any]:
    if folder is None or not (Path(folder) / name).is_file():
        return {}
    return json.loads((Path(folder) / name).read_text())


def model_context_length(folder: str | None) -> int | None:
    config = _read_json(folder, "config.json")
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "model_max_length"):
            if isinstance(source.get(key), int):
                return source[key]
    return None


def describe_tokenizer(tokenizer: Any, location: str, end_token: str | None,
                       tool_token: str | None, folder: str | None) -> TokenizerInfo:
    end_id = None
    if end_token is not None:
        end_id = single_token_id(tokenizer, end_token)
        if end_id is None:
            raise TokenizerError(
                f"spec.model.reasoning.endToken {end_token!r} is not a single token in the tokenizer at {location} "
                f"(it encodes to {tokenizer.encode(end_token, add_special_tokens=False)}); set it to this model's "
                "end-of-reasoning token, or to null for a model without reasoning"
            )
    candidates = (tool_token,) if tool_token else KNOWN_TOOL_CALL_TOKENS
    tool_id = None
    for candidate in candidates:
        tool_id = single_token_id(tokenizer, candidate)
        if tool_id is not None:
            tool_token = candidate
            break
    else:
        if tool_token:
            raise TokenizerError(f"spec.model.toolCallToken {tool_token!r} is not a single token at {location}")
        tool_token = None
    eos_ids = _eos_ids(tokenizer, folder)
    return TokenizerInfo(
        location=location, vocab_size=len(tokenizer), eos_token_ids=eos_ids,
        eos_tokens={str(i): tokenizer.convert_ids_to_tokens(i) for i in eos_ids if i < len(tokenizer)},
        reasoning_end_token=end_token, reasoning_end_id=end_id, tool_call_token=tool_token,
        tool_call_id=tool_id, model_context_length=model_context_length(folder),
    )


class PromptEncoder:
    """Renders chats with the tokenizer's template, then tokenizes the batch through the fast tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, prompt: Prompt) -> str | RowError:
        try:
            return self.tokenizer.apply_chat_template(
                prompt.messages, tools=prompt.tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as error:  # jinja raises TemplateError, TypeError, KeyError...
            return RowError(prompt.line, prompt.sample_id, "template_error",
                            f"line {prompt.line} (sample {prompt.sample_id}): the chat template failed: {error}")

    def encode_batch(self, prompts: list[Prompt]) -> list[list[int] | RowError]:
        rendered = [self.render(prompt) for prompt in prompts]
        texts = [text for text in rendered if isinstance(text, str)]
        # Same call apply_chat_template(tokenize=True) makes after rendering: no BOS/EOS added by the tokenizer.
        encoded = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
        return [next(encoded) if isinstance(text, str) else text for text in rendered]
