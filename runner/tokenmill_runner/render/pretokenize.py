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

from ..source.prompts import Prompt, RowError
from ..store.storage import StorageRetry, open_storage, write_atomic
from .chat_render import ChatRenderer
from .content_format import flatten, template_content_format
from .segments import SegmentEncoder
from .tokenizer_info import TokenizerInfo
from .tokenizers_compat import SPEC_ALLOWS_REMOTE_CODE, TokenizerError, is_fast, load_folder_tokenizer

__all__ = ["TokenizerError", "TokenizerInfo", "PromptEncoder", "describe_tokenizer", "load_tokenizer",
           "local_model_folder", "model_generation_config"]

logger = logging.getLogger(__name__)

KNOWN_TOOL_CALL_TOKENS = ("<|tool_calls_section_begin|>", "<tool_call>", "<｜tool▁calls▁begin｜>", "<|python_tag|>")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
MAX_TOKENIZER_FILE_BYTES = 64 * 1024 * 1024


# Tokens that also end reasoning when the configured end token is </think>, if the tokenizer has them: Kimi-K2.5
# may leave reasoning by opening the tool-call section without </think>; SGLang's kimi_k2 reasoning parser treats
# that token as an end (v0.5.23 parser/reasoning_parser.py: KimiK2Detector, tool_start_token).
REASONING_END_ALTERNATIVES = {"</think>": ("<|tool_calls_section_begin|>",)}


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def fetch_tokenizer_files(uri: str, endpoint: str | None = None, retry: StorageRetry | None = None) -> Path:
    """Copy the tokenizer and config files (never the weights) of an s3:// model prefix into the local cache.

    Each file is written atomically (a temporary name, then a rename), and a cached file whose size differs from
    the object's (cut short by an older tokenmill, or changed in the store) is fetched again, so a run killed
    mid-copy never leaves a truncated tokenizer behind for the next one."""
    storage = open_storage(uri, endpoint, retry=retry)
    target = cache_root() / "tokenizers" / hashlib.sha256(storage.root_uri.encode()).hexdigest()[:16]
    copied = 0
    for key, size in storage.list_sizes(""):
        if "/" in key or key.endswith(WEIGHT_SUFFIXES) or size > MAX_TOKENIZER_FILE_BYTES:
            continue
        path = target / key
        if not path.is_file() or path.stat().st_size != size:
            data = storage.get(key)
            if len(data) != size:
                raise TokenizerError(f"{storage.uri(key)} is {len(data)} bytes but was listed as {size}: it changed "
                                     "while being copied; run again")
            write_atomic(path, data)
        copied += 1
    if copied == 0:
        raise TokenizerError(f"no tokenizer files under {storage.root_uri}; set spec.model.tokenizer")
    return target


def local_model_folder(location: str, endpoint: str | None = None, retry: StorageRetry | None = None) -> str:
    if location.startswith("s3://"):
        return str(fetch_tokenizer_files(location, endpoint, retry))
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


def load_tokenizer(folder: str, trust_remote_code: bool = False, allow_with: str = SPEC_ALLOWS_REMOTE_CODE):
    """The tokenizer of a local model folder (see `local_model_folder`), strictly offline, whatever its packaging
    (tokenizer.json, remote code over tiktoken.model, tekken.json: see tokenizers_compat)."""
    offline_transformers()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return load_folder_tokenizer(folder, trust_remote_code, allow_with)


def flag_allows_remote_code(location: str) -> str:
    """How `tokenmill inspect` and `export` let a tokenizer's own code run: only the person running the command
    decides, never the output's run.json (anyone who can write the output prefix can edit it, B3 in
    docs/security.md)."""
    return (f"the tokenizer at {location} runs its own Python code; pass --trust-remote-code if you trust that "
            "repository (run.json's trustRemoteCode is not enough: whoever can write the output can edit it)")


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


def model_family(folder: str | None, location: str) -> str:
    """The model's family as its config.json names it (model_type), else where the tokenizer is."""
    return str(_read_json(folder, "config.json").get("model_type") or location)


def model_context_length(folder: str | None) -> int | None:
    config = _read_json(folder, "config.json")
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "model_max_length"):
            if isinstance(source.get(key), int):
                return source[key]
    return None


def model_generation_config(folder: str | None) -> dict[str, Any]:
    return _read_json(folder, "generation_config.json")


