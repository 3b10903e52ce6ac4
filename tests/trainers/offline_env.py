"""The trainers' own offline readers, run as they ship: SpecForge 0.2.0's OfflineEagle3Dataset and speculators
0.9.0's ArrowDataset (with hs-connectors 0.9.0's FP8Transfer for fp8 states), and both trainers' vocabulary-mapping
loaders and builders, in a virtualenv with torch from PyPI (requirements-offline.txt).

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
from pathlib import Path
import torch
from hs_connectors import FP8Transfer
from speculators.train.data import ArrowDataset

# --hidden-states-backend fp8: FP8Backend.from_train_args builds FP8Transfer(data_path / "hidden_states")
# (hs_connectors/transfer.py:291-300), which speculators hands ArrowDataset (train/cli.py:708-716).
transfer = FP8Transfer(Path(sys.argv[1]) / "hidden_states") if sys.argv[3] == "fp8" else None
dataset = ArrowDataset(max_len=int(sys.argv[2]), datapath=sys.argv[1], on_missing="raise", transfer=transfer)
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


def _run(script: str, *args: str) -> Any:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["HF_DATASETS_OFFLINE"] = env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run([str(offline_python()), "-c", script, *args], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir(), check=False, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the trainer's reader failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def specforge_offline(folder: Path, max_len: int = 1 << 20) -> list[dict[str, Any]]:
    """Per .ckpt under `folder` (sorted as SpecForge lists them): the sample OfflineEagle3Dataset.process_data
    returns (input_ids, loss_mask, target = the final state, hidden_state = the aux layers, attention_mask)."""
    return _run(SPECFORGE, str(folder), str(max_len))


def speculators_offline(datapath: Path, max_len: int = 1 << 20, backend: str = "file") -> list[dict[str, Any]]:
    """Per row of the Arrow dataset at `datapath`: what ArrowDataset._get_raw_data returns (hidden_states = the aux
    layers flattened, verifier_last_hidden_states, input_ids from the states file, loss_mask), or why not; `backend`
    fp8 reads through hs-connectors' FP8Transfer, as `--hidden-states-backend fp8` does."""
    return _run(SPECULATORS, str(datapath), str(max_len), backend)


HS_FP8 = """
import json, sys
import torch
from safetensors.torch import load_file
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

# Each stored file against what hs-connectors' own quantizer writes for the served states (fp8_utils.py:29-51,
# fp8_hidden_states_connector.py:47-56): the same fp8 bytes and the same scales.
out = []
for path, served in json.load(open(sys.argv[1])):
    stored = load_file(path)
    states = torch.tensor(served, dtype=torch.float64).to(torch.bfloat16).reshape(stored["hidden_states"].shape)
    fp8, scales = quantize_tensor_to_fp8(states)
    out.append({"dtype": str(stored["hidden_states"].dtype), "scales_shape": list(stored[SCALES_KEY].shape),
                "values_equal": torch.equal(fp8.view(torch.uint8), stored["hidden_states"].view(torch.uint8)),
                "scales_equal": torch.equal(scales, stored[SCALES_KEY]),
                "token_ids": stored["token_ids"].tolist()})
print(json.dumps(out))
"""


def hs_connectors_fp8(pairs: list[tuple[str, list[list[float]]]], scratch: Path) -> list[dict[str, Any]]:
    """Per (stored file, the served states [n, layers * hidden]): whether hs-connectors quantizes the served states
    to exactly the file's fp8 values and scales."""
    listing = scratch / "fp8-pairs.json"
    listing.write_text(json.dumps(pairs))
    return _run(HS_FP8, str(listing))


VOCAB = """
import argparse, json, sys
from collections import Counter
from pathlib import Path
import numpy as np
import torch
from torch import nn
from speculators.train.cli import parse_vocab_mappings
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from specforge.core.compact_teacher import validate_vocab_mapping_consistency
from specforge.data.preprocessing import process_token_dict_to_mappings
from specforge.modeling.draft.base import Eagle3DraftModel

dest, records, vocab_size = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
sizes = [int(size) for size in sys.argv[4].split(",")]
# SpecForge's own count over the pre-tokenized records in file order: each record's masked ids, unique, into a
# Counter (generate_vocab_mapping_file, specforge/data/preprocessing.py:616-625).
token_dict = Counter()
for path in sorted(records.glob("*.jsonl")):
    for line in path.read_text().splitlines():
        record = json.loads(line)
        ids, mask = torch.tensor(record["input_ids"]), torch.tensor(record["loss_mask"])
        unique, counts = ids[mask == 1].unique(return_counts=True)
        token_dict.update(dict(zip(unique.tolist(), counts.tolist())))
token_freq = torch.load(dest / "token_freq.pt", weights_only=True)  # as speculators loads it (train/cli.py:367)
out = {"token_freq": {str(k): v for k, v in token_freq.items()}, "sizes": {}}
for size in sizes:
    # speculators finds d2t-<size>.npy / t2d-<size>.npy in its data path and loads them (train/cli.py:343-357, 404-411)
    args = argparse.Namespace(d2t_path=None, t2d_path=None, data_path=str(dest), draft_vocab_size=size,
                              token_freq_path=None, verifier_name_or_path=None, trust_remote_code=False)
    d2t, t2d, loaded_size = parse_vocab_mappings(args)
    built_d2t, built_t2d = build_vocab_mappings_from_distribution(token_freq, size, vocab_size)
    sf_d2t, sf_t2d = process_token_dict_to_mappings(Counter(token_dict), size, vocab_size)
    # SpecForge's draft model loads model.vocab_mapping_path into its buffers (modeling/draft/base.py:193-206)
    holder = nn.Module()
    holder.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))
    holder.register_buffer("d2t", torch.zeros(size, dtype=torch.int64))
    Eagle3DraftModel.load_vocab_mapping(holder, str(dest / f"specforge-vocab-mapping-{size}.pt"))
    validate_vocab_mapping_consistency(holder.t2d, holder.d2t)
    # SGLang 0.5.23's load_token_map: torch.load of a list of ids, made an int64 tensor (spec_utils.py:818-819)
    hot = torch.tensor(torch.load(dest / f"sglang-token-map-{size}.pt", weights_only=True), dtype=torch.int64)
    out["sizes"][size] = {
        "speculators_loaded": [d2t.tolist(), t2d.nonzero().flatten().tolist(), loaded_size, t2d.dtype == torch.bool,
                               d2t.dtype == torch.int64, int(t2d.shape[0])],
        "speculators_built": [built_d2t.tolist(), built_t2d.nonzero().flatten().tolist()],
        "specforge_loaded": [holder.d2t.tolist(), holder.t2d.nonzero().flatten().tolist()],
        "specforge_built": [sf_d2t.tolist(), sf_t2d.nonzero().flatten().tolist()],
        "sglang_hot": hot.tolist(),
    }
print(json.dumps(out))
"""


def vocab_maps(dest: Path, specforge_records: Path, vocab_size: int, sizes: list[int]) -> dict[str, Any]:
    """What the trainers load from a `--format vocab` export at `dest`, and what each builds itself: speculators
    from token_freq.pt, SpecForge from the `specforge` export's records at `specforge_records`."""
    result: dict[str, Any] = _run(VOCAB, str(dest), str(specforge_records), str(vocab_size),
                                  ",".join(map(str, sizes)))
    return result
