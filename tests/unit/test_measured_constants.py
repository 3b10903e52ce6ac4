"""The cluster's measured constants: refitted from a checked plan's window, kept in the operator's ConfigMap under
the key of the hardware and software, and the starting point of the next plan on that cluster."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from tokenmill_operator.act import constants as constants_write
from tokenmill_operator.decide import constants
from tokenmill_operator.decide.constants import plan_with_constants
from tokenmill_operator.decide.planner import model_facts, plan_server, plan_step_model
from tokenmill_operator.decide.planner.verify import (
    CONFIGMAP_NAME,
    constants_entry,
    plan_constants_key,
    read_constants,
    replan_decision,
)
from tokenmill_operator.observe import constants as constants_read
from tokenmill_runner.facts.refit import Refit, StepSample
from tokenmill_runner.facts.throughput import CALIBRATION
from tokenmill_runner.spec.resource import parse_document

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
DATA = json.loads((MODELS / "kimi-k2.5.json").read_text())
KIMI = model_facts(DATA["config"], DATA["weight_bytes"])
SPEC = parse_document({
    "apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "seeds"},
    "spec": {"model": {"path": "s3://models/kimi/"},
             "server": {"image": "lmsysorg/sglang:v0.5.23", "gpuProduct": "RTX-PRO-6000"},
             "sampling": {"maxNewTokens": 10240},
             "datasets": [{"name": "B5", "source": "s3://p/b5.jsonl", "limit": 11000}],
             "output": {"uri": "s3://out/seeds/"}}}).spec
# The hidden truth: collectives 3x slower, expert reads 40 % faster, DP overhead doubled.
TRUTH = Refit(expert_speed=1.4, collective_scale=3.0, dp_scale=2.0, samples=0, error_before=0, error_after=0,
              fitted=("experts", "collectives", "dp"))
RAMP = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80)


def window_on(truth: Refit, base: Refit | None = None) -> list[StepSample]:
    """The window's graph steps on hardware whose constants are `truth` (multipliers on the published fit)."""
    true_step = plan_step_model(SPEC, KIMI, calibration=truth.calibration(CALIBRATION))
    assert true_step is not None
    return [StepSample(b, 3000, true_step.step_seconds(b, 3000)) for b in RAMP for _ in range(3)]


