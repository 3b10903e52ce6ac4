#!/usr/bin/env python3
"""Build the tokenizer fixtures under tests/fixtures/tokenizers/<family>/, offline and deterministically.

Each fixture reproduces how a model family is really packaged (file names, where special tokens sit, remote code,
chat template and its quirks, config.json / generation_config.json as the model ships them) around a small
vocabulary trained here on the demo prompts with the family's own pre-tokenizer regex. What is real and what is
synthetic is written in each fixture's PROVENANCE.md.

Hand-written parts (templates, Kimi's remote code) live in hack/tokenizer_fixtures/<family>/ and are copied in.

    .venv/bin/python hack/build_tokenizer_fixtures.py [--out tests/fixtures/tokenizers]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one thread: the BPE trainer is then reproducible byte for byte
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from tokenizers.processors import TemplateProcessing  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "hack" / "tokenizer_fixtures"
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "tokenizers"
VOCAB_SIZE = 2000

# Pre-tokenizer regexes, as each family publishes them (tokenizer.json "Split" patterns / tiktoken pat_str).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                  r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK_SPLITS = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                   r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+"
                   r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Kimi's tiktoken pat_str uses `&&` class intersection, which the Rust `regex` crate under HF tokenizers lacks;
# the vocabulary is trained with an equivalent pattern (Han runs split off first), the tokenizer itself runs Kimi's.
KIMI_TRAIN_PATTERN = (r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                      r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                      r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")


# The templates in the corpus: the families that train their own vocabulary on it. Fixed, so that a new family's
# template changes no other fixture's vocabulary (qwen3-coder and deepseek-v3.1 copy their siblings' tokenizer
# files, as the real models share them; glm-4.5 trains its own without its template in the corpus).
TRAINED_ON_TEMPLATES = ("deepseek-r1", "gpt-oss", "kimi-k2.5", "llama-3.1", "qwen3")


# -- corpus -----------------------------------------------------------------------------------------------------
def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def corpus() -> list[str]:
    """Every string of the demo prompts and the fixtures' prompt set, plus the tools as JSON and template text."""
    texts: list[str] = []
    files = sorted((ROOT / "examples" / "prompts").glob("*.jsonl")) + [DEFAULT_OUT / "prompts.jsonl"]
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                texts.extend(_strings(row.get("messages", [])))  # ShareGPT rows ("conversations") are not read
                if row.get("tools"):
                    texts.append(json.dumps(row["tools"]))
    for family in TRAINED_ON_TEMPLATES:
        texts.append((SOURCES / family / "chat_template.jinja").read_text())
    sys.path.insert(0, str(ROOT / "runner" / "sim"))
    from tokenmill_sim import textbank

    texts.extend(textbank.REASONING + textbank.ANSWER + textbank.CLARIFICATION)
    return texts


# -- vocabularies -----------------------------------------------------------------------------------------------
def byte_level_bpe(texts: list[str], pre_tokenizer: pre_tokenizers.PreTokenizer, leading: list[str] = (),
                   normalizer: normalizers.Normalizer | None = None, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE over all 256 bytes; `leading` tokens take the first ids, as in DeepSeek's vocabulary."""
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(leading), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def split_then_bytes(*patterns: str, behavior: str = "isolated") -> pre_tokenizers.PreTokenizer:
    steps = [pre_tokenizers.Split(Regex(p), behavior=behavior, invert=False) for p in patterns]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def add_specials(tokenizer: Tokenizer, names: list[str], special: Callable[[str], bool] = lambda _: True) -> None:
    """Append tokens after the base vocabulary, in order (ids = vocab size + position)."""
    for name in names:
        tokenizer.add_tokens([AddedToken(name, special=special(name), normalized=False)])


def byte_ranks(tokenizer: Tokenizer) -> list[bytes]:
    """The trained vocabulary as raw bytes in id order: tiktoken's and tekken's mergeable ranks."""
    decoder = _unicode_to_byte()
    vocab = sorted(tokenizer.get_vocab(with_added_tokens=False).items(), key=lambda item: item[1])
    merged = [bytes(decoder[ch] for ch in token) for token, _ in vocab]
    assert len({r for r in merged if len(r) == 1}) == 256, "every byte must be a token"
    # Rank i < 256 is the byte i (tekken asserts it; tiktoken's own files are laid out so), merges follow in
    # training order, which keeps every token's parts ranked below it.
    return [bytes([i]) for i in range(256)] + [r for r in merged if len(r) > 1]


def _unicode_to_byte() -> dict[str, int]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[chr(byte)] = byte
        else:
            mapping[chr(256 + extra)] = byte
            extra += 1
    return mapping


# -- writers ----------------------------------------------------------------------------------------------------
def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def added_tokens_decoder(tokenizer: Tokenizer, first: int) -> dict[str, dict]:
    table = {}
    for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items()):
        if token_id >= first or token_id < 3:
            table[str(token_id)] = {"content": token.content, "lstrip": False, "normalized": False,
                                    "rstrip": False, "single_word": False, "special": token.special}
    return table


