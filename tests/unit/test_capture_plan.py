"""The hidden-state capture pass in the plan (planner/capture.py): its time by the planner's own step model and by
the states' bytes at the documented JSON rate, the longer counted in the ETA and GPU-hours."""

from __future__ import annotations

import json
import math

import pytest

from tokenmill_operator.decide.planner.capture import JSON_STATE_BYTES_PER_S, CaptureLoad, capture_time
from tokenmill_runner import cli

from .test_plan_cli import _with_hidden_states, kimi_files  # noqa: F401 - the fixture

STEP_S = 0.01  # every decode step


def prefill(tokens: float, prompt_tokens: float) -> float:
    return tokens * 1e-5


def step(batch: int, context_tokens: float) -> float:
    return STEP_S


def test_the_forwards_are_the_step_model_s_prefill_and_decode_steps_in_rounds_of_the_requests_in_flight():
    # 8 sequences of 1,000 tokens, 4 in flight, chunks of 512: each asks 1000/512 -> 2 chunks + 1 = 3 new tokens.
    # Two rounds, each one prefill of 4 x 1,000 tokens (0.04 s) and 3 decode steps (0.03 s).
    found = capture_time([CaptureLoad("d", 8, 1000)], bytes_per_token=6144, workers=1, chunk_tokens=512,
                         step_seconds=step, prefill_seconds=prefill, json_bytes_per_s=1e15)
    assert found.forward_seconds == pytest.approx(2 * (0.04 + 0.03))
    assert found.bound == "prefill" and found.seconds == found.forward_seconds
    # Two workers: 8 in flight on the one replica, one round.
    two = capture_time([CaptureLoad("d", 8, 1000)], 6144, 2, 512, step, prefill, json_bytes_per_s=1e15)
    assert two.forward_seconds == pytest.approx(0.08 + 0.03)


def test_a_large_dataset_scales_the_simulated_share_linearly():
    found = capture_time([CaptureLoad("d", 10_000, 1000)], 6144, 1, 512, step, prefill, json_bytes_per_s=1e15)
    assert found.forward_seconds == pytest.approx(10_000 / 4 * (0.04 + 0.03))


def test_the_states_bytes_at_the_documented_rate_bound_the_pass_when_slower():
    # 8 x 1,000 tokens x 6,144 bytes (3 layers x 1,024 hidden x bf16) = 49.152 MB at 5.5 MB/s per worker.
    found = capture_time([CaptureLoad("a", 5, 1000), CaptureLoad("b", 3, 1000)], 6144, 1, 512, step, prefill)
    assert found.state_bytes == 8 * 1000 * 6144
    assert found.transfer_seconds == pytest.approx(49.152e6 / JSON_STATE_BYTES_PER_S)
    assert found.bound == "json" and found.seconds == found.transfer_seconds
    assert capture_time([CaptureLoad("a", 8, 1000)], 6144, 4, 512, step, prefill).transfer_seconds == pytest.approx(
        found.transfer_seconds / 4), "each runner worker parses its own answers"


def test_the_plan_adds_the_capture_pass_to_the_eta_and_the_gpu_hours(kimi_files, tmp_path,  # noqa: F811
                                                                      capsys: pytest.CaptureFixture[str]):
    import yaml

    spec = _with_hidden_states(tmp_path, "s3://bucket/out/", limit=1000)
    plain = tmp_path / "plain.yaml"
    document = yaml.safe_load(spec.read_text())
    del document["spec"]["hiddenStates"]
    plain.write_text(yaml.safe_dump(document))
    flags = ["--model-files", str(kimi_files), "--json", "--prompt-tokens", "300", "--output-tokens", "200"]
    assert cli.main(["plan", str(spec), *flags]) == 0
    with_states = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", str(plain), *flags]) == 0
    without = json.loads(capsys.readouterr().out)["plan"]["prediction"]
    prediction = with_states["plan"]["prediction"]
    startup = with_states["plan"]["startup"]
    assert without["captureSeconds"] is None
    # B5's 4 runner workers; 1,000 samples x 500 tokens x 43,008 bytes (Kimi-K2.5, EAGLE3's 3 layers, bf16).
    json_seconds = 1000 * 500 * 43_008 / (JSON_STATE_BYTES_PER_S * 4)
    assert prediction["captureBound"] == "json"
    assert prediction["captureSeconds"] == round(json_seconds)
    assert prediction["generationSeconds"] == without["generationSeconds"]
    assert prediction["etaSeconds"] == (startup["copySeconds"] + startup["loadSeconds"]
                                        + prediction["generationSeconds"] + round(json_seconds))
    assert prediction["gpuHours"] == pytest.approx(without["gpuHours"] + 8 * json_seconds / 3600, abs=0.11)
    assert math.isclose(prediction["interval"]["etaSecondsLow"] - without["interval"]["etaSecondsLow"],
                        round(json_seconds), abs_tol=1)


def test_specforge_s_layout_adds_its_final_pass_and_the_server_s_restart_before_it(kimi_files, tmp_path,  # noqa: F811
                                                                                     capsys: pytest.CaptureFixture[str]):
    """layouts [specforge]: the final state comes from a second pass against the server relaunched for it
    (states_passes.py), so the ETA holds a second capture pass and one more start-up; the restart shows in the
    table. B5's weights are copied into each pod, and an emptyDir does not outlive the pod: the copy repeats."""
    import yaml

    spec = _with_hidden_states(tmp_path, "s3://bucket/out/", limit=1000)
    document = yaml.safe_load(spec.read_text())
    flags = ["--model-files", str(kimi_files), "--json", "--prompt-tokens", "300", "--output-tokens", "200"]
    assert cli.main(["plan", str(spec), *flags]) == 0
    aux_only = json.loads(capsys.readouterr().out)["plan"]["prediction"]
    document["spec"]["hiddenStates"]["layouts"] = ["specforge"]
    spec.write_text(yaml.safe_dump(document))
    assert cli.main(["plan", str(spec), *flags]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    prediction, startup = plan["prediction"], plan["startup"]
    assert aux_only["relaunchSeconds"] is None
    restart = startup["copySeconds"] + startup["loadSeconds"]
    assert "copied from S3 into every pod" in startup["source"] and prediction["relaunchSeconds"] == restart
    final_json = 1000 * 500 * 7168 * 2 / (JSON_STATE_BYTES_PER_S * 4)  # one layer of states, the final one
    assert prediction["captureSeconds"] == round(aux_only["captureSeconds"] + final_json)
    assert prediction["etaSeconds"] == (restart + prediction["generationSeconds"] + prediction["captureSeconds"]
                                        + restart)
    assert prediction["gpuHours"] == pytest.approx(aux_only["gpuHours"] + 8 * (final_json + restart) / 3600, abs=0.11)
    assert cli.main(["plan", str(spec), "--model-files", str(kimi_files), "--prompt-tokens", "300",
                     "--output-tokens", "200"]) == 0
    assert "restart between its passes" in capsys.readouterr().out