class ConfigMaps:
    """The API server's ConfigMaps as the operator sees them (create, get, merge patch of data)."""

    def __init__(self, forbidden: bool = False) -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self.forbidden = forbidden

    def create_if_absent(self, manifest: dict) -> bool:
        key = (manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        if key in self.objects:
            return False
        self.objects[key] = json.loads(json.dumps(manifest))
        return True

    def get(self, api_version: str, kind: str, name: str, namespace: str) -> dict | None:
        if self.forbidden:
            raise ApiException(status=403, reason="Forbidden")
        return self.objects.get((namespace, name))

    def patch(self, api_version: str, kind: str, name: str, namespace: str, body: dict) -> None:
        self.objects[(namespace, name)]["data"].update(body["data"])


def test_a_plan_on_a_cluster_without_measurements_uses_the_published_fit():
    plan = plan_with_constants(SPEC, KIMI, constants=lambda key: None)
    assert plan.measured_constants is None and plan == plan_server(SPEC, KIMI)


def test_the_refit_lands_near_the_hidden_truth_and_is_kept_under_the_clusters_key():
    plan = plan_server(SPEC, KIMI)
    measured = constants_read.measure(SPEC, None, plan, window_on(TRUTH), {}, read=lambda *_, **__: KIMI)
    assert measured is not None and measured.key == plan_constants_key(plan, KIMI.architecture)
    assert measured.key == "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition.pcie.0.5.23.KimiK25ForConditionalGeneration"
    result = measured.result
    for name in result.fitted:
        value = {"experts": result.expert_speed, "collectives": result.collective_scale, "dp": result.dp_scale}[name]
        truth = {"experts": 1.4, "collectives": 3.0, "dp": 2.0}[name]
        assert value == pytest.approx(truth, rel=0.10), name
    assert result.error_after < 0.02 < result.error_before
    assert "collectives x3.00" in measured.describe() or "collectives" not in result.fitted


def test_the_next_plan_on_that_cluster_starts_from_the_measured_constants():
    plan = plan_server(SPEC, KIMI)
    measured = constants_read.measure(SPEC, None, plan, window_on(TRUTH), {}, read=lambda *_, **__: KIMI)
    assert measured is not None
    kube = ConfigMaps()
    constants_write.write_entry(kube, "tokenmill-system", measured)
    data = constants_read.read_data(kube, "tokenmill-system")
    again = plan_with_constants(SPEC, KIMI, constants=lambda key: read_constants(data, key))
    assert again.measured_constants == measured.key
    expected = plan_server(SPEC, KIMI, calibration=measured.result.calibration(CALIBRATION))
    assert again.prediction == expected.prediction and again.prediction != plan.prediction
    # Another GPU (another key) keeps the published fit.
    h200 = SPEC.model_copy(update={"server": SPEC.server.model_copy(update={"gpu_product": "NVIDIA-H200"})})
    other = plan_with_constants(h200, KIMI, constants=lambda key: read_constants(data, key))
    assert other.measured_constants is None


def test_a_plan_that_started_from_measurements_is_refitted_relative_to_them():
    stored = replace(TRUTH, collective_scale=2.0, expert_speed=1.0, dp_scale=1.0)
    key = plan_constants_key(plan_server(SPEC, KIMI), KIMI.architecture)
    data = {key: constants_entry(stored)}
    plan = plan_with_constants(SPEC, KIMI, constants=lambda k: read_constants(data, k))
    assert plan.measured_constants == key
    measured = constants_read.measure(SPEC, None, plan, window_on(TRUTH), data, read=lambda *_, **__: KIMI)
    assert measured is not None
    if "collectives" in measured.result.fitted:
        assert measured.result.collective_scale == pytest.approx(3.0, rel=0.10)


def test_a_window_of_one_batch_moves_no_constant_and_records_nothing():
    plan = plan_server(SPEC, KIMI)
    flat = [s for s in window_on(TRUTH) if s.batch == 64]
    assert constants_read.measure(SPEC, None, plan, flat, {}, read=lambda *_, **__: KIMI) is None


def test_writing_one_key_keeps_the_others_and_the_configmap_is_the_operators():
    kube = ConfigMaps()
    first = constants.Measured("a.pcie.0.5.23.X", TRUTH)
    second = constants.Measured("b.nvlink.0.5.23.Y", replace(TRUTH, collective_scale=1.1))
    constants_write.write_entry(kube, "ops", first)
    constants_write.write_entry(kube, "ops", second)
    stored = kube.objects[("ops", CONFIGMAP_NAME)]
    assert set(stored["data"]) == {first.key, second.key}
    assert stored["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tokenmill-operator"
    assert read_constants(stored["data"], second.key).collective_scale == pytest.approx(1.1)


def test_a_configmap_the_operator_may_not_read_or_no_namespace_means_the_published_fit():
    assert constants_read.read_data(ConfigMaps(forbidden=True), "ops") == {}
    assert constants_read.read_data(ConfigMaps(), None) == {}


# -- re-planning on the measured constants ---------------------------------------------------------------------

def with_layouts(plan, current_s: float, other_s: float):
    """The plan with two layouts: the running one (TP 8 + DP attention 4) and plain TP 8, at these generation
    times for the whole job."""
    base = plan.prediction
    running = next(c for c in plan.candidates if (c.tensor_parallel, c.attention_data_parallel) == (8, 4))
    other = running.model_copy(update={"attention_data_parallel": 1, "chosen": False, "choosable": True})
    return plan.model_copy(update={"candidates": [
        running.model_copy(update={"prediction": base.model_copy(update={"generation_seconds": current_s})}),
        other.model_copy(update={"prediction": base.model_copy(update={"generation_seconds": other_s})})]})


def test_another_layout_is_suggested_when_and_only_when_its_gain_beats_the_restart_and_the_margin():
    plan = plan_server(SPEC, KIMI)
    assert (plan.tensor_parallel, plan.attention_data_parallel) == (8, 4)
    restart = plan.startup.seconds
    wins = replan_decision(plan, with_layouts(plan, 40_000, 20_000), 1.0, "suggest")
    assert wins.action == "suggest" and wins.best == "1 x TP 8" and wins.restart_s == restart
    assert wins.gain_s == 20_000 > restart + wins.margin_s
    close = replan_decision(plan, with_layouts(plan, 40_000, 40_000 - restart - 1_000), 1.0, "suggest")
    assert close.action == "stay" and close.gain_s == restart + 1_000 < restart + close.margin_s
    # Near the end, the same speed-up no longer pays for a restart: only the remaining work counts.
    late = replan_decision(plan, with_layouts(plan, 40_000, 20_000), 0.05, "suggest")
    assert late.current_eta_s == 2_000 and late.action == "stay"
    assert replan_decision(plan, with_layouts(plan, 40_000, 20_000), 1.0, "off").action == "stay"


def test_a_layout_the_spec_does_not_allow_as_it_stands_is_never_suggested():
    # With the hidden truth the fp8 KV cache layouts finish first, but they change the outputs' fidelity and need
    # spec.server.kvCacheDtype: the re-plan compares only what the spec allows.
    plan = plan_server(SPEC, KIMI)
    samples = window_on(TRUTH)
    measured = constants_read.measure(SPEC, None, plan, samples, {}, read=lambda *_, **__: KIMI)
    replanned = constants.replan(SPEC, plan, measured)
    fp8 = [c for c in replanned.candidates if c.kv_cache_dtype != "auto" and c.prediction is not None]
    assert fp8 and not any(c.choosable for c in fp8)
    assert min(c.prediction.generation_seconds for c in fp8) < replanned.prediction.generation_seconds
    decision = replan_decision(plan, replanned, 1.0, "suggest")
    assert decision.action == "stay" and "fp8" not in decision.best
    assert decision.current_eta_s == replanned.prediction.generation_seconds


def test_the_suggestion_is_a_condition_and_an_event_and_staying_is_said_with_the_figures():
    from datetime import UTC, datetime

    from tokenmill_operator.decide.facts import Decision
    from tokenmill_operator.decide.lifecycle import with_replan
    from tokenmill_operator.decide.status import DatasetGenerationStatus

    plan = plan_server(SPEC, KIMI)
    now = datetime(2026, 12, 2, 7, 0, tzinfo=UTC)
    base = Decision(DatasetGenerationStatus(phase="Generating"), server_replicas=1)
    suggested = with_replan(base, replan_decision(plan, with_layouts(plan, 40_000, 20_000), 1.0, "suggest"), now, 2)
    (condition,) = suggested.status.conditions
    assert (condition.type, condition.status, condition.reason) == ("ReplanSuggested", "True", "FasterLayoutMeasured")
    assert "1 x TP 8: remaining ETA 5.56 h against 11.11 h now" in condition.message
    assert "spec.server.tensorParallel" in condition.message
    assert [(e.type, e.reason) for e in suggested.events] == [("Normal", "ReplanSuggested")]
    stays = with_replan(base, replan_decision(plan, with_layouts(plan, 40_000, 39_000), 1.0, "suggest"), now, 2)
    (condition,) = stays.status.conditions
    assert (condition.status, condition.reason) == ("False", "CurrentLayoutFastest") and not stays.events
    assert "1 x TP 8, 10.83 h, does not gain the restart" in condition.message


def test_replan_is_suggest_by_default_and_off_or_auto_on_request():
    assert SPEC.server.replan == "suggest"
    document = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "r"},
                "spec": {**SPEC.model_dump(mode="json", by_alias=True, exclude_none=True)}}
    document["spec"]["server"]["replan"] = "off"
    assert parse_document(document).spec.server.replan == "off"
    document["spec"]["server"]["replan"] = "auto"  # tests/unit/test_replan_auto.py
    assert parse_document(document).spec.server.replan == "auto"
