"""Loading the tokenizers real models ship, so prompt ids equal what SGLang's own transformers pin produces.

Three kinds of folder are recognised:
  - `tokenizer.json` (+ tokenizer_config.json): a fast tokenizer, loaded by AutoTokenizer;
  - `tokenizer_config.json` whose `auto_map` names remote code (Kimi-K2/K2.5/K2.6: `tokenization_kimi.py` over a
    tiktoken `tiktoken.model`): AutoTokenizer with trust_remote_code, after the shims below;
  - `tekken.json` without `tokenizer.json` (Mistral's own format): mistral_common, as SGLang does for such
    "bare tekken" checkpoints (SGLang v0.5.23 utils/hf_transformers/mistral_utils.py:438-463).

The reference for "identical" is tests/reference/: the model's own code run under the transformers release SGLang's
image pins. tokenmill runs a newer transformers; the shims here undo the differences that matter for ids, and the
tests hold every fixture family to the reference, prompt by prompt.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# What a model folder may hold for its tokenizer, in the order they are tried; named in the error when none works.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json (with auto_map remote code)", "tiktoken.model",
                   "tekken.json", "tokenizer.model", "vocab.json + merges.txt")


class TokenizerError(RuntimeError):
    """The tokenizer cannot be loaded or lacks a token the spec relies on."""


def install_transformers_shims() -> None:
    """Make transformers 5 behave, for chat templates and remote tokenizer code, like the 4.x/5.19 SGLang pins.

    - `bytes_to_unicode` left `transformers.models.gpt2.tokenization_gpt2` in transformers 5 (it lives in
      `transformers.convert_slow_tokenizer`); Kimi's `tokenization_kimi.py` imports it from the old place and fails
      at import without this.
    - transformers >= 5.2x copies a message's `reasoning_content` into `thinking` before rendering
      (utils/chat_template_utils.py `_alias_reasoning_fields`); GPT-OSS's template reads `thinking`, so history
      reasoning would appear in prompts that SGLang (transformers 4.57.1 in v0.5.9, 5.19.0 in v0.5.23, neither of
      which aliases) renders without it.
    """
    import transformers.convert_slow_tokenizer as convert
    import transformers.models.gpt2.tokenization_gpt2 as gpt2

    if not hasattr(gpt2, "bytes_to_unicode"):
        # transformers 5 moved it; remote tokenizer code written for 4.x still imports it from gpt2
        gpt2.bytes_to_unicode = convert.bytes_to_unicode  # type: ignore[attr-defined]
    import transformers.utils.chat_template_utils as templates

    if hasattr(templates, "_alias_reasoning_fields"):
        templates._alias_reasoning_fields = lambda chat: chat


def _read_json(folder: Path, name: str) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        return {}
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise TokenizerError(f"{path}: not readable JSON ({error})") from None
    return loaded if isinstance(loaded, dict) else {}


def remote_code_module(folder: Path) -> str | None:
    """The `auto_map.AutoTokenizer` entry of tokenizer_config.json (e.g. tokenization_kimi.TikTokenTokenizer)."""
    auto_map = _read_json(folder, "tokenizer_config.json").get("auto_map") or {}
    entry = auto_map.get("AutoTokenizer")
    if isinstance(entry, list):
        entry = next((item for item in entry if item), None)
    return entry if isinstance(entry, str) else None


def tokenizer_kind(folder: Path) -> str:
    """fast | remote | tekken | sentencepiece | vocab-merges; raises naming every file looked for when none fits."""
    if remote_code_module(folder):
        return "remote"
    if (folder / "tokenizer.json").is_file():
        return "fast"
    if (folder / "tekken.json").is_file():
        return "tekken"
    if (folder / "tokenizer.model").is_file():
        return "sentencepiece"
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return "vocab-merges"
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise TokenizerError(
        f"no usable tokenizer in {folder}: looked for {', '.join(TOKENIZER_FILES)}; found "
        f"{', '.join(present) or 'nothing'}. Point spec.model.tokenizer at the folder (or s3:// prefix) that holds "
        "the model's tokenizer files"
    )


SPEC_ALLOWS_REMOTE_CODE = "set spec.model.trustRemoteCode: true"


def load_hf_tokenizer(folder: Path, trust_remote_code: bool, allow_with: str = SPEC_ALLOWS_REMOTE_CODE) -> Any:
    """AutoTokenizer from a local folder, offline, with the shims installed; remote code only when allowed (the
    refusal says how: `allow_with`)."""
    module = remote_code_module(folder)
    if module and not trust_remote_code:
        raise TokenizerError(
            f"the tokenizer in {folder} is remote code ({module} from tokenizer_config.json auto_map, e.g. "
            f"Kimi's tokenization_kimi.py): {allow_with} to run it"
        )
    install_transformers_shims()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code,
                                             clean_up_tokenization_spaces=False, local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, ImportError, ModuleNotFoundError...
        raise TokenizerError(f"cannot load the tokenizer from {folder}: {type(error).__name__}: {error}") from error


class TekkenTokenizer:
    """A Mistral tekken.json tokenizer through mistral_common, with the few methods tokenmill calls on tokenizers.

    Prompts are encoded by mistral_common's own chat encoding (there is no Jinja template); decoding keeps control
    tokens when asked to, like a Hugging Face tokenizer with skip_special_tokens=False.
    """

    def __init__(self, path: Path) -> None:
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self.path = path
        self.mistral = MistralTokenizer.from_file(str(path))
        self.tekken = self.mistral.instruct_tokenizer.tokenizer
        self._control = {self.tekken.id_to_piece(i): i for i in range(self.tekken.num_special_tokens)}
        self.eos_token_id = self.tekken.eos_id
        self.bos_token_id = self.tekken.bos_id
        self.additional_stop_token_ids = None
        self.all_special_ids = list(self._control.values())

    def __len__(self) -> int:
        return self.tekken.n_words

    def get_vocab(self) -> dict[str, int]:
        return {self.tekken.id_to_piece(i): i for i in range(self.tekken.n_words)}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.tekken.id_to_piece(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if text in self._control:
            return [self._control[text]]
        return self.tekken.encode(text, bos=add_special_tokens, eos=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        policy = SpecialTokenPolicy.IGNORE if skip_special_tokens else SpecialTokenPolicy.KEEP
        return self.tekken.decode(list(ids), special_token_policy=policy)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = True, **kwargs: Any) -> list[int]:
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        if kwargs:
            raise TokenizerError(f"{self.path.name} (mistral_common) takes no chat template arguments; got "
                                 f"{sorted(kwargs)}: remove chatTemplateKwargs for this model")
        request = ChatCompletionRequest.from_openai(messages, tools=tools)
        return self.mistral.encode_chat_completion(request).tokens


def load_folder_tokenizer(folder: str | Path, trust_remote_code: bool = False,
                          allow_with: str = SPEC_ALLOWS_REMOTE_CODE) -> Any:
    """The tokenizer of a local model folder, whatever its packaging (see the module docstring)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer folder {folder} does not exist")
    kind = tokenizer_kind(folder)
    if kind == "tekken":
        try:
            return TekkenTokenizer(folder / "tekken.json")
        except Exception as error:  # mistral_common raises ValueError, AssertionError, pydantic errors...
            raise TokenizerError(f"cannot load {folder / 'tekken.json'} with mistral_common: {error}") from error
    return load_hf_tokenizer(folder, trust_remote_code, allow_with)


def is_fast(tokenizer: Any) -> bool:
    """Whether the tokenizer runs in Rust (batch encoding of rendered text is then what apply_chat_template does)."""
    return getattr(tokenizer, "backend_tokenizer", None) is not None
