"""`tokenmill export --format vocab` read by the trainers' own code (tests/trainers/offline_env.py: speculators 0.9.0,
SpecForge 0.2.0 and torch from PyPI, CPU only, built once and cached):

- speculators finds d2t-<size>.npy and t2d-<size>.npy in its data path and loads them (speculators/train/cli.py:
  343-357, 396-416); they equal what it builds itself from our token_freq.pt (train/vocab_mapping.py:74-106), ties
  broken by (-count, id);
- SpecForge's draft model loads our model.vocab_mapping_path into its buffers (modeling/draft/base.py:193-206), the
  consistency check of its compact teacher passes (core/compact_teacher.py:217-231), and the map equals what
  SpecForge builds itself from the `specforge` export of the same run (data/preprocessing.py:616-625, 720-770),
  ties broken by the order it meets ids in;
- SGLang's token map is `torch.load` of a list of ids made an int64 tensor (sglang 0.5.23
  srt/speculative/spec_utils.py:818-819): the `size` most frequent ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.recount import recount
from tests.trainers.offline_env import vocab_maps
from tokenmill_runner.store.storage import LocalStorage

from .test_exactly_once import run_cli
from .workloads import chat, spec_document, write_jsonl, write_spec

DEMO_VOCAB = 1131  # examples/demo-model/config.json vocab_size


@pytest.fixture
def sim(demo_model: Path):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    with SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0, max_running_requests=32)) as server:
        yield server


def export(out: Path, dest: Path, fmt: str, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "export", str(out), str(dest), "--format",
                           fmt, *extra], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def tied_cut(counts: Counter[int], met: list[int]) -> int:
    """A size that cuts through ids of equal count where the trainers keep different ones: speculators the smaller
    ids, SpecForge those it met first (`met`: the order a trainer counting record by record meets them)."""
    by_id = sorted(counts, key=lambda tid: (-counts[tid], tid))
    first_met = {tid: rank for rank, tid in enumerate(met)}
    by_meeting = sorted(counts, key=lambda tid: (-counts[tid], first_met[tid]))
    return next(k for k in range(1, len(by_id)) if set(by_id[:k]) != set(by_meeting[:k]))


def test_both_trainers_load_the_maps_and_each_gets_the_map_it_would_build_itself(tmp_path, demo_model, sim):
    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(1, 31)])
    write_jsonl(tmp_path / "b.jsonl", [chat(i, f"Write a short story about the number {i}.") for i in range(1, 21)])
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "a", "source": str(tmp_path / "a.jsonl")},
                     {"name": "b", "source": str(tmp_path / "b.jsonl")}], str(out), sampling={"maxNewTokens": 300}))
    assert run_cli(spec, out, sim.url).returncode == 0
    storage = LocalStorage(out)
    (a, met_a), (b, met_b) = recount(storage, "a"), recount(storage, "b")
    recounted, mix = {"a": a, "b": b}, a + b
    tie = tied_cut(mix, list(dict.fromkeys(met_a + met_b)))  # the datasets in spec order, as the export writes them
    sizes = [tie, DEMO_VOCAB - 31]  # a cut inside a tie, and more ids than were generated (each trainer fills up)
    done = export(out, tmp_path / "vocab", "vocab", *(f"--draft-vocab-size={size}" for size in sizes))
    assert f"target vocabulary: {DEMO_VOCAB}" in done.stdout
    export(out, tmp_path / "sf", "specforge")
    manifest = json.loads((tmp_path / "vocab" / "export.json").read_text())
    assert manifest["mix"]["loss_tokens"] == sum(mix.values())
    assert {name: manifest["datasets"][name]["loss_tokens"] for name in ("a", "b")} == {
        name: sum(counts.values()) for name, counts in recounted.items()}

    loaded = vocab_maps(tmp_path / "vocab", tmp_path / "sf" / "prompts", DEMO_VOCAB, sizes)
    assert {int(k): v for k, v in loaded["token_freq"].items()} == dict(mix)
    by_count = sorted(mix, key=lambda tid: (-mix[tid], tid))
    for size in sizes:
        got = loaded["sizes"][str(size)]
        assert got["speculators_loaded"][2:] == [size, True, True, DEMO_VOCAB]
        assert got["speculators_loaded"][:2] == got["speculators_built"]
        assert got["specforge_loaded"] == got["specforge_built"]
        assert got["sglang_hot"][:min(size, len(by_count))] == by_count[:size] and len(got["sglang_hot"]) == size
    # Inside a tie the two trainers keep different ids, and each file holds its own trainer's choice.
    cut = loaded["sizes"][str(tie)]
    assert cut["speculators_loaded"][1] != cut["specforge_loaded"][1]
