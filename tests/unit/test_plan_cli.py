"""`tokenmill plan` for the examples and the seeds' hardware: the candidate table, the prediction in --json, and
the fixed-workload flags. The model files are the Kimi-K2.5 fixture written as a model folder (config.json and
the safetensors index), read through --model-files as a user does before the weights are uploaded; without them,
offline, every example still plans (the facts tokenmill ships for its models, the sources it can read counted and
sampled, the others said to be assumed and why), and each error names the flag that gets past it."""

from __future__ import annotations

import json
import re
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


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a laptop without the store's credentials: the examples' s3:// model and sources cannot be read."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    import boto3

    # boto3's default session keeps the credentials it found for an earlier test's S3 server.
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)


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


def plan_json(capsys: pytest.CaptureFixture[str], example: str, *args: str) -> dict:
    assert cli.main(["plan", str(REPO / "examples" / example), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["plan"]


def test_every_example_plans_offline_with_what_its_sources_say(capsys: pytest.CaptureFixture[str]):
    # The demo: local sources, counted and tokenized with the demo model's template; the context is the job's.
    demo = plan_json(capsys, "demo.yaml")
    datasets = {d["name"]: d for d in demo["prediction"]["datasets"]}
    rows = {"B1_glaive": 80, "B5_openthoughts": 75, "B8_sweagent": 63, "M1_tool_conversations": 48,
            "C1_sharegpt": 30 * 2}  # C1 asks 2 samples a prompt
    assert {name: d["samples"] for name, d in datasets.items()} == rows
    assert {d["samplesSource"] for d in datasets.values()} == {"counted"}
    assert {d["promptSource"] for d in datasets.values()} == {"sampled"}
    assert datasets["B8_sweagent"]["promptTokens"] > 10 * datasets["C1_sharegpt"]["promptTokens"]
    assert demo["prediction"]["samples"] == sum(rows.values()) and not demo["prediction"]["samplesAssumed"]
    assert demo["contextLength"] <= 32768  # prompt + the largest maxNewTokens, not the default 262,144
    # The cluster examples: their models' facts ship with tokenmill; their S3 sources cannot be read here.
    for example, model in (("b5-openthoughts.yaml", "moonshotai/Kimi-K2.5"), ("chat-samples.yaml", "Qwen/Qwen3-8B")):
        found = plan_json(capsys, example)
        assert found["reasoning"][0].startswith(f"model facts: built in for {model}: config ")
        assert "give --model-files DIR|S3" in found["reasoning"][0]
        for d in found["prediction"]["datasets"]:
            assert d["samplesSource"] in ("limit", "assumed") and d["promptSource"] == "assumed"
            why = d["samplesHow"] if d["samplesSource"] == "assumed" else d["promptWhy"]
            assert "Unable to locate credentials" in why and "--source DATASET=FILE" in why


def test_a_local_copy_of_a_source_is_counted_and_sampled(capsys: pytest.CaptureFixture[str]):
    local = REPO / "examples" / "prompts" / "reasoning.jsonl"
    found = plan_json(capsys, "b5-openthoughts.yaml", "--source", f"B5_openthoughts={local}")
    (dataset,) = found["prediction"]["datasets"]
    assert (dataset["samples"], dataset["samplesSource"]) == (75, "counted")
    # Kimi's tokenizer is on S3 too: the prompts are estimated from their characters, and the context sized from
    # their bytes (an upper bound on their tokens), which says so.
    assert dataset["promptSource"] == "estimated" and "give --tokenizer DIR|S3" in dataset["promptWhy"]
    assert found["contextLength"] < 65536


def test_one_eta_everywhere(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["plan", str(REPO / "examples" / "demo.yaml")]) == 0
    out = capsys.readouterr().out
    headline = next(line for line in out.splitlines() if line.startswith("predicted "))
    eta = headline.split("ETA ")[1].split(" for ")[0]
    prediction = next(line for line in out.splitlines() if line.startswith("  - prediction: "))
    assert f"= ETA {eta} for " in prediction
    chosen = next(line for line in out.splitlines() if line.strip().startswith("*"))
    assert f"  {eta}  " in chosen
    rule = next(line for line in out.splitlines() if line.startswith("  - rule: the smallest predicted ETA"))
    others = re.findall(r"(\d+[dhm] \d+[hms]) \([+-]\d+%\)", rule)
    table = [line for line in out.splitlines() if " x TP" in line and not line.strip().startswith("*")]
    assert others and all(any(f"  {found}  " in line for line in table) for found in others), (rule, table)


def test_errors_name_the_flag_that_gets_past_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    import yaml

    document = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    del document["spec"]["server"]
    document["spec"]["model"]["path"] = str(REPO / "examples" / "demo-model")
    for dataset in document["spec"]["datasets"]:
        dataset["source"] = str(REPO / "examples" / dataset["source"])
    no_gpu = tmp_path / "no-gpu.yaml"
    no_gpu.write_text(yaml.safe_dump(document))
    assert cli.main(["plan", str(no_gpu)]) == 2
    assert "--gpu-product" in capsys.readouterr().err
    assert cli.main(["plan", str(no_gpu), "--gpu-product", "H200"]) == 0
    capsys.readouterr()
    unknown = yaml.safe_load(B5.read_text())
    unknown["spec"]["model"]["path"] = "s3://models/someone/Unknown-70B/"
    path = tmp_path / "unknown.yaml"
    path.write_text(yaml.safe_dump(unknown))
    assert cli.main(["plan", str(path)]) != 0
    error = capsys.readouterr().err
    assert "--model-files DIR|S3" in error and "moonshotai/Kimi-K2.5" in error