def copy_sources(family: str, target: Path, names: list[str]) -> None:
    for name in names:
        shutil.copyfile(SOURCES / family / name, target / name)


# -- families ---------------------------------------------------------------------------------------------------
KIMI_NAMED = {  # offset after the base vocabulary -> name; real offsets from Kimi-K2 (163584 + offset)
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
    21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}


def build_kimi(texts: list[str], out: Path) -> None:
    trained = byte_level_bpe(texts, split_then_bytes(KIMI_TRAIN_PATTERN))
    ranks = byte_ranks(trained)
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(r).decode()} {i}\n" for i, r in enumerate(ranks)))
    base = len(ranks)
    decoder = {}
    for offset in range(256):
        name = KIMI_NAMED.get(offset, f"<|reserved_token_{base + offset}|>")
        decoder[str(base + offset)] = {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True}
    write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "clean_up_tokenization_spaces": False, "eos_token": "[EOS]",
        "extra_special_tokens": {}, "model_max_length": 1000000000000000019884624838656, "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer", "unk_token": "[UNK]",
    })
    copy_sources("kimi-k2.5", out, ["tokenization_kimi.py", "tool_declaration_ts.py", "chat_template.jinja"])
    vocab = base + 256
    write_json(out / "config.json", {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "bos_token_id": base, "eos_token_id": base + 1, "media_placeholder_token_id": base + 21,
        "model_type": "kimi_k25", "pad_token_id": base + 255, "tie_word_embeddings": False,
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "bos_token_id": base,
            "eos_token_id": base + 1, "pad_token_id": base + 255, "vocab_size": vocab,
            "max_position_embeddings": 262144, "hidden_size": 7168, "num_hidden_layers": 61,
            "num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384,
            "num_experts_per_tok": 8, "first_k_dense_replace": 1, "torch_dtype": "bfloat16",
        },
        "vision_config": {"model_type": "kimi_k25_vision"},
    })
    write_json(out / "generation_config.json", {"max_length": 262144, "eos_token_id": base + 2})


QWEN3_SPECIALS = [  # in order after the base vocabulary (151643 + i in Qwen3); the last 12 are not "special"
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]


def build_qwen3(texts: list[str], out: Path) -> None:
    tok = byte_level_bpe(texts, split_then_bytes(QWEN2_PATTERN), normalizer=normalizers.NFC())
    base = tok.get_vocab_size()
    add_specials(tok, QWEN3_SPECIALS, special=lambda name: QWEN3_SPECIALS.index(name) < 14)
    tok.save(str(out / "tokenizer.json"))
    ids = {name: base + i for i, name in enumerate(QWEN3_SPECIALS)}
    write_json(out / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added_tokens_decoder(tok, base),
        "additional_special_tokens": QWEN3_SPECIALS[1:14], "bos_token": None,
        "chat_template": (SOURCES / "qwen3" / "chat_template.jinja").read_text(),
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    })
    write_json(out / "config.json", {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"], "vocab_size": base + len(QWEN3_SPECIALS), "hidden_size": 4096,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    })
    write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0",
    })


