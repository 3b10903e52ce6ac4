"""SpecForge's offline features, end to end: the aux pass against a server with aux capture, the final-state pass
against one relaunched with --enable-return-hidden-states (both the simulator, answering as 0.5.23 does), killed at
each step of the final pass's commit and resumed, then `tokenmill export --format specforge-offline` read back by
SpecForge 0.2.0's own OfflineEagle3Dataset (tests/trainers/offline_env.py: torch from PyPI). The simulator keys
every value by (token, position, layer; the final state as layer -1), so a state shifted by a token, from the wrong
layer or of the wrong kind shows."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.trainers.offline_env import specforge_offline
from tokenmill_runner.generate.summary import (
    EXIT_NO_SAMPLES,
    EXIT_SERVERS_UNAVAILABLE,
    EXIT_STATES_PENDING,
)
from tokenmill_runner.store.hidden_states import AUX, FINAL, captured_keys, read_states, state_markers
from tokenmill_runner.store.storage import TMP_MARK, LocalStorage

from .test_exactly_once import run_cli
from .test_hidden_states import CHUNK, HIDDEN, LAYERS, expected, rows_by_key, run_spec

FINAL_KEY = [-1]  # tokenmill_sim.hidden_states.FINAL_LAYER_KEY


def server(demo_model: Path, **flags: bool):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    return SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0, max_running_requests=32,
                               chunked_prefill_size=CHUNK, **flags))


@pytest.fixture
def aux_server(demo_model: Path):
    with server(demo_model, enable_return_aux_hidden_states=True) as running:
        yield running


@pytest.fixture
def final_server(demo_model: Path):
    with server(demo_model, enable_return_hidden_states=True) as running:
        yield running


def export(out: Path, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "export", str(out), str(dest),
                           "--format", "specforge-offline"], capture_output=True, text=True, timeout=300)


def two_passes(tmp_path: Path, demo_model: Path, aux_server, final_server, lines: int = 4) -> tuple[Path, Path]:
    spec, out = run_spec(tmp_path, demo_model, lines, hiddenStates={"layouts": ["specforge"]})
    first = run_cli(spec, out, aux_server.url)
    # The aux layers are in; the final state needs the server relaunched: never an exit that looks like success.
    assert first.returncode == EXIT_STATES_PENDING, first.stderr[-2000:]
    assert "--enable-return-hidden-states" in first.stderr
    storage = LocalStorage(out)
    assert len(captured_keys(storage, "d", AUX)) == lines and not captured_keys(storage, "d", FINAL)
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["hidden_states"]["d"]["final"]["coverage"] == 0.0
    assert "final_states_coverage" in {f["check"] for f in report["findings"]}
    second = run_cli(spec, out, final_server.url)
    assert second.returncode == 0, second.stderr[-2000:]
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["hidden_states"]["d"]["coverage"] == report["hidden_states"]["d"]["final"]["coverage"] == 1.0
    assert not [f for f in report["findings"] if f["check"].startswith(("hidden_states", "final_states"))]
    return spec, out


def test_specforge_reads_every_sample_s_final_and_aux_states_aligned_to_its_tokens(
        tmp_path, demo_model, aux_server, final_server):
    _, out = two_passes(tmp_path, demo_model, aux_server, final_server)
    rows = rows_by_key(LocalStorage(out), "d")
    done = export(out, tmp_path / "features")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 of 4 samples written" in done.stdout
    samples = specforge_offline(tmp_path / "features" / "features")
    assert len(samples) == len(rows)
    for sample in samples:
        key = Path(sample["path"]).stem
        row = rows[key]
        sequence = row["prompt_ids"] + row["output_ids"]
        assert sample["input_ids"] == [sequence]
        # Supervised on the generated tokens; SpecForge itself zeroes the last position (process_data).
        assert sample["loss_mask"] == [[0] * len(row["prompt_ids"]) + [1] * (len(row["output_ids"]) - 1) + [0]]
        assert sample["dtypes"]["hidden_state"] == sample["dtypes"]["target"] == "torch.bfloat16"
        np.testing.assert_array_equal(np.array(sample["hidden_state"][0]), expected(sequence, LAYERS))
        np.testing.assert_array_equal(np.array(sample["target"][0]), expected(sequence, FINAL_KEY))
        assert not np.array_equal(np.array(sample["target"][0]), expected(sequence, FINAL_KEY, shift=1))


@pytest.mark.parametrize("rule", ["kill-after:final-states:2", "kill-before:final-marker:3"])
def test_a_final_pass_killed_at_each_step_resumes_to_every_sample_once(
        tmp_path, demo_model, aux_server, final_server, rule):
    spec, out = run_spec(tmp_path, demo_model, 5, hiddenStates={"layouts": ["specforge"]})
    assert run_cli(spec, out, aux_server.url).returncode == EXIT_STATES_PENDING
    killed = run_cli(spec, out, final_server.url, rule)
    assert killed.returncode == -signal.SIGKILL, f"{rule} never fired: {killed.stderr[-2000:]}"
    storage = LocalStorage(out)
    assert len(captured_keys(storage, "d", FINAL)) < 5
    # The markers are written from parallel threads, so under load the kill can land inside another sample's marker
    # write, after its temporary file is whole and before the rename (storage.write_atomic): left here on every run,
    # it is no marker, the resume captures that sample and nothing counts it twice.
    rows = rows_by_key(storage, "d")
    pending = sorted(set(rows) - captured_keys(storage, "d", FINAL))[0]
    cut_off = out / "d" / FINAL.commits / f"{pending}.json{TMP_MARK}killed"
    cut_off.parent.mkdir(parents=True, exist_ok=True)
    cut_off.write_text(json.dumps({"version": 1, "dataset": "d", "sample_id": rows[pending]["sample_id"],
                                   "sample_index": rows[pending]["sample_index"], "file": f"{FINAL.states}/{pending}"
                                   ".safetensors", "bytes": 0, "sha256": "", "tokens": 0, "dtype": "bfloat16"}))
    resumed = run_cli(spec, out, final_server.url)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    markers = list(state_markers(storage, "d", FINAL))
    assert sorted(m["sample_id"] for m in markers) == sorted(row["sample_id"] for row in rows.values())
    for marker in markers:
        row = next(r for r in rows.values() if r["sample_id"] == marker["sample_id"])
        sequence = row["prompt_ids"] + row["output_ids"]
        token_ids, states = read_states(storage, "d", marker)
        assert token_ids.tolist() == sequence and states.shape == (len(sequence), 1, HIDDEN)
        np.testing.assert_array_equal(states.reshape(len(sequence), -1), expected(sequence, FINAL_KEY))


def test_an_export_without_the_final_states_says_so_and_a_pass_waits_for_its_kind(
        tmp_path, demo_model, aux_server):
    spec, out = run_spec(tmp_path, demo_model, 2, hiddenStates={"layouts": ["specforge"]})
    assert run_cli(spec, out, aux_server.url).returncode == EXIT_STATES_PENDING
    done = export(out, tmp_path / "features")
    # Nothing written: the one code every export ends with then (5), whatever the format; 3 is for a partial one.
    assert done.returncode == EXIT_NO_SAMPLES, done.stderr[-2000:]
    assert "0 of 2 samples written" in done.stdout and "2 without the final state" in done.stdout
    assert "nothing exported" in done.stderr and "data.hidden_states_path" not in done.stdout
    # The operator's final pass against a server that has not rolled yet: it waits, then says what to start.
    waited = run_cli(spec, out, aux_server.url, None, "--states-pass", "final", "--server-wait", "1")
    assert waited.returncode == EXIT_SERVERS_UNAVAILABLE, waited.stderr[-2000:]
    assert "serves aux hidden states" in waited.stderr and "--enable-return-hidden-states" in waited.stderr
