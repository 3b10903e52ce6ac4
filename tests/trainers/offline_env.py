"""The trainers' own offline readers, run as they ship: SpecForge 0.2.0's OfflineEagle3Dataset and speculators
0.9.0's ArrowDataset, in a virtualenv with torch from PyPI (requirements-offline.txt).

Built once under ~/.cache/tokenmill/trainers-offline-<key>/ (about 5 GB, most of it torch's CUDA libraries, which
import without a GPU; under a minute from PyPI here), keyed by the requirements and the Python version, like
specforge_env.py. Each reader runs in a subprocess and answers JSON: per sample the arrays the trainer hands its
training step, as lists, so a test compares them with what the simulator served.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

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


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def env_key() -> str:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes() + " ".join(TRAINERS).encode()
                            + sys.version.encode()).hexdigest()[:12]
    return f"py{sys.version_info.major}{sys.version_info.minor}-{digest}"


def offline_python() -> Path:
    target = cache_root() / f"trainers-offline-{env_key()}"
    python = target / "bin" / "python"
    ready = target / ".ready"
    if ready.exists():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".trainers-offline-{env_key()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers build it once
        if not ready.exists():
            pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-cache-dir"]
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
            subprocess.run([*pip, "-r", str(REQUIREMENTS)], check=True)
            subprocess.run([*pip, "--no-deps", *TRAINERS], check=True)
            ready.write_text(env_key())
    return python


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
