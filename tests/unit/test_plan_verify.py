"""A plan checked and corrected on the running server: the simulator runs SGLang's DP-attention replica (lockstep
groups, graph cap, eager steps) with a hidden "true" step model unlike the planner's, the operator's pure side
refits the constants from what /metrics would show in the first ten minutes, verifies the plan and decides whether
to switch layouts."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from tokenmill_operator.decide.planner import model_facts, size_server
from tokenmill_operator.decide.planner.sizing import Option
from tokenmill_operator.decide.planner.verify import (
    MARGIN_FLOOR_S,
    WINDOW_S,
    PredictedStep,
    constants_entry,
    constants_key,
    decide,
    read_constants,
    verify,
)
from tokenmill_runner.facts.hardware import find
from tokenmill_runner.facts.model_facts import ModelFacts
from tokenmill_runner.facts.refit import StepSample, refit, refitted
from tokenmill_runner.facts.throughput import CALIBRATION, Calibration, Layout, StepModel
from tokenmill_runner.facts.workload import DatasetLoad
from tokenmill_runner.spec.resource import DatasetGenerationSpec, parse_document
from tokenmill_sim.capacity import Job, SchedulerParams
from tokenmill_sim.lockstep import LockstepReplica

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def facts(name: str) -> ModelFacts:
    data = json.loads((MODELS / f"{name}.json").read_text())
    return model_facts(data["config"], data["weight_bytes"])


def seeds_spec() -> DatasetGenerationSpec:
    return parse_document({
        "apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "verify"},
        "spec": {"model": {"path": "s3://models/m/"},
                 "server": {"image": "lmsysorg/sglang:v0.5.23", "gpuProduct": "RTX-PRO-6000"},
                 "sampling": {"maxNewTokens": 10240},
                 "datasets": [{"name": "B5", "source": "s3://p/b5.jsonl", "limit": 11000}],
                 "output": {"uri": "s3://out/run/"}}}).spec

# The hidden truth: collectives 3x slower, expert reads 40 % faster, DP overhead doubled.
TRUTH = replace(CALIBRATION, collective_scale=3.0,
                quantized_moe_memory_efficiency=CALIBRATION.quantized_moe_memory_efficiency * 1.4,
                dp_attention_layer_s=CALIBRATION.dp_attention_layer_s * 2)
# The concurrency ramp the verification window opens with: a few batches below the full one let the refit tell
# the expert reads (which saturate with the batch) from the collectives (linear in it) and the fixed costs.
RAMP = (1, 2, 4, 8, 16, 32, 64, 128)
RAMP_STEP_S = 30.0


def plan_step() -> StepModel:
    gpu = find("RTX-PRO-6000")
    assert gpu is not None
    return StepModel(facts("kimi-k2.5"), gpu, Layout(8, 4))


def window(truth: Calibration, jitter: float = 0.0, seed: int = 3) -> list[StepSample]:
    """What the first WINDOW_S seconds of a run show on the hidden truth: graph steps as (batch, context, step)."""
    true_step = replace(plan_step(), calibration=truth)
    noise = random.Random(seed)
    lengths = DatasetLoad("B", 1, True, 10240).output_lengths()
    rows = random.Random(seed)
    jobs = iter([Job(prompt_tokens=512, output_tokens=rows.choice(lengths), arrival=0.0, max_new_tokens=10240)
                 for _ in range(3000)])
    replica = LockstepReplica(
        4, SchedulerParams(max_running_requests=80, max_total_tokens=146_000, schedule_conservativeness=0.3),
        lambda b, c: true_step.step_seconds(b, c) * (1 + noise.uniform(-jitter, jitter)),
        lambda t: true_step.prefill_seconds(t, 512) if t else 0.0, graph_bs=80, dispatch="total_tokens")
    result = None
    for i, level in enumerate(RAMP):
        result = replica.run(jobs, inflight=level, until=RAMP_STEP_S * (i + 1), result=result)
    result = replica.run(jobs, inflight=600, until=WINDOW_S, result=result)
    assert replica.clock <= WINDOW_S + 60  # the samples are from inside the window
    return [StepSample(o.running, o.context_tokens, o.step_seconds) for o in result.observations if not o.eager]


def test_the_refit_lands_within_ten_percent_of_the_hidden_truth_inside_the_window():
    samples = window(TRUTH)
    fit = refit(plan_step(), samples)
    assert fit.fitted == ("experts", "collectives", "dp")
    assert fit.expert_speed == pytest.approx(1.4, rel=0.10)
    assert fit.collective_scale == pytest.approx(3.0, rel=0.10)
    assert fit.dp_scale == pytest.approx(2.0, rel=0.10)
    assert fit.error_before > 0.05 and fit.error_after < 0.01
    # The refitted model predicts the true step at the plan's batch within 10 %.
    true_step = replace(plan_step(), calibration=TRUTH)
    assert refitted(plan_step(), fit).step_seconds(228, 2992) == pytest.approx(
        true_step.step_seconds(228, 2992), rel=0.10)


def test_with_noisy_steps_the_refitted_step_still_tracks_the_truth():
    samples = window(TRUTH, jitter=0.03)
    fit = refit(plan_step(), samples)
    true_step = replace(plan_step(), calibration=TRUTH)
    after = refitted(plan_step(), fit)
    for batch in (8, 64, 228, 320):
        assert after.step_seconds(batch, 2992) == pytest.approx(true_step.step_seconds(batch, 2992), rel=0.10)
    assert fit.expert_speed == pytest.approx(1.4, rel=0.10)


def test_the_plan_is_verified_when_the_server_runs_as_predicted_and_off_with_the_numbers_when_not():
    step = plan_step()
    same = window(CALIBRATION)
    batch = max(s.batch for s in same)
    ok = verify(same, batch, PredictedStep(step.step_seconds(batch, same[-1].context_tokens)))
    assert ok.verified and ok.condition()["type"] == "PlanVerified"
    slow = replace(CALIBRATION, collective_scale=6.0, dp_attention_layer_s=CALIBRATION.dp_attention_layer_s * 4)
    off = verify(window(slow), batch, PredictedStep(step.step_seconds(batch, same[-1].context_tokens)),
                 retractions=12)
    condition = off.condition()
    assert not off.verified and condition["type"] == "PlanOff"
    assert f"{off.predicted_step_s * 1e3:,.1f} ms" in condition["message"]
    assert f"{off.observed_step_s * 1e3:,.1f} ms" in condition["message"] and "retractions 12" in condition["message"]


@pytest.mark.parametrize("mode", ["auto", "suggest", "off"])
def test_a_switch_happens_when_and_only_when_the_gain_beats_the_restart_and_the_margin(mode: str):
    restart = 1800.0
    current = 20 * 3600.0
    margin = max(0.05 * current, MARGIN_FLOOR_S)
    just_better = current - restart - margin - 60
    not_enough = current - restart - margin + 60
    win = decide(current, {"TP 8": just_better, "TP 8 + DP 2": current}, restart, mode)  # type: ignore[arg-type]  # mode: a str from parametrize
    assert win.best == "TP 8"
    assert win.action == {"auto": "switch", "suggest": "suggest", "off": "stay"}[mode]
    lose = decide(current, {"TP 8": not_enough}, restart, mode)  # type: ignore[arg-type]  # mode: a str from parametrize
    assert lose.action == "stay" and lose.condition() is None
    if mode == "suggest":
        condition = win.condition()
        assert condition is not None and "gain" in condition["message"]


def test_replanning_with_the_refitted_constants_ranks_the_layouts_on_the_measured_hardware():
    spec = seeds_spec()
    model = facts("kimi-k2.5")
    before = size_server(spec, model)
    fit = refit(plan_step(), window(TRUTH))
    after = size_server(spec, model, calibration=fit.calibration(CALIBRATION))
    truth = size_server(spec, model, calibration=TRUTH)
    chosen = after.chosen

    def same_layout(option: Option) -> bool:
        return (option.layout, option.kv_cache_dtype) == (chosen.layout, chosen.kv_cache_dtype)

    in_truth = next(o for o in truth.options if same_layout(o))
    # The refitted plan's ETA for its layout is within 10 % of the same layout under the true constants; the
    # published-constant plan's is not.
    assert abs(chosen.eta / in_truth.eta - 1) <= 0.10
    in_before = next(o for o in before.options if same_layout(o))
    assert abs(in_before.eta / in_truth.eta - 1) > abs(chosen.eta / in_truth.eta - 1)
    restart = 8 * 60.0
    alternatives = {f"{o.layout}": o.eta for o in after.options if o.choosable and not same_layout(o)}
    decision = decide(in_before.eta, alternatives, restart, "suggest")
    assert decision.action in ("stay", "suggest")
    assert (decision.action == "suggest") == (decision.gain_s > restart + decision.margin_s)


def test_refitted_constants_round_trip_through_the_clusters_configmap_and_bad_entries_are_ignored():
    fit = refit(plan_step(), window(TRUTH))
    key = constants_key("RTX PRO 6000", "pcie", "0.5.23", "KimiK25ForConditionalGeneration")
    assert key == "RTX-PRO-6000.pcie.0.5.23.KimiK25ForConditionalGeneration"
    stored = read_constants({key: constants_entry(fit)}, key)
    assert stored is not None and stored.collective_scale == pytest.approx(fit.collective_scale, abs=1e-4)
    assert read_constants({key: "{not json"}, key) is None
    assert read_constants({key: '{"expertSpeed": 1e9, "collectiveScale": 1, "dpScale": 1}'}, key) is None
    assert read_constants({key: "x" * 10_000}, key) is None
    assert read_constants(None, key) is None


def test_the_step_is_compared_at_the_context_the_server_reports_not_the_jobs_average():
    """A run's first minutes hold young requests: fewer KV tokens each than the job's average, so the step is
    faster than the plan's at its own context. Compared there, a plan right about the hardware reads PlanOff;
    at the reported context it is verified, and a slower truth is still off."""
    step = plan_step()
    # Kimi-K2.5's latent KV is small: its step moves with the context only at the seeds' long answers.
    batch, held, young = 228, 12_000.0, 1500.0
    samples = [StepSample(batch, young, step.step_seconds(batch, young)) for _ in range(20)]
    at_held = step.step_seconds(batch, held)
    assert at_held > 1.15 * samples[0].step_seconds  # the young batch runs well over 15 % faster
    assert not verify(samples, batch, PredictedStep(at_held)).verified
    slope = (step.step_seconds(batch, held + 600) - at_held) / 600
    predicted = PredictedStep(at_held, held, slope)
    checked = verify(samples, batch, predicted)
    assert checked.verified and checked.predicted_step_s == pytest.approx(samples[0].step_seconds, rel=0.01)
    assert "step at 1,500 KV tokens a request predicted" in checked.condition()["message"]
    slow = replace(step, calibration=replace(CALIBRATION, moe_memory_efficiency=CALIBRATION.moe_memory_efficiency / 2,
                                             quantized_moe_memory_efficiency=CALIBRATION.quantized_moe_memory_efficiency / 2))
    truth = [StepSample(batch, young, slow.step_seconds(batch, young)) for _ in range(20)]
    assert not verify(truth, batch, predicted).verified
