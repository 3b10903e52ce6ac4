"""The throughput model's structure (what must be faster than what) and its calibration: every fitted record of
docs/throughput-calibration.yaml within +-30 % of the published number. A property of the model against recorded
data, not a timing: nothing here runs anything but arithmetic."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tokenmill_runner.facts.calibration import load_records, predict
from tokenmill_runner.facts.hardware import Link, find
from tokenmill_runner.facts.model_facts import model_facts
from tokenmill_runner.facts.throughput import (
    Layout,
    StepModel,
    experts_touched,
    kv_bytes_per_token,
    serving_tokens_per_second,
    simulator_step,
)

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "fixtures" / "models"
RECORDS = REPO / "docs" / "throughput-calibration.yaml"


def model(name: str):
    data = json.loads((MODELS / f"{name}.json").read_text())
    return model_facts(data["config"], data["weight_bytes"])


def step(name: str, gpu: str, layout: Layout, **changes) -> StepModel:
    product = find(gpu)
    assert product is not None
    if changes:
        product = replace(product, **changes)
    return StepModel(model(name), product, layout)


def records():
    fixtures = {path.stem: json.loads(path.read_text()) for path in MODELS.glob("*.json")}
    return load_records(yaml.safe_load(RECORDS.read_text()), fixtures)


# ---------------------------------------------------------------------------------------------------------------
# Calibration


def test_every_fitted_record_is_within_30_percent_of_its_published_number():
    fitted = [r for r in records() if r.fit]
    assert len(fitted) >= 20
    errors = {r.id: predict(r) / r.published - 1 for r in fitted}
    outside = {k: f"{v:+.0%}" for k, v in errors.items() if abs(v) > 0.30}
    assert outside == {}


def test_records_not_fitted_say_why_and_the_set_covers_the_seeds_hardware():
    loaded = records()
    assert all(r.reason for r in loaded if not r.fit)
    assert any(r.gpu.label.startswith("NVIDIA-RTX-PRO-6000") and r.fit for r in loaded)
    assert any(r.layout.attention_dp > 1 and r.fit for r in loaded)  # DP attention is calibrated too
    assert any(r.model.is_mla and r.fit for r in loaded)


def test_the_seeds_run_falls_inside_its_published_range():
    # seed 001 line 17: "~930-1350 tok/s" for Kimi-K2.5 on 8 x RTX PRO 6000 (layout assumed TP 8, ~120 running).
    seed = next(r for r in records() if r.id == "seed-kimik25-rtxpro6000x8")
    assert 930 * 0.9 <= predict(seed) <= 1350


# ---------------------------------------------------------------------------------------------------------------
# Structure


def test_more_memory_bandwidth_is_faster_when_memory_bound():
    slow = step("kimi-k2.5", "H200", Layout(8))
    fast = step("kimi-k2.5", "H200", Layout(8), memory_bandwidth=2 * slow.gpu.memory_bandwidth)
    assert slow.bound(256, 2000) == "memory"
    assert fast.step_seconds(256, 2000) < slow.step_seconds(256, 2000)


def test_tensor_parallelism_over_pcie_is_slower_than_over_nvlink():
    nvlink = step("llama-3.1-70b", "H100", Layout(8))
    pcie = step("llama-3.1-70b", "H100", Layout(8), scale_up=Link("pcie", 64e9))
    for batch in (1, 64, 256):
        assert pcie.step_seconds(batch, 2000) > nvlink.step_seconds(batch, 2000)
    # One GPU crosses no link at all.
    assert (step("llama-3.1-8b", "H100", Layout(1), scale_up=Link("pcie", 64e9)).step_seconds(64, 2000)
            == step("llama-3.1-8b", "H100", Layout(1)).step_seconds(64, 2000))


def test_decode_throughput_grows_with_the_batch_and_steps_get_longer():
    s = step("deepseek-v3", "B200", Layout(8))
    batches = [1, 16, 64, 256, 1024]
    times = [s.step_seconds(b, 1000) for b in batches]
    rates = [s.decode_tokens_per_second(b, 1000) for b in batches]
    assert times == sorted(times) and rates == sorted(rates)
    # The per-step floor: one request at TP 8 is far from free (~9 ms published for this model on B200).
    assert 5e-3 < times[0] < 15e-3


def test_longer_contexts_read_more_kv():
    s = step("llama-3.1-70b", "H200", Layout(4))
    assert s.step_seconds(128, 8000) > s.step_seconds(128, 1000)
    assert kv_bytes_per_token(s.model) == 2 * 8 * 128 * 2 * 80  # K+V x 8 heads x 128 x bf16 x 80 layers


def test_dp_attention_reads_each_groups_requests_only():
    # Under TP every rank reads every request's MLA latent; with DP attention each group reads only its own.
    tp = step("kimi-k2.5", "H200", Layout(8))
    dp = step("kimi-k2.5", "H200", Layout(8, 8))
    assert dp.memory_seconds(512, 4000) < tp.memory_seconds(512, 4000)


def test_moe_reads_only_the_experts_a_batch_routes_to():
    kimi = model("kimi-k2.5")
    assert experts_touched(kimi, 1) == pytest.approx(8 / 384)
    assert experts_touched(kimi, 64) < experts_touched(kimi, 512) < 1.0
    assert experts_touched(model("llama-3.1-8b"), 1) == 1.0  # a dense model reads everything
    s = step("kimi-k2.5", "H200", Layout(8))
    assert s.memory_seconds(1, 100) < s.memory_seconds(256, 100) / 5


def test_prefill_interleaved_with_decode_lowers_output_throughput():
    s = step("qwen3-235b-a22b", "B200", Layout(8))
    decode_only = s.decode_tokens_per_second(90, 750)
    short_prompts = serving_tokens_per_second(s, 90, 100, 500)
    long_prompts = serving_tokens_per_second(s, 90, 4000, 500)
    assert decode_only > short_prompts > long_prompts


def test_step_seconds_is_the_simulators_hook():
    # A pure function of (batch, context) for a model on a GPU in a layout: the simulator's step time.
    s = step("kimi-k2.5", "RTX-PRO-6000", Layout(8))
    assert s.link.is_pcie
    assert s.step_seconds(32, 2000) == s.step_seconds(32, 2000) > 0


def test_the_simulators_linear_step_matches_the_model_at_both_ends():
    s = step("kimi-k2.5", "H200", Layout(8, 8))
    empty, per_request, prefill = simulator_step(s, 600, 3000, 512)
    assert (empty + per_request * 1) / 1e3 == pytest.approx(s.step_seconds(1, 3000))
    assert (empty + per_request * 600) / 1e3 == pytest.approx(s.step_seconds(600, 3000))
    assert prefill > 0
