"""Reference prompt ids, computed by each model family's own code in the reference environment.

Runs inside the venv that `tests/reference/env.py` builds (transformers, tiktoken, mistral_common as SGLang's image
pins them), never in tokenmill's own venv, and imports nothing from tokenmill. For every fixture and prompt it
prints what the model's own code produces, the way SGLang calls it:
  - Hugging Face families (remote code included): AutoTokenizer.from_pretrained(folder, trust_remote_code=...,
    clean_up_tokenization_spaces=False), then apply_chat_template(messages, tools=..., add_generation_prompt=True,
    tokenize=True, **chat_template_kwargs) -- SGLang v0.5.9 utils/hf_transformers_utils.py:518-525 and
    entrypoints/openai/serving_chat.py:461-473;
  - Mistral tekken checkpoints (tekken.json, no tokenizer.json): mistral_common's own
    MistralTokenizer.encode_chat_completion(ChatCompletionRequest.from_openai(...)) -- the library SGLang v0.5.23
    loads such checkpoints with (utils/hf_transformers/mistral_utils.py:438-463, tokenizer.py "bare tekken").

    python reference_ids.py REQUEST.json   ->  JSON on stdout
REQUEST: {"prompts": "<prompts.jsonl>", "fixtures": {"<name>": {"path": "...", "trust_remote_code": bool,
          "kwargs": {...}}}}
"""

import json
import os
import sys
from importlib.metadata import version

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"


def read_prompts(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def hf_ids(folder, trust_remote_code, kwargs, prompts):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code,
                                              clean_up_tokenization_spaces=False)
    results = {}
    for prompt in prompts:
        try:
            ids = tokenizer.apply_chat_template(prompt["messages"], tools=prompt.get("tools"),
                                                add_generation_prompt=True, tokenize=True, **kwargs)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            results[prompt["sample_id"]] = {"ids": [int(i) for i in ids]}
        except Exception as error:  # a template that rejects a prompt is part of the reference too
            results[prompt["sample_id"]] = {"error": f"{type(error).__name__}: {error}"}
    return {"loader": type(tokenizer).__name__, "results": results}


def mistral_ids(folder, prompts):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tokenizer = MistralTokenizer.from_file(os.path.join(folder, "tekken.json"))
    results = {}
    for prompt in prompts:
        try:
            request = ChatCompletionRequest.from_openai(prompt["messages"], tools=prompt.get("tools"))
            results[prompt["sample_id"]] = {"ids": tokenizer.encode_chat_completion(request).tokens}
        except Exception as error:
            results[prompt["sample_id"]] = {"error": f"{type(error).__name__}: {error}"}
    return {"loader": "mistral_common", "results": results}


def main():
    with open(sys.argv[1]) as handle:
        request = json.load(handle)
    prompts = read_prompts(request["prompts"])
    out = {"versions": {name: version(name) for name in ("transformers", "tokenizers", "tiktoken", "jinja2",
                                                         "mistral_common")}, "fixtures": {}}
    for name, fixture in request["fixtures"].items():
        folder = fixture["path"]
        if os.path.isfile(os.path.join(folder, "tekken.json")) and not os.path.isfile(
                os.path.join(folder, "tokenizer.json")):
            out["fixtures"][name] = mistral_ids(folder, prompts)
        else:
            out["fixtures"][name] = hf_ids(folder, fixture.get("trust_remote_code", False),
                                           fixture.get("kwargs") or {}, prompts)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