def reasoning_end_ids(tokenizer: Any, location: str, end_tokens: list[str], explicit: bool) -> dict[int, str]:
    """{id: token} of the tokens that end reasoning. Configured tokens must be single tokens; the defaulted
    alternatives (REASONING_END_ALTERNATIVES) are kept only where the tokenizer has them."""
    field = "spec.model.reasoning.endTokens" if explicit else "spec.model.reasoning.endToken"
    found: dict[int, str] = {}
    for token in end_tokens:
        token_id = single_token_id(tokenizer, token)
        if token_id is None:
            raise TokenizerError(
                f"{field} {token!r} is not a single token in the tokenizer at {location} (it encodes to "
                f"{tokenizer.encode(token, add_special_tokens=False)}); set it to this model's end-of-reasoning "
                "token, or endToken to null for a model without reasoning"
            )
        found[token_id] = token
    if not explicit:
        for token in end_tokens[:1]:
            for alternative in REASONING_END_ALTERNATIVES.get(token, ()):
                token_id = single_token_id(tokenizer, alternative)
                if token_id is not None:
                    found.setdefault(token_id, alternative)
    return found


def describe_tokenizer(tokenizer: Any, location: str, end_tokens: list[str] | str | None,
                       tool_token: str | None, folder: str | None, explicit_end_tokens: bool = False) -> TokenizerInfo:
    if isinstance(end_tokens, str):
        end_tokens = [end_tokens]
    ends = reasoning_end_ids(tokenizer, location, list(end_tokens or []), explicit_end_tokens)
    end_id = next(iter(ends), None)
    end_token = ends.get(end_id) if end_id is not None else None
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
        reasoning_end_token=end_token, reasoning_end_id=end_id,
        reasoning_end_tokens={str(i): token for i, token in ends.items()}, tool_call_token=tool_token,
        tool_call_id=tool_id, model_context_length=model_context_length(folder),
    )


def _template_error(prompt: Prompt, error: Exception) -> RowError:
    return RowError(prompt.line, prompt.sample_id, "template_error",
                    f"line {prompt.line} (sample {prompt.sample_id}): the chat template failed: "
                    f"{type(error).__name__}: {error}")


class PromptEncoder:
    """Prompt ids as SGLang's side computes them: apply_chat_template(messages, tools=..., add_generation_prompt=True,
    tokenize=True, **chat template arguments) (SGLang v0.5.9 entrypoints/openai/serving_chat.py:461-473).

    Fast tokenizers render each chat and encode the batch in Rust, which is what apply_chat_template(tokenize=True)
    does after rendering (no BOS/EOS added); remote-code and mistral_common tokenizers run the call itself, since
    their own code may tokenize differently (tests/reference holds both paths to the model's own code)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.fast = is_fast(tokenizer)
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: SGLang renders the default one
            template = template.get("default")
        self.content_format = template_content_format(template if isinstance(template, str) else None)
        self.renderer = ChatRenderer(tokenizer)
        backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._segments = SegmentEncoder.for_backend(backend) if self.fast and backend is not None else None

    def _messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        return flatten(prompt.messages, self.content_format)

    def render(self, prompt: Prompt, template_kwargs: dict[str, Any] | None = None) -> str | RowError:
        try:
            return self.renderer.render(self._messages(prompt), prompt.tools, template_kwargs or {})
        except Exception as error:  # jinja raises TemplateError, TypeError, KeyError...
            return _template_error(prompt, error)

    def encode_one(self, prompt: Prompt, template_kwargs: dict[str, Any] | None = None) -> list[int] | RowError:
        try:
            ids = self.tokenizer.apply_chat_template(
                self._messages(prompt), tools=prompt.tools, add_generation_prompt=True, tokenize=True,
                **(template_kwargs or {}),
            )
        except Exception as error:
            return _template_error(prompt, error)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def encode_batch(self, prompts: list[Prompt],
                     template_kwargs: dict[str, Any] | None = None) -> list[list[int] | RowError]:
        if not self.fast:
            return [self.encode_one(prompt, template_kwargs) for prompt in prompts]
        rendered = [self.render(prompt, template_kwargs) for prompt in prompts]
        texts = [text for text in rendered if isinstance(text, str)]
        encoded = iter(self._encode_texts(texts)) if texts else iter(())
        return [next(encoded) if isinstance(text, str) else text for text in rendered]

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        """The ids of rendered texts, no special tokens added. Straight through the Rust tokenizer's batch encoding
        without offsets (`encode_batch_fast`: the same ids for half the CPU, which the runner spends per prompt)
        when it has that call and no truncation or padding of its own, the text between added tokens encoded once
        per distinct piece where the tokenizer allows (segments.py); else through the transformers call."""
        backend: Any = getattr(self.tokenizer, "backend_tokenizer", None)
        fast = getattr(backend, "encode_batch_fast", None)
        if fast is not None and backend.truncation is None and backend.padding is None:
            if self._segments is not None:
                return self._segments.encode(texts)
            return [encoding.ids for encoding in fast(texts, add_special_tokens=False)]
        return list(self.tokenizer(texts, add_special_tokens=False)["input_ids"])