def from_sibling(sibling: str, family: str, out: Path) -> None:
    """A family that ships its sibling's tokenizer files (as built in the same output folder) with its own template
    in tokenizer_config.json."""
    source = out.parent / sibling
    shutil.copyfile(source / "tokenizer.json", out / "tokenizer.json")
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(source / name, out / name)
    settings = json.loads((source / "tokenizer_config.json").read_text())
    write_json(out / "tokenizer_config.json",
               {**settings, "chat_template": (SOURCES / family / "chat_template.jinja").read_text()})


def build_qwen3_coder(texts: list[str], out: Path) -> None:
    """Qwen3-Coder ships Qwen3's vocabulary and special tokens with its own template, config and sampling."""
    from_sibling("qwen3", "qwen3-coder", out)
    config = json.loads((out / "config.json").read_text())
    write_json(out / "config.json", {**config, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                                     "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                                     "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                                     "moe_intermediate_size": 768, "max_position_embeddings": 262144})
    generation = json.loads((out / "generation_config.json").read_text())
    write_json(out / "generation_config.json", {**generation, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                "repetition_penalty": 1.05})


def _llama_specials() -> list[str]:
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    return names + [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(names))]


def build_llama(texts: list[str], out: Path) -> None:
    tok = byte_level_bpe(texts, split_then_bytes(LLAMA3_PATTERN))
    base = tok.get_vocab_size()
    specials = _llama_specials()
    add_specials(tok, specials)
    bos = base
    # Llama 3's tokenizer.json prepends <|begin_of_text|> itself; the template writes bos_token too, so any path
    # that encodes the rendered text with add_special_tokens=True doubles it.
    tok.post_processor = TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                            special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(out / "tokenizer.json"))
    eos = [base + 1, base + 8, base + 9]
    write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": added_tokens_decoder(tok, base), "bos_token": "<|begin_of_text|>",
        "chat_template": (SOURCES / "llama-3.1" / "chat_template.jinja").read_text(),
        "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    write_json(out / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": bos, "eos_token_id": eos,
        "vocab_size": base + len(specials), "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    })
    write_json(out / "generation_config.json", {"bos_token_id": bos, "do_sample": True, "eos_token_id": eos,
                                                 "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.42.3"})


