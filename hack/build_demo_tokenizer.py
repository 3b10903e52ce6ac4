#!/usr/bin/env python3
"""Build the small, Kimi-like demo model folder (tokenizer + config) offline.

The result is committed under examples/demo-model/ so that `make demo` and the tests need no hub access.
Rerun this script only to change the tokenizer; it is deterministic (same corpus, same BPE merges).

    .venv/bin/python hack/build_demo_tokenizer.py [OUT_DIR]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

# Kimi-K2's special tokens, in Kimi's order. Their ids differ from Kimi's (the vocab is small), which is the
# point: nothing in tokenmill may hard-code them.
SPECIAL_TOKENS = [
    "[UNK]", "[PAD]", "[BOS]", "[EOS]",
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<think>", "</think>",
]

# Kimi-like: a tool_declare system block, role headers, reasoning of earlier assistant turns dropped
# (an empty <think></think>), tool calls in Kimi's section format, and a generation prompt that opens <think>.
CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- if role == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|><think></think>"
    "{%- elif role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ message.get('tool_call_id', '') }}{{ '\\n' }}"
    "{%- else -%}{{ raise_exception('unknown role: ' ~ role) }}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- endif -%}"
    "{%- if role == 'assistant' and message.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>functions.{{ call['function']['name'] }}:{{ loop.index0 }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>{%- endif -%}"
)

CORPUS_TEXT = """
The user is asking for the weather in Paris, so I should call the get_weather function with the city argument.
Let me think about this step by step. First, we need to understand what the question is asking.
We are given a right triangle with legs of length 3 and 4, so the hypotenuse is 5 by the Pythagorean theorem.
To prove that the sum of the first n odd numbers is n squared, we use induction on n.
The base case holds because 1 = 1. Assume it holds for n, then adding 2n + 1 gives (n + 1) squared.
Wait, that is not quite right. Let me reconsider the boundary conditions before writing the final answer.
The function returns None when the list is empty, which causes the TypeError in the caller.
I need to find where the configuration is loaded, then check how the timeout value is parsed.
The failing test expects a dictionary, but the implementation returns a list of tuples instead.
Here is the corrected implementation with a unit test that covers the empty input case.
Could you please provide the URL of the website you would like me to check?
I have booked a table for two at the restaurant at seven in the evening, and sent the confirmation.
The discounted price of the dress is 80 dollars after applying the 20 percent discount to 100 dollars.
Yes, the words listen and silent are anagrams because they contain exactly the same letters.
The mortgage payment is computed from the principal, the monthly interest rate and the number of payments.
In summary, the integral converges because the integrand decays faster than one over x squared.
Therefore, the answer is 42. Let me double check the arithmetic: 6 times 7 is 42, which matches.
Kubernetes schedules the pod onto a node with enough GPUs, and the operator updates the status conditions.
The server loads the model weights, allocates the KV cache, and reports that it is ready to serve requests.
Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen as a by-product.
The French Revolution began in 1789 and reshaped the political landscape of Europe for decades.
A binary search runs in logarithmic time because each comparison halves the remaining search interval.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
class Cache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: dict[str, bytes] = {}
for i in range(10):
    print(i * i)
import os, sys, json
diff --git a/src/app.py b/src/app.py
--- a/src/app.py
+++ b/src/app.py
@@ -10,7 +10,7 @@ def load(path):
-    return open(path).read()
+    with open(path) as handle:
+        return handle.read()
Traceback (most recent call last):
  File "main.py", line 3, in <module>
ValueError: invalid literal for int() with base 10: 'abc'
"""

CORPUS_JSON = [
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
    {"name": "calculate_discount", "arguments": {"original_price": 100, "discount_percentage": 20}},
    {"name": "check_website_status", "arguments": {"url": "https://example.com"}},
    {"name": "search_restaurants", "arguments": {"location": "New York", "cuisine": "Italian"}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount",
                                      "parameters": {"type": "object", "properties": {"amount": {"type": "number"}},
                                                     "required": ["amount"]}}},
]


# About 90M parameters in BF16 for the config below (embeddings + 8 layers of attention and MLP).
DEMO_WEIGHT_BYTES = 180_000_000


def corpus() -> list[str]:
    lines = [line for line in CORPUS_TEXT.splitlines() if line.strip()]
    lines += [json.dumps(item) for item in CORPUS_JSON]
    # Repeat so that frequent words merge into whole-word tokens, as in a real vocabulary.
    return lines * 8


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def model_config(tokenizer: PreTrainedTokenizerFast) -> dict:
    """A small Llama-shaped config: enough for context length, EOS ids and the server planner."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "bos_token_id": tokenizer.convert_tokens_to_ids("[BOS]"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "torch_dtype": "bfloat16",
    }


def build(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]", eos_token="<|im_end|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("[UNK]", "[PAD]", "[BOS]", "<|im_end|>")],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    fast.save_pretrained(out_dir)
    config = model_config(fast)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # No weights ship with the demo model (the simulator needs none); the index records what the planner reads.
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": DEMO_WEIGHT_BYTES}, "weight_map": {}}, indent=2) + "\n"
    )
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config["eos_token_id"], "bos_token_id": config["bos_token_id"]}, indent=2) + "\n"
    )
    check(out_dir)


def check(out_dir: Path) -> None:
    """Reload offline, as tokenmill does, and check the properties everything else relies on."""
    tok = AutoTokenizer.from_pretrained(out_dir)
    for token in SPECIAL_TOKENS:
        ids = tok.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise SystemExit(f"special token {token!r} encodes to {ids}, expected one id")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    if tok.convert_ids_to_tokens(ids[-1]) != "<think>":
        raise SystemExit("the generation prompt must end with <think>")
    print(f"wrote {out_dir}: vocab {len(tok)}, {len(ids)} ids for a one-line chat with a tool")


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "examples" / "demo-model")
