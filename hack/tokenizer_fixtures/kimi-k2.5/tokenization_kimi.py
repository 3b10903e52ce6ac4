# Test fixture written for tokenmill: a stand-in for the `tokenization_kimi.py` that moonshotai/Kimi-K2.5 ships as
# remote code. It is not Moonshot's file; it reproduces the behaviour tokenmill depends on, written against the same
# transformers 4.x API (see README.md in this folder for where each behaviour comes from):
#   - the imports: `bytes_to_unicode` from transformers' gpt2 tokenizer module (moved in transformers 5) and
#     `PreTrainedTokenizer` from `transformers.tokenization_utils`;
#   - a tiktoken BPE read from `tiktoken.model`, with 256 special-token slots right after the base vocabulary, named
#     by `added_tokens_decoder` in tokenizer_config.json (unnamed slots are `<|reserved_token_N|>`);
#   - `encode` without extra arguments runs tiktoken directly with every special token allowed;
#   - `apply_chat_template` sorts the tools' keys, renders them as TypeScript-like declarations in Python
#     (`tool_declaration_ts.py`) and hands the string to the template as `tools_ts_str`; `thinking` defaults to True.
import os
from logging import getLogger
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import AddedToken
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
from transformers.tokenization_utils import PreTrainedTokenizer

from .tool_declaration_ts import encode_tools_to_typescript_style

logger = getLogger(__name__)
VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}

# tiktoken panics on very long runs; the published code cuts inputs the same way.
MAX_ENCODE_CHARS = 400_000
MAX_SAME_CLASS_RUN = 25_000


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = 256

    # Kimi's pre-tokenizer: Han runs, cased words with contractions, 1-3 digits, punctuation, newlines, spaces.
    pat_str = "|".join([
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ])

    def __init__(self, vocab_file, bos_token: Union[str, AddedToken] = "[BOS]",
                 eos_token: Union[str, AddedToken] = "[EOS]", unk_token: Union[str, AddedToken, None] = None,
                 pad_token: Union[str, AddedToken, None] = None, additional_special_tokens: List[str] = None,
                 added_tokens_decoder: Optional[dict] = None, **kwargs):
        assert os.path.isfile(vocab_file), vocab_file
        if additional_special_tokens is None:
            additional_special_tokens = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                         "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]
        names = {index: token.content for index, token in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        first_special = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(first_special, first_special + self.num_reserved_special_tokens)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=self.pat_str, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.n_words = self.model.n_vocab
        self.bos_id = self.special_tokens[str(bos_token)]
        self.eos_id = self.special_tokens[str(eos_token)]
        self.pad_id = self.special_tokens[str(pad_token)]
        self.unk_id = self.special_tokens[str(unk_token)]
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        # Token strings in GPT-2's byte-to-unicode alphabet, so PreTrainedTokenizer can handle tokens as text.
        self.decoder = {i: "".join(self.byte_encoder[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.n_words)}
        self.encoder = {text: i for i, text in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)
        self.all_special_ids_set = set(self.all_special_ids)

    def encode(self, text: str, allow_special_tokens: bool = True, **kwargs) -> List[int]:
        # With any keyword (add_special_tokens=..., truncation=...) the generic transformers path runs instead; it
        # ends in _tokenize below.
        if kwargs:
            return super().encode(text, **kwargs)
        assert type(text) is str
        special = {"allowed_special": "all"} if allow_special_tokens else {"disallowed_special": ()}
        ids: List[int] = []
        for start in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in self._split_long_runs(text[start:start + MAX_ENCODE_CHARS], MAX_SAME_CLASS_RUN):
                ids.extend(self.model.encode(piece, **special))
        return ids

    def decode(self, token_ids: Union[int, List[int]], **kwargs) -> str:
        if kwargs:
            return super().decode(token_ids, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.model.decode(list(token_ids))

    @staticmethod
    def _split_long_runs(text: str, limit: int) -> Iterator[str]:
        """Cut `text` so no piece holds more than `limit` consecutive spaces or non-spaces."""
        run, start = 0, 0
        in_space = text[0].isspace() if text else False
        for index, char in enumerate(text):
            if char.isspace() != in_space:
                in_space, run = char.isspace(), 1
                continue
            run += 1
            if run > limit:
                yield text[start:index]
                start, run = index, 1
        yield text[start:]

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> Dict[str, int]:
        return self.encoder

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        return [self.decoder[i] for i in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.unk_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index)

    @staticmethod
    def clean_up_tokenization(out_string: str) -> str:
        return out_string

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        return bytearray(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None) -> Tuple[str]:
        target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            Path(target).write_bytes(Path(self.vocab_file).read_bytes())
        return (target,)

    def apply_chat_template(self, conversation, tools: Optional[list] = None, tokenize: bool = False,
                            add_generation_prompt: bool = True, thinking: bool = True, **kwargs):
        tools = sort_keys_deeply(tools)
        if tools:
            try:
                kwargs["tools_ts_str"] = encode_tools_to_typescript_style(tools)
            except Exception as error:  # the published code falls back to the template's JSON rendering
                print(f"Failed to convert tools to TypeScript style: {error}")
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, thinking=thinking, **kwargs)


def sort_keys_deeply(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: sort_keys_deeply(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [sort_keys_deeply(item) for item in value]
    return value