DEEPSEEK_LEADING = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
DEEPSEEK_NAMED = [  # after the placeholder block, in DeepSeek-V3/R1's order (128798 onward)
    "<think>", "</think>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜User｜>", "<｜Assistant｜>",
    "<|EOT|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]
DEEPSEEK_NOT_SPECIAL = {"<think>", "</think>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜User｜>",
                        "<｜Assistant｜>", "<|EOT|>"} | set(DEEPSEEK_NAMED[8:])
DEEPSEEK_PLACEHOLDERS = 16  # the real block has 798 "<｜place▁holder▁no▁N｜>" tokens; a few keep the shape


def build_deepseek(texts: list[str], out: Path) -> None:
    tok = byte_level_bpe(texts, split_then_bytes(*DEEPSEEK_SPLITS), leading=DEEPSEEK_LEADING)
    base = tok.get_vocab_size()
    placeholders = [f"<｜place▁holder▁no▁{i}｜>" for i in range(DEEPSEEK_PLACEHOLDERS)]
    add_specials(tok, placeholders + DEEPSEEK_NAMED, special=lambda name: name not in DEEPSEEK_NOT_SPECIAL)
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": added_tokens_decoder(tok, base),
        "bos_token": {"__type": "AddedToken", "content": DEEPSEEK_LEADING[0], "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "chat_template": (SOURCES / "deepseek-r1" / "chat_template.jinja").read_text(),
        "clean_up_tokenization_spaces": False,
        "eos_token": {"__type": "AddedToken", "content": DEEPSEEK_LEADING[1], "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "legacy": True, "model_max_length": 16384,
        "pad_token": {"__type": "AddedToken", "content": DEEPSEEK_LEADING[1], "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "sp_model_kwargs": {}, "unk_token": None, "tokenizer_class": "LlamaTokenizerFast",
    })
    write_json(out / "config.json", {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "bos_token_id": 0, "eos_token_id": 1, "vocab_size": base + DEEPSEEK_PLACEHOLDERS + len(DEEPSEEK_NAMED),
        "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8, "max_position_embeddings": 163840,
        "torch_dtype": "bfloat16",
    })
    write_json(out / "generation_config.json", {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1,
                                                 "do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                                 "transformers_version": "4.46.3"})


def deepseek_successor(family: str, out: Path) -> None:
    """DeepSeek-V3.1 and V3.2 keep V3's vocabulary and special tokens (V3.2's DSML calls are plain text) with their
    own templates and V3.1's sampling defaults."""
    from_sibling("deepseek-r1", family, out)
    config = json.loads((out / "config.json").read_text())
    write_json(out / "config.json", {**config, "max_position_embeddings": 163840})
    write_json(out / "generation_config.json", {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1,
                                                 "do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                                 "transformers_version": "4.44.2"})


def build_deepseek_v31(texts: list[str], out: Path) -> None:
    """Its template writes calls as NAME<｜tool▁sep｜>{json}."""
    deepseek_successor("deepseek-v3.1", out)


def build_deepseek_v32(texts: list[str], out: Path) -> None:
    """Its template writes calls as DSML blocks; the model adds sparse attention (index_topk)."""
    deepseek_successor("deepseek-v3.2", out)
    config = json.loads((out / "config.json").read_text())
    write_json(out / "config.json", {**config, "architectures": ["DeepseekV32ForCausalLM"],
                                     "model_type": "deepseek_v32", "index_topk": 2048})


GLM_SPECIALS = [  # in order after the base vocabulary (151329 + i in GLM-4.5); the think/tool markers not special
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>", "/nothink", "<think>", "</think>", "<tool_call>",
    "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
]
GLM_NOT_SPECIAL = set(GLM_SPECIALS[21:])


def build_glm45(texts: list[str], out: Path) -> None:
    tok = byte_level_bpe(texts, split_then_bytes(LLAMA3_PATTERN))
    base = tok.get_vocab_size()
    add_specials(tok, GLM_SPECIALS, special=lambda name: name not in GLM_NOT_SPECIAL)
    tok.save(str(out / "tokenizer.json"))
    ids = {name: base + i for i, name in enumerate(GLM_SPECIALS)}
    write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": added_tokens_decoder(tok, base), "additional_special_tokens": GLM_SPECIALS[:21],
        "clean_up_tokenization_spaces": False, "do_lower_case": False, "eos_token": "<|endoftext|>",
        "extra_special_tokens": {}, "model_max_length": 128000, "pad_token": "<|endoftext|>", "padding_side": "left",
        "remove_space": False, "tokenizer_class": "PreTrainedTokenizerFast",
    })
    copy_sources("glm-4.5", out, ["chat_template.jinja"])
    eos = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    write_json(out / "config.json", {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "eos_token_id": eos,
        "pad_token_id": ids["<|endoftext|>"], "vocab_size": base + len(GLM_SPECIALS), "hidden_size": 5120,
        "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "n_routed_experts": 160, "num_experts_per_tok": 8, "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    })
    write_json(out / "generation_config.json", {"_from_model_config": True, "eos_token_id": eos,
                                                 "pad_token_id": ids["<|endoftext|>"], "temperature": 0.6,
                                                 "top_p": 0.95, "transformers_version": "4.54.0"})


def _gpt_oss_specials() -> list[str]:
    named = {0: "<|startoftext|>", 1: "<|endoftext|>", 4: "<|return|>", 5: "<|constrain|>", 7: "<|channel|>",
             8: "<|start|>", 9: "<|end|>", 10: "<|message|>", 14: "<|call|>"}
    # offsets from 199998; reserved slots are named by their real id (<|reserved_200000|> ...)
    return [named.get(i, f"<|reserved_{199998 + i}|>") for i in range(21)]


def build_gpt_oss(texts: list[str], out: Path) -> None:
    tok = byte_level_bpe(texts, split_then_bytes(O200K_PATTERN))
    base = tok.get_vocab_size()
    specials = _gpt_oss_specials()
    add_specials(tok, specials)
    tok.save(str(out / "tokenizer.json"))
    ids = {name: base + i for i, name in enumerate(specials)}
    write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": added_tokens_decoder(tok, base), "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": False, "eos_token": "<|return|>", "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast",
    })
    copy_sources("gpt-oss", out, ["chat_template.jinja"])
    write_json(out / "config.json", {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "eos_token_id": ids["<|return|>"],
        "pad_token_id": ids["<|endoftext|>"], "vocab_size": base + len(specials), "hidden_size": 2880,
        "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 128, "experts_per_token": 4, "max_position_embeddings": 131072,
        "initial_context_length": 4096, "sliding_window": 128, "torch_dtype": "bfloat16",
    })
    write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|startoftext|>"], "do_sample": True,
        "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]],
        "pad_token_id": ids["<|endoftext|>"], "transformers_version": "4.55.0.dev0",
    })


