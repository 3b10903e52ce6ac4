"""speculators' offline data, end to end: a run against the simulator serving a gpt_oss-shaped target with
`layerIds: [1, L/2-1, L-4, L-1]` (one aux pass), then `tokenmill export --format speculators-offline` read back by
speculators 0.9.0's own ArrowDataset (tests/trainers/offline_env.py: torch from PyPI).

What is checked, and where the trainer and SGLang say so:
- ArrowDataset loads DEST/dataset with `load_from_disk` (speculators/train/data.py:164), takes row i's states from
  hidden_states/hs_{i}.safetensors (data.py:184, 276; hs_connectors/transfer.py:141-143), skips a file whose
  token_ids differ from the row's input_ids (data.py:314-322), and hands its training step `hidden_states[:, :-1]`
  flattened as the aux layers and `hidden_states[:, -1]` as verifier_last_hidden_states (data.py:325-334).
- On gpt_oss an explicit id i captures boundary i + 1 (SGLang 0.5.23 models/gpt_oss.py:1346-1352), so id L - 1 is
  boundary L, the residual the final norm reads (gpt_oss.py:727-738), captured last (gpt_oss.py:711-738,
  layers/aux_hidden_states.py:97-102): the simulator keys each value by (token, position, id), so the aux layers
  must hold ids [1, 3, 4]'s values and verifier_last_hidden_states id 7's (L = 8), at every position.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tests.trainers.offline_env import hs_connectors_fp8, speculators_offline
from tokenmill_runner.generate.summary import EXIT_GIVEN_UP
from tokenmill_runner.store.hidden_states import captured_keys, marker_key
from tokenmill_runner.store.storage import LocalStorage

from .test_exactly_once import run_cli
from .test_hidden_states import CHUNK, expected, rows_by_key, run_spec

LAYER_IDS = [1, 3, 4, 7]  # facts.hidden_states.speculators_layer_ids(8): the demo model's 8 layers
AUX, LAST = LAYER_IDS[:-1], LAYER_IDS[-1:]


@pytest.fixture
def gpt_oss_model(tmp_path: Path, demo_model: Path) -> Path:
    """The demo model as a gpt_oss target: the architecture is what decides whether SGLang serves boundary L."""
    folder = tmp_path / "gpt-oss-demo"
    shutil.copytree(demo_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GptOssForCausalLM"]}))
    return folder


@pytest.fixture
def gpt_oss_server(gpt_oss_model: Path):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    config = SimConfig(model_path=str(gpt_oss_model), time_scale=5000.0, max_running_requests=32,
                       chunked_prefill_size=CHUNK, enable_return_aux_hidden_states=True,
                       return_aux_hidden_state_layer_ids=",".join(map(str, LAYER_IDS)))
    with SimServer(config) as server:
        yield server


def export(out: Path, dest: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "export", str(out), str(dest),
                           "--format", "speculators-offline", *extra], capture_output=True, text=True, timeout=300)


def row_keys(datapath: Path) -> list[tuple[str, int]]:
    """(sample id, sample index) per row of the exported Arrow dataset, read as load_from_disk does: the parts
    state.json lists, each an Arrow IPC stream."""
    state = json.loads((datapath / "state.json").read_text())
    assert state["_format_type"] == "torch"
    keys: list[tuple[str, int]] = []
    for part in state["_data_files"]:
        with pa.memory_map(str(datapath / part["filename"])) as source:
            table = pa.ipc.open_stream(source).read_all()
        keys.extend(zip(table["sample_id"].to_pylist(), table["sample_index"].to_pylist(), strict=True))
    return keys


def check_samples(datapath: Path, rows: dict[str, dict], backend: str = "file") -> int:
    by_sample = {(row["sample_id"], row["sample_index"]): row for row in rows.values()}
    samples = speculators_offline(datapath, backend=backend)
    served = (lambda values: values) if backend == "file" else fp8_as_trained
    keys = row_keys(datapath)
    assert len(samples) == len(keys)
    for sample, key in zip(samples, keys, strict=True):
        assert "unavailable" not in sample, sample
        row = by_sample[key]
        sequence = row["prompt_ids"] + row["output_ids"]
        assert sample["input_ids"] == sequence
        assert sample["loss_mask"] == [0] * len(row["prompt_ids"]) + [1] * len(row["output_ids"])
        states = served(expected(sequence, LAYER_IDS)).reshape(len(sequence), len(LAYER_IDS), -1)
        np.testing.assert_array_equal(np.array(sample["hidden_states"]), states[:, :-1].reshape(len(sequence), -1))
        np.testing.assert_array_equal(np.array(sample["verifier_last_hidden_states"]), states[:, -1])
        # A state taken from the wrong layer or shifted by one position would not match.
        assert not np.array_equal(np.array(sample["verifier_last_hidden_states"]),
                                  served(expected(sequence, AUX[-1:])))
        assert not np.array_equal(np.array(sample["verifier_last_hidden_states"]),
                                  served(expected(sequence, LAST, shift=1)))
    return len(samples)


def fp8_as_trained(values: np.ndarray) -> np.ndarray:
    """Served states as speculators trains on them when stored as fp8: quantized per token (over every layer the
    row holds), then dequantized to bf16 by FP8Transfer (store/fp8.py, held to hs-connectors' own code below)."""
    from tokenmill_runner.store.fp8 import dequantize, quantize

    rows = values.reshape(values.shape[0], -1)
    return dequantize(*quantize(rows)).reshape(values.shape)


def test_speculators_reads_every_sample_s_aux_and_final_states_aligned_to_its_tokens(
        tmp_path, gpt_oss_model, gpt_oss_server):
    spec, out = run_spec(tmp_path, gpt_oss_model, 4,
                         hiddenStates={"layouts": ["speculators"], "layerIds": LAYER_IDS})
    done = run_cli(spec, out, gpt_oss_server.url)
    # One pass: the final state is the last aux layer, so nothing is pending (no exit 7).
    assert done.returncode == 0, done.stderr[-2000:]
    storage = LocalStorage(out)
    rows = rows_by_key(storage, "d")
    assert len(captured_keys(storage, "d")) == len(rows) == 4
    exported = export(out, tmp_path / "spec")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "4 of 4 samples written" in exported.stdout
    assert check_samples(tmp_path / "spec" / "dataset", rows) == 4
    manifest = json.loads((tmp_path / "spec" / "export.json").read_text())
    assert manifest["format"] == "speculators-offline" and manifest["rows"] == 4
    # The stored files are copied as they are, byte for byte.
    first = sorted((out / "d" / "hidden_states").glob("*.safetensors"))
    copied = sorted((tmp_path / "spec" / "dataset" / "hidden_states").glob("hs_*.safetensors"))
    assert sorted(p.read_bytes() for p in first) == sorted(p.read_bytes() for p in copied)

    # A sample without states is left out and counted; the rows stay numbered 0.. so hs_{i} is still row i's.
    missing = next(iter(rows))
    next((out / marker_key("d", missing)).parent.glob(f"{missing}-*.json")).unlink()
    again = export(out, tmp_path / "spec", "--overwrite")
    assert again.returncode == EXIT_GIVEN_UP, again.stderr[-2000:]
    assert "3 of 4 samples written" in again.stdout and "1 without aux states" in again.stdout
    assert check_samples(tmp_path / "spec" / "dataset", rows) == 3
    assert not (tmp_path / "spec" / "dataset" / "hidden_states" / "hs_3.safetensors").exists()


def test_fp8_states_are_hs_connectors_files_that_speculators_reads_through_its_fp8_backend(
        tmp_path, gpt_oss_model, gpt_oss_server):
    """spec.hiddenStates.storage fp8 stores hs-connectors 0.9.0's fp8 layout: the bytes its own quantizer writes for
    the served states (fp8_utils.py:29-51), values and per-token scales in one file; the plan, the capture and the
    report count those bytes; speculators reads the export with --hidden-states-backend fp8 (FP8Transfer,
    transfer.py:212-300)."""
    from tokenmill_runner.facts.hidden_states import StateShape
    from tokenmill_runner.report.files import compute_report
    from tokenmill_runner.store.hidden_states import state_markers

    spec, out = run_spec(tmp_path, gpt_oss_model, 2,
                         hiddenStates={"layouts": ["speculators"], "layerIds": LAYER_IDS, "storage": "fp8"})
    done = run_cli(spec, out, gpt_oss_server.url)
    assert done.returncode == 0, done.stderr[-2000:]
    storage = LocalStorage(out)
    rows = rows_by_key(storage, "d")
    markers = {m["sample_id"]: m for m in state_markers(storage, "d")}
    pairs = []
    for key, row in rows.items():
        sequence = row["prompt_ids"] + row["output_ids"]
        pairs.append((str(out / "d" / "hidden_states" / f"{key}.safetensors"), expected(sequence, LAYER_IDS).tolist()))
        marker = markers[row["sample_id"]]
        fp8, bf16 = (StateShape(len(LAYER_IDS), 1024, "bfloat16", storage) for storage in ("fp8", "bfloat16"))
        assert (marker["dtype"], marker["served_dtype"]) == ("float8_e4m3fn", "bfloat16")
        assert fp8.file_bytes(len(sequence)) - 1024 < marker["bytes"] <= fp8.file_bytes(len(sequence))
        assert marker["bytes"] < 0.55 * bf16.file_bytes(len(sequence))
    for checked, (_, served) in zip(hs_connectors_fp8(pairs, tmp_path), pairs, strict=True):
        assert checked["dtype"] == "torch.float8_e4m3fn" and checked["scales_shape"] == [len(served), 1, 1]
        assert checked["values_equal"] and checked["scales_equal"]
    section = compute_report(storage).report["hidden_states"]["d"]
    assert section["dtypes"] == ["float8_e4m3fn"] and section["bytes"] == sum(m["bytes"] for m in markers.values())
    assert len(LAYER_IDS) * 1024 + 4 + 8 < section["bytes_per_token"] < len(LAYER_IDS) * 1024 + 4 + 8 + 100

    exported = export(out, tmp_path / "spec")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "--hidden-states-backend fp8" in exported.stdout
    assert check_samples(tmp_path / "spec" / "dataset", rows, backend="fp8") == 2


def test_states_captured_without_the_layout_are_never_exported_as_speculators(tmp_path, demo_model):
    """The EAGLE3 default's last layer is L - 4's output; written as hidden_states[:, -1] it would train the drafter
    against the wrong target, so the export refuses a run whose spec did not ask for the layout."""
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    spec, out = run_spec(tmp_path, demo_model, 2, hiddenStates={"convention": "eagle3"})
    config = SimConfig(model_path=str(demo_model), time_scale=5000.0, enable_return_aux_hidden_states=True,
                       chunked_prefill_size=CHUNK)
    with SimServer(config) as server:
        assert run_cli(spec, out, server.url).returncode == 0
    refused = export(out, tmp_path / "spec")
    assert refused.returncode != 0
    assert "layouts: [speculators]" in refused.stderr and "verifier_last_hidden_states" in refused.stderr
    assert not (tmp_path / "spec" / "export.json").exists()


def test_tokenmill_run_refuses_the_layout_for_another_architecture_before_generating(tmp_path, demo_model):
    """The demo model is a llama: its final norm takes no capture hook, so id L - 1 fails SGLang's first forward
    (0.5.23 layers/logits_processor.py:920-951) and its post-norm state is not speculators' pre-norm one. The runner
    reads config.json before the stream (generate/hidden_pass.refuse_unservable), so no sample is generated for
    states that could not be captured."""
    from tokenmill_runner.generate.summary import EXIT_USAGE

    spec, out = run_spec(tmp_path, demo_model, 2, hiddenStates={"layouts": ["speculators"], "layerIds": LAYER_IDS})
    refused = run_cli(spec, out, "http://127.0.0.1:9")  # never reached
    assert refused.returncode == EXIT_USAGE, refused.stderr[-2000:]
    assert "spec.hiddenStates: layouts 'speculators'" in refused.stderr and "GptOssForCausalLM" in refused.stderr
    assert not (out / "d").exists()
