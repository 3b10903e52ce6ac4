"""`tokenmill plan` for the examples and the seeds' hardware: the candidate table, the prediction in --json, and
the fixed-workload flags. The model files are the Kimi-K2.5 fixture written as a model folder (config.json and
the safetensors index), read through --model-files as a user does before the weights are uploaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill_runner import cli

REPO = Path(__file__).resolve().parents[2]
B5 = REPO / "examples" / "b5-openthoughts.yaml"


@pytest.fixture
def kimi_files(tmp_path: Path) -> Path:
    data = json.loads((REPO / "tests" / "fixtures" / "models" / "kimi-k2.5.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(data["config"]))
    index = {"metadata": {"total_size": data["weight_bytes"]}, "weight_map": {}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli.main(["plan", str(B5), *args]) == 0
    return capsys.readouterr().out


def test_the_b5_example_prints_the_candidate_table(kimi_files: Path, capsys: pytest.CaptureFixture[str]):
    out = plan(capsys, "--model-files", str(kimi_files))
    assert "layouts considered (* = chosen):" in out
    assert "SGLang                0.5.23" in out  # the example's image serves Kimi-K2.5
    chosen = [line for line in out.splitlines() if line.strip().startswith("*")]
    assert len(chosen) == 1 and "DP-attn 8" in chosen[0]  # on H200, DP attention finishes soonest
    assert "predicted" in out and "ETA" in out and "GPU-hours" in out
    assert "kind: StatefulSet" in out and "--attn-dp-size" in out  # the objects carry the chosen layout


def test_the_seeds_hardware_needs_only_the_product_name(kimi_files: Path, capsys: pytest.CaptureFixture[str]):
    out = plan(capsys, "--model-files", str(kimi_files), "--gpu-product", "RTX-PRO-6000")
    assert "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition, 97,887 MiB, TP over pcie" in out
    assert "tensor parallelism runs over PCIe" in out
    assert "layouts considered" in out and "nvidia.com/gpu.product: NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition" in out


def test_json_carries_the_prediction_and_every_candidate(kimi_files: Path, capsys: pytest.CaptureFixture[str]):
    payload = json.loads(plan(capsys, "--model-files", str(kimi_files), "--json"))
    prediction = payload["plan"]["prediction"]
    assert {"decodeTokensPerSecond", "outputTokensPerSecond", "etaSeconds", "gpuHours"} <= set(prediction)
    candidates = payload["plan"]["candidates"]
    assert sum(c["chosen"] for c in candidates) == 1
    assert all({"decodeTokensPerSecond", "outputTokensPerSecond", "etaSeconds", "gpuHours"} <= set(c["prediction"])
               for c in candidates if c["prediction"])


def test_a_fixed_workload_is_planned(kimi_files: Path, capsys: pytest.CaptureFixture[str]):
    estimate = json.loads(plan(capsys, "--model-files", str(kimi_files), "--json"))["plan"]["prediction"]
    fixed = json.loads(plan(capsys, "--model-files", str(kimi_files), "--json", "--prompt-tokens", "300",
                            "--output-tokens", "200", "--concurrency", "64"))["plan"]
    assert fixed["prediction"]["batchPerReplica"] == 64
    assert fixed["expectedTokensPerRequest"] == 400
    assert fixed["prediction"]["etaSeconds"] < estimate["etaSeconds"]


def test_bad_flags_are_refused(kimi_files: Path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        cli.main(["plan", str(B5), "--output-tokens", "0"])
    assert "must be positive" in capsys.readouterr().err


def _with_hidden_states(tmp_path: Path, output: str, limit: int, **states: str) -> Path:
    import yaml

    document = yaml.safe_load(B5.read_text())
    document["spec"]["hiddenStates"] = {"convention": "eagle3", **states}
    document["spec"]["output"] = {"uri": output}
    for dataset in document["spec"]["datasets"]:
        dataset["limit"] = limit
    path = tmp_path / "hs.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_the_plan_shows_the_hidden_states_bytes(kimi_files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    spec = _with_hidden_states(tmp_path, str(tmp_path / "out"), limit=100)
    assert cli.main(["plan", str(spec), "--model-files", str(kimi_files), "--json", "--prompt-tokens", "300",
                     "--output-tokens", "200"]) == 0
    payload = json.loads(capsys.readouterr().out)
    # Kimi-K2.5: hidden 7168, EAGLE3's 3 layers, bf16 -> 43,008 bytes per token, 8 more for its id, 1 KiB a file.
    assert payload["hiddenStates"]["bytesPerToken"] == 3 * 7168 * 2
    assert payload["hiddenStates"]["bytes"] == 100 * 500 * (43_008 + 8) + 100 * 1024
    assert "--enable-return-aux-hidden-states" in json.dumps(payload["objects"])


def test_the_plan_counts_fp8_states_at_a_byte_a_value_and_a_scale_a_token(kimi_files: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]):
    spec = _with_hidden_states(tmp_path, str(tmp_path / "out"), limit=100, storage="fp8")
    assert cli.main(["plan", str(spec), "--model-files", str(kimi_files), "--prompt-tokens", "300",
                     "--output-tokens", "200"]) == 0
    assert "bfloat16 stored as float8_e4m3fn with a float32 scale per token = 21,508 bytes per token" in \
        capsys.readouterr().out
    assert cli.main(["plan", str(spec), "--model-files", str(kimi_files), "--json", "--prompt-tokens", "300",
                     "--output-tokens", "200"]) == 0
    payload = json.loads(capsys.readouterr().out)
    # hs-connectors' fp8 layout: 3 x 7168 one-byte values and a float32 scale per token (field-2026-12-04.md 4.3).
    assert payload["hiddenStates"]["bytesPerToken"] == 3 * 7168 + 4
    assert payload["hiddenStates"]["bytes"] == 100 * 500 * (21_508 + 8) + 100 * 1024


def test_a_local_output_without_room_for_the_states_is_refused(kimi_files: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]):
    spec = _with_hidden_states(tmp_path, str(tmp_path / "out"), limit=2**40)  # petabytes of states
    assert cli.main(["plan", str(spec), "--model-files", str(kimi_files)]) == 2
    error = capsys.readouterr().err
    assert "spec.hiddenStates" in error and "GB free but the hidden states need" in error
