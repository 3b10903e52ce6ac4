"""SpecForge's own code, run as it ships: a virtualenv with `specforge==0.2.0 --no-deps` and what its data modules
import (requirements-specforge.txt).

Built once under ~/.cache/tokenmill/specforge-<key>/ (a few small wheels from PyPI, seconds; the key hashes
requirements-specforge.txt and the Python version), like tests/reference/env.py. `read_prompts(path)` runs
`specforge.data.prompt_builder.prepare_prompt_tasks` on a file there and returns its tasks, or its error message.
`loss_masks(...)` runs SpecForge's own parser (`specforge.data.parse`, the class its preprocessing picks for the
template, SF data/preprocessing.py:140-143) on pre-formatted texts and returns its input ids and loss masks.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tests.venv_cache import cached_python, env_key

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements-specforge.txt"

READ = """
import json, sys
from specforge.data.prompt_builder import prepare_prompt_tasks
try:
    tasks = prepare_prompt_tasks(sys.argv[1], None, chat_template=None, max_length=int(sys.argv[2]),
                                 is_preformatted=False, train_only_last_turn=False, cache_dir=None, cache_key=None,
                                 num_proc=1)
except ValueError as error:
    print(json.dumps({"error": str(error)}))
else:
    print(json.dumps({"tasks": list(tasks)}))
"""


def specforge_python() -> Path:
    return cached_python("specforge", env_key(REQUIREMENTS.read_bytes()), [["--no-deps", "-r", str(REQUIREMENTS)]])


def read_prompts(path: Path, max_length: int = 1 << 20) -> dict[str, Any]:
    """{"tasks": [{"payload": {"input_ids", "loss_mask"}}, ...]} or {"error": message}, from SpecForge itself."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    done = subprocess.run([str(specforge_python()), "-c", READ, str(path), str(max_length)], capture_output=True,
                          text=True, env=env, cwd=tempfile.gettempdir(), check=False, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"SpecForge's reader failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


# parse.py imports torch and transformers for one zeros tensor and a type name; the stand-ins below give it exactly
# that (a list whose slices take a number), and the tokenizer is the model's tokenizer.json through `tokenizers`,
# called the way parse.py calls a Hugging Face tokenizer (add_special_tokens=False; truncation is not reached).
MASKS = """
import json, sys, types

class Mask(list):
    def __setitem__(self, key, value):
        if isinstance(key, slice) and not isinstance(value, list):
            value = [value] * len(range(*key.indices(len(self))))
        super().__setitem__(key, value)

torch = types.ModuleType("torch")
torch.zeros = lambda n, dtype=None: Mask([0] * n)
torch.long, torch.Tensor = "long", list
transformers = types.ModuleType("transformers")
transformers.PreTrainedTokenizer = object
sys.modules.update(torch=torch, transformers=transformers)

from tokenizers import Tokenizer
from specforge.data.parse import GeneralParser, ThinkingParser
from specforge.data.template import TEMPLATE_REGISTRY

class HFTokenizer:
    pad_token_id, unk_token_id = 0, 0

    def __init__(self, path):
        self.tokenizer = Tokenizer.from_file(path)

    def encode(self, text, add_special_tokens=False, truncation=False, max_length=None):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text, add_special_tokens=False, **ignored):
        return types.SimpleNamespace(input_ids=[self.encode(text, add_special_tokens)])

request = json.load(sys.stdin)
template = TEMPLATE_REGISTRY.get(request["template"])
parser = {"general": GeneralParser, "thinking": ThinkingParser}[template.parser_type](
    HFTokenizer(request["tokenizer"]), template)
out = []
for text in request["texts"]:
    ids, mask = parser.parse(text, 1 << 20, preformatted=True, train_only_last_turn=request["last_turn"])
    out.append({"input_ids": list(ids), "loss_mask": list(mask)})
print(json.dumps(out))
"""


def loss_masks(tokenizer_json: Path, template: str, texts: list[str], last_turn: bool = True) -> list[dict[str, Any]]:
    """[{input_ids, loss_mask}] per text, from SpecForge's own parser (SF data/parse.py:266-347)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    request = json.dumps({"tokenizer": str(tokenizer_json), "template": template, "texts": texts,
                          "last_turn": last_turn})
    done = subprocess.run([str(specforge_python()), "-c", MASKS], input=request, capture_output=True, text=True,
                          env=env, cwd=tempfile.gettempdir(), check=False, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"SpecForge's parser failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)
