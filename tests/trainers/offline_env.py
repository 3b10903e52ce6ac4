"""The trainers' own offline readers, run as they ship: SpecForge 0.2.0's OfflineEagle3Dataset and speculators
0.9.0's ArrowDataset, in a virtualenv with torch from PyPI (requirements-offline.txt).

Built once under ~/.cache/tokenmill/trainers-offline-<key>/ (about 5 GB, most of it torch's CUDA libraries, which
import without a GPU; under a minute from PyPI here), keyed by the requirements and the Python version, like
specforge_env.py. Each reader runs in a subprocess and answers JSON: per sample the arrays the trainer hands its
training step, as lists, so a test compares them with what the simulator served.
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
REQUIREMENTS = HERE / "requirements-offline.txt"
TRAINERS = ("specforge==0.2.0", "speculators==0.9.0")

SPECFORGE = """
import json, sys
import torch
from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files

paths = list_local_files(sys.argv[1])
dataset = OfflineEagle3Dataset(paths, max_len=int(sys.argv[2]))
out = []
for index, path in enumerate(paths):
    item = dataset[index]
    out.append({"path": path, **{key: value.float().tolist() if value.is_floating_point() else value.tolist()
                                 for key, value in item.items()},
                "dtypes": {key: str(value.dtype) for key, value in item.items()}})
print(json.dumps(out))
"""

SPECULATORS = """
import json, sys
import torch
from speculators.train.data import ArrowDataset

dataset = ArrowDataset(max_len=int(sys.argv[2]), datapath=sys.argv[1], on_missing="raise")
out = []
for index in range(len(dataset)):
    item = dataset._get_raw_data(index)
    if not isinstance(item, dict):
        out.append({"unavailable": getattr(item, "reason", None) or "unavailable"})
        continue
    out.append({key: value.float().tolist() if value.is_floating_point() else value.tolist()
                for key, value in item.items()})
print(json.dumps(out))
"""


def offline_python() -> Path:
    return cached_python("trainers-offline", env_key(REQUIREMENTS.read_bytes(), " ".join(TRAINERS).encode()),
                         [["--no-cache-dir", "-r", str(REQUIREMENTS)], ["--no-cache-dir", "--no-deps", *TRAINERS]])


def _run(script: str, *args: str) -> list[dict[str, Any]]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["HF_DATASETS_OFFLINE"] = env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run([str(offline_python()), "-c", script, *args], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir(), check=False, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the trainer's reader failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def specforge_offline(folder: Path, max_len: int = 1 << 20) -> list[dict[str, Any]]:
    """Per .ckpt under `folder` (sorted as SpecForge lists them): the sample OfflineEagle3Dataset.process_data
    returns (input_ids, loss_mask, target = the final state, hidden_state = the aux layers, attention_mask)."""
    return _run(SPECFORGE, str(folder), str(max_len))


def speculators_offline(datapath: Path, max_len: int = 1 << 20) -> list[dict[str, Any]]:
    """Per row of the Arrow dataset at `datapath`: what ArrowDataset._get_raw_data returns (hidden_states = the aux
    layers flattened, verifier_last_hidden_states, input_ids from the states file, loss_mask), or why not."""
    return _run(SPECULATORS, str(datapath), str(max_len))