TEKKEN_SPECIALS = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 5: "[AVAILABLE_TOOLS]",
                   6: "[/AVAILABLE_TOOLS]", 7: "[TOOL_RESULTS]", 8: "[/TOOL_RESULTS]", 9: "[TOOL_CALLS]",
                   10: "[IMG]", 11: "<pad>", 12: "[IMG_BREAK]", 13: "[IMG_END]", 14: "[PREFIX]", 15: "[MIDDLE]",
                   16: "[SUFFIX]", 17: "[SYSTEM_PROMPT]", 18: "[/SYSTEM_PROMPT]", 19: "[TOOL_CONTENT]",
                   32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]"}
TEKKEN_NUM_SPECIAL = 1000


def build_mistral(texts: list[str], out: Path) -> None:
    ranks = byte_ranks(byte_level_bpe(texts, split_then_bytes(TEKKEN_PATTERN)))
    specials = [{"rank": i, "token_str": TEKKEN_SPECIALS.get(i, f"<SPECIAL_{i}>"), "is_control": True}
                for i in range(TEKKEN_NUM_SPECIAL)]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(r).decode(), "token_str": r.decode("utf-8", "replace")}
             for i, r in enumerate(ranks)]
    write_json(out / "tekken.json", {
        "config": {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": len(ranks),
                   "default_vocab_size": len(ranks) + TEKKEN_NUM_SPECIAL,
                   "default_num_special_tokens": TEKKEN_NUM_SPECIAL, "version": "v13"},
        "vocab": vocab, "special_tokens": specials,
    })
    write_json(out / "params.json", {
        "dim": 5120, "n_layers": 40, "head_dim": 128, "hidden_dim": 32768, "n_heads": 32, "n_kv_heads": 8,
        "rope_theta": 1000000000.0, "norm_eps": 1e-05, "vocab_size": len(ranks) + TEKKEN_NUM_SPECIAL,
        "max_seq_len": 131072,
    })
    write_json(out / "config.json", {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
        "vocab_size": len(ranks) + TEKKEN_NUM_SPECIAL, "hidden_size": 5120, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    })
    write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True,
                                                 "temperature": 0.7, "top_p": 0.95, "max_length": 131072})


FAMILIES: dict[str, Callable[[list[str], Path], None]] = {
    "kimi-k2.5": build_kimi, "qwen3": build_qwen3, "llama-3.1": build_llama, "deepseek-r1": build_deepseek,
    "gpt-oss": build_gpt_oss, "mistral-tekken": build_mistral, "qwen3-coder": build_qwen3_coder,
    "deepseek-v3.1": build_deepseek_v31, "deepseek-v3.2": build_deepseek_v32, "glm-4.5": build_glm45,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("families", nargs="*", default=sorted(FAMILIES))
    args = parser.parse_args(argv)
    texts = corpus()
    for family in args.families:
        target = args.out / family
        provenance = target / "PROVENANCE.md"
        kept = provenance.read_text() if provenance.exists() else None
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        FAMILIES[family](texts, target)
        if kept is not None:
            provenance.write_text(kept)
        size = sum(p.stat().st_size for p in target.iterdir())
        print(f"{family}: {size / 1024:.0f} KiB in {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
