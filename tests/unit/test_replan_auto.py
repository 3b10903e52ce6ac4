"""spec.server.replan auto: after the plan's check the operator switches the server to the re-plan's best layout
when, and only when, its remaining ETA beats the running one's by more than the restart plus the margin; at most
once per spec generation, and a spec edit plans from the spec again. All pure: the decision (planner/verify.py),
the status it records (lifecycle.py) and the Job identity that makes the runner restart (manifests.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tokenmill_operator.decide import constants, manifests, names
from tokenmill_operator.decide.facts import Decision
from tokenmill_operator.decide.lifecycle import decide, layout_token, with_replan, with_switch
from tokenmill_operator.decide.planner import model_facts, plan_server, plan_step_model
from tokenmill_operator.decide.planner.verify import (
    MARGIN_FLOOR_S,
    pinned_spec,
    replan_decision,
    running_layout,
    switch_mode,
    switched_plan,
)
from tokenmill_operator.decide.status import DatasetGenerationStatus, LayoutOverride
from tokenmill_operator.observe import constants as constants_read
from tokenmill_runner.facts.refit import Refit, StepSample
from tokenmill_runner.facts.throughput import CALIBRATION
from tokenmill_runner.spec.resource import parse_document

from .test_lifecycle import observed

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
DATA = json.loads((MODELS / "qwen3-30b-a3b.json").read_text())
QWEN = model_facts(DATA["config"], DATA["weight_bytes"])
NOW = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)


def spec_doc(replan: str = "auto") -> dict:
    """Qwen3-30B-A3B on one node of 8 x H200, 100,000 samples: the plan is 2 x TP 4 (the tests/e2e switch's)."""
    return {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "q"},
            "spec": {"model": {"path": "s3://models/qwen/"},
                     "server": {"image": "lmsysorg/sglang:v0.5.23", "gpuProduct": "NVIDIA-H200", "nodes": 1,
                                "replan": replan},
                     "sampling": {"maxNewTokens": 32768},
                     "datasets": [{"name": "B5", "source": "s3://p/b5.jsonl", "limit": 100_000}],
                     "output": {"uri": "s3://out/q/"}}}


SPEC = parse_document(spec_doc()).spec
PLAN = plan_server(SPEC, QWEN)


def measured_on(collectives: float) -> constants.Measured:
    """The refit of a window on hardware whose collectives cost `collectives` x the published fit (the running
    layout's step on that truth, a ramp of batches)."""
    step = plan_step_model(SPEC, QWEN, PLAN.cuda_driver_major, CALIBRATION)
    assert step is not None
    truth = replace(step, calibration=Refit(1.0, collectives, 1.0, 0, 0, 0, ()).calibration(CALIBRATION))
    samples = [StepSample(b, 3000, truth.step_seconds(b, 3000)) for b in (1, 2, 4, 8, 16, 32, 64)]
    found = constants_read.measure(SPEC, None, PLAN, samples, {}, read=lambda *_, **__: QWEN)
    assert found is not None
    return found


def test_after_a_switch_the_window_refits_the_layout_running_not_the_specs_own():
    """The switched layout's own window (8 x TP 1, one GPU a replica: no collectives) is refitted on that layout's
    step model. On the spec's (2 x TP 4) the same pairs would be read as slow experts and free collectives."""
    first = measured_on(10.0)
    switched = constants.plan_layout(SPEC, PLAN, first, (8, 1, 1, "auto"))
    assert switched is not None and running_layout(switched) == (8, 1, 1, "auto")
    one_gpu = plan_step_model(pinned_spec(SPEC, (8, 1, 1, "auto")), QWEN, PLAN.cuda_driver_major, CALIBRATION)
    assert one_gpu is not None
    slower = replace(one_gpu, calibration=Refit(0.8, 1.0, 1.0, 0, 0, 0, ()).calibration(CALIBRATION))
    samples = [StepSample(b, 3000, slower.step_seconds(b, 3000)) for b in (1, 2, 4, 8, 16, 32, 64)]
    found = constants_read.measure(SPEC, None, switched, samples, {}, read=lambda *_, **__: QWEN)
    assert found is not None and found.result.fitted == ("experts",)
    assert found.result.expert_speed == pytest.approx(0.8, rel=0.02) and found.result.error_after < 0.01
    assert found.key != first.key  # one GPU a replica: its own entry, not the NVLink one's


def test_a_refit_that_explains_the_window_worse_than_the_plan_is_not_kept():
    """Pairs no multiplier of the model explains (steps jumping 0.5x to 5x the plan's from batch to batch, as a
    noisy or mislabelled window would) leave the plan's constants, rather than a fit held at its floor (experts or
    collectives at x0.05) that is then kept for the cluster's later plans."""
    step = plan_step_model(SPEC, QWEN, PLAN.cuda_driver_major, CALIBRATION)
    assert step is not None
    jumps = (5, 3, 2, 3, 5, 0.5, 1)
    odd = [StepSample(b, 3000, step.step_seconds(b, 3000) * m) for b, m in zip((1, 2, 4, 8, 16, 32, 64), jumps,
                                                                              strict=True)]
    from tokenmill_runner.facts.refit import refit

    fit = refit(step, odd)
    assert fit.fitted == () and (fit.expert_speed, fit.collective_scale) == (1.0, 1.0)
    assert fit.error_after == fit.error_before > 0
    assert constants_read.measure(SPEC, None, PLAN, odd, {}, read=lambda *_, **__: QWEN) is None


def test_the_running_plan_is_two_tp4_replicas_and_the_window_refits_the_collectives():
    assert running_layout(PLAN) == (2, 4, 1, "auto")
    assert measured_on(10.0).result.collective_scale == pytest.approx(10.0, rel=0.01)


@pytest.mark.parametrize(("collectives", "share", "action"), [
    (10.0, 1.0, "switch"),  # 12,345 s left on 2 x TP 4, 5,876 s on 8 x TP 1: gain 6,469 s > 364 s + 617 s
    (10.0, 0.2, "switch"),  # 2,469 s against 1,175 s: gain 1,294 s > 364 s + 600 s
    (5.0, 0.5, "switch"),  # 3,956 s against 2,938 s: gain 1,018 s > 964 s
    (5.0, 0.2, "stay"),  # the same speed-up on a fifth of the work: 407 s < 964 s
    (3.0, 1.0, "stay"),  # 6,138 s against 5,876 s: the restart is not paid back
    (1.0, 1.0, "stay"),  # as published: the plan's own choice stays the fastest
])
def test_auto_switches_when_and_only_when_the_gain_beats_the_restart_and_the_margin(collectives: float,
                                                                                   share: float, action: str):
    measured = measured_on(collectives)
    replanned = constants.replan(SPEC, PLAN, measured)
    assert replanned is not None
    found = replan_decision(PLAN, replanned, share, "auto")
    assert found is not None and found.action == action
    assert found.restart_s == PLAN.startup.seconds and found.margin_s == max(0.05 * found.current_eta_s,
                                                                             MARGIN_FLOOR_S)
    assert (found.gain_s > found.restart_s + found.margin_s) == (action == "switch")
    if action == "switch":
        assert found.best == "8 x TP 1" and found.layout == (8, 1, 1, "auto")


def test_the_switched_plan_is_the_chosen_layouts_own_plan_on_the_measured_constants():
    measured = measured_on(10.0)
    replanned = constants.replan(SPEC, PLAN, measured)
    found = replan_decision(PLAN, replanned, 0.8, "auto")
    assert found.layout == (8, 1, 1, "auto")
    pinned = constants.plan_layout(SPEC, PLAN, measured, found.layout)
    switched = switched_plan(PLAN, pinned, found)
    assert switched is not None and running_layout(switched) == (8, 1, 1, "auto")
    assert switched.gpus_per_node == 1 and switched.measured_constants == measured.key
    # The same figures the decision compared: the pinned plan is the candidate planned in full.
    candidate = next(c for c in replanned.candidates if (c.replicas, c.tensor_parallel) == (8, 1))
    assert switched.prediction.generation_seconds == candidate.prediction.generation_seconds
    assert switched.reasoning[0].startswith("switched by the operator (spec.server.replan auto) from 2 x TP 4 to "
                                            "8 x TP 1")
    assert switched.overrides == PLAN.overrides
    # With the re-plan, the candidates are the layouts compared, the chosen one marked.
    listed = switched_plan(PLAN, pinned, found, replanned)
    assert listed is not None and listed.candidates != switched.candidates
    assert [(c.replicas, c.tensor_parallel, c.kv_cache_dtype) for c in listed.candidates if c.chosen] == [
        (8, 1, "auto")]
    assert len(listed.candidates) == len(replanned.candidates)
    # A plan that is not the compared layout, or a decision that does not switch, switches nothing.
    assert switched_plan(PLAN, PLAN, found) is None
    assert switched_plan(PLAN, pinned, replace(found, action="suggest")) is None
    assert pinned_spec(SPEC, (8, 1, 1, "auto")).server.tensor_parallel == 1
    assert SPEC.server.tensor_parallel == "auto"  # the user's spec is never written


def switch_decision(generation: int = 3) -> tuple[Decision, Decision]:
    measured = measured_on(10.0)
    found = replan_decision(PLAN, constants.replan(SPEC, PLAN, measured), 0.8, "auto")
    switched = switched_plan(PLAN, constants.plan_layout(SPEC, PLAN, measured, found.layout), found,
                             constants.replan(SPEC, PLAN, measured))
    base = Decision(DatasetGenerationStatus(phase="Generating", server_plan=PLAN, planned_generation=generation,
                                            observed_generation=generation), server_replicas=2)
    return base, with_switch(base, found, PLAN, switched, NOW, generation)


def test_a_switch_records_the_layout_the_reason_the_gain_and_its_generation_with_a_condition_and_an_event():
    base, after = switch_decision()
    override = after.status.layout_override
    assert override is not None and override.generation == 3
    assert (override.replicas, override.tensor_parallel, override.attention_data_parallel) == (8, 1, 1)
    assert (override.from_layout, override.to_layout) == ("2 x TP 4", "8 x TP 1")
    assert override.current_eta_seconds == 9876 and override.new_eta_seconds == 4701
    assert override.gain_seconds == 5175 and override.restart_seconds == 364 and override.margin_seconds == 600
    assert after.status.server_plan.replicas == 8 and after.status.server_plan.tensor_parallel == 1
    (condition,) = after.status.conditions
    assert (condition.type, condition.status, condition.reason) == ("Replanned", "True", "FasterLayoutMeasured")
    assert condition.message.startswith("switched from 2 x TP 4 to 8 x TP 1: remaining ETA 1.31 h against 2.74 h "
                                        "now; gain 1.44 h beats the restart 6 min + margin 10 min")
    assert "resumes from what is committed" in condition.message and condition.observed_generation == 3
    assert [(e.type, e.reason, e.message) for e in after.events] == [("Normal", "Replanned", condition.message)]
    assert base.status.layout_override is None and base.status.server_plan is PLAN  # pure: nothing changed


def test_auto_switches_at_most_once_per_generation_and_again_only_after_a_spec_edit():
    assert switch_mode("auto", None, 3) == "auto"
    assert switch_mode("auto", 3, 3) == "suggest"  # switched in this generation: a second win is only said
    assert switch_mode("auto", 2, 3) == "auto"  # a new generation may switch once again
    assert switch_mode("suggest", None, 3) == "suggest" and switch_mode("off", 3, 3) == "off"
    measured = measured_on(10.0)
    replanned = constants.replan(SPEC, PLAN, measured)
    again = replan_decision(PLAN, replanned, 0.8, switch_mode("auto", 3, 3))
    assert again.action == "suggest"


def test_the_override_stays_with_its_generations_plan_and_a_spec_edit_clears_it():
    _, switched = switch_decision(generation=3)
    status = switched.status
    # The next pass of the same generation keeps the plan (from status) and the override.
    same = decide(observed(generation=3, previous=status, plan=status.server_plan))
    assert same.status.layout_override == status.layout_override
    assert same.server_replicas == 8  # the server is built from the switched plan: 8 pods of 1 GPU
    assert "Replanned" in {c.type for c in same.status.conditions}
    # An edit: generation 4 is planned from the spec again (planned_generation 4) and the override goes.
    edited = decide(observed(generation=4, previous=status, plan=PLAN, planned_generation=4))
    assert edited.status.layout_override is None and edited.server_replicas == 2
    replanned = next(c for c in edited.status.conditions if c.type == "Replanned")
    assert (replanned.status, replanned.reason) == ("False", "SpecChanged") and "8 x TP 1" in replanned.message


def test_the_runner_job_is_replaced_on_a_switch_even_when_the_servers_urls_stay_the_same():
    _, switched = switch_decision(generation=3)
    token = layout_token(switched.status, None)
    assert token == "3:8x1x1:auto" and layout_token(switched.status, 4) == ""
    assert layout_token(DatasetGenerationStatus(), None) == ""
    urls = names.server_urls("q", "ns", 30000, 2)
    base = manifests.runner_job_hash(SPEC, urls)
    assert manifests.runner_job_hash(SPEC, urls, "", "") == base  # runs without a switch keep their Job
    assert manifests.runner_job_hash(SPEC, urls, "", token) != base
    owner = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "name": "q", "uid": "u",
             "controller": True, "blockOwnerDeletion": True}
    job = manifests.runner_job("q", "ns", owner, SPEC, "img", urls, "", token)
    assert job["metadata"]["annotations"][names.JOB_HASH_ANNOTATION] == manifests.runner_job_hash(SPEC, urls, "",
                                                                                                   token)


def test_staying_under_auto_is_said_in_the_replanned_condition():
    measured = measured_on(3.0)
    found = replan_decision(PLAN, constants.replan(SPEC, PLAN, measured), 1.0, "auto")
    base = Decision(DatasetGenerationStatus(phase="Generating", server_plan=PLAN), server_replicas=2)
    stays = with_replan(base, found, NOW, 3, "Replanned")
    (condition,) = stays.status.conditions
    assert (condition.type, condition.status, condition.reason) == ("Replanned", "False", "CurrentLayoutFastest")
    assert "8 x TP 1" in condition.message and not stays.events


def test_replan_accepts_auto_suggest_and_off():
    for mode in ("auto", "suggest", "off"):
        assert parse_document(spec_doc(mode)).spec.server.replan == mode
    with pytest.raises(Exception, match="replan"):
        parse_document(spec_doc("always"))


def test_an_override_is_plain_status_data():
    _, switched = switch_decision()
    dumped = switched.status.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert dumped["layoutOverride"]["toLayout"] == "8 x TP 1" and dumped["layoutOverride"]["generation"] == 3
    again = DatasetGenerationStatus.model_validate(dumped)
    assert isinstance(again.layout_override, LayoutOverride) and again.layout_override.token == "3:8x1x1:auto"


def test_the_reconcile_pass_switches_once_from_the_windows_samples_and_keeps_the_constants(s3_endpoint: str,
                                                                                          s3_bucket: str):
    """The edge's glue (reconcile._record_constants): the model files read from S3, the refit kept in the
    ConfigMap, the re-plan, the chosen layout planned and recorded; a second checked window in the same generation
    switches nothing."""
    from tokenmill_operator.decide.facts import Context
    from tokenmill_operator.decide.server_metrics import WindowFacts
    from tokenmill_operator.decide.settings import OperatorSettings
    from tokenmill_operator.decide.status import Progress, VerificationStatus
    from tokenmill_operator.reconcile import _record_constants
    from tokenmill_runner.store.storage import open_storage

    from .test_measured_constants import ConfigMaps

    open_storage(f"s3://{s3_bucket}/qwen/", s3_endpoint).put("config.json", json.dumps(DATA["config"]).encode())
    document = spec_doc()
    document["spec"]["model"] = {"path": f"s3://{s3_bucket}/qwen/", "weightBytes": DATA["weight_bytes"]}
    document["spec"]["output"]["endpoint"] = s3_endpoint
    spec = parse_document(document).spec
    plan = plan_server(spec, QWEN)
    assert running_layout(plan) == (2, 4, 1, "auto")
    step = plan_step_model(spec, QWEN, plan.cuda_driver_major, CALIBRATION)
    truth = replace(step, calibration=Refit(1.0, 10.0, 1.0, 0, 0, 0, ()).calibration(CALIBRATION))
    window = WindowFacts(NOW, tuple(StepSample(b, 3000, truth.step_seconds(b, 3000)) for b in (1, 2, 4, 8, 16, 32)),
                         0, 0.0)
    checked = VerificationStatus(verified=False, predicted_batch=950, observed_batch=32,
                                 predicted_step_milliseconds="1", observed_step_milliseconds="1", samples=6,
                                 window_seconds=600, at="t", planned_generation=3)
    status = DatasetGenerationStatus(phase="Generating", server_plan=plan, verification=checked, planned_generation=3,
                                     observed_generation=3, progress=Progress(completed=20, total=75))
    decision = Decision(status, server_replicas=2)
    context = Context(body=document, name="q", namespace="ns", generation=3, spec=spec,
                      previous=DatasetGenerationStatus(planned_generation=3, server_plan=plan))
    kube = ConfigMaps()
    after = _record_constants(kube, context, None, decision, window, OperatorSettings(operator_namespace="ops"))
    assert after.status.layout_override is not None and after.status.layout_override.to_layout == "8 x TP 1"
    assert running_layout(after.status.server_plan) == (8, 1, 1, "auto")
    assert [e.reason for e in after.events] == ["ConstantsMeasured", "Replanned"]
    assert [(c.replicas, c.tensor_parallel) for c in after.status.server_plan.candidates if c.chosen] == [(8, 1)]
    assert kube.objects[("ops", "tokenmill-measured-constants")]["data"]
    # The remaining share is the progress's: 55 of 75 samples left.
    replanned = constants.replan(SPEC, PLAN, measured_on(10.0))
    generation_s = {(c.replicas, c.tensor_parallel): c.prediction.generation_seconds for c in replanned.candidates
                    if c.prediction is not None and c.kv_cache_dtype == "auto" and c.attention_data_parallel == 1}
    override = after.status.layout_override
    assert override.current_eta_seconds == pytest.approx(generation_s[2, 4] * 55 / 75, abs=2)
    assert override.new_eta_seconds == pytest.approx(generation_s[8, 1] * 55 / 75, abs=2)
    # Once switched in generation 3, the same generation never switches again: at most it suggests.
    again = _record_constants(ConfigMaps(), Context(**{**context.__dict__, "previous": after.status}), None,
                              replace(decision, status=after.status.model_copy(update={"server_plan": plan})),
                              window, OperatorSettings(operator_namespace="ops"))
    assert again.status.layout_override == after.status.layout_override
    assert running_layout(again.status.server_plan) == (2, 4, 1, "auto")  # not switched a second time
    assert "Replanned" not in [e.reason for e in again.events]
    assert any(c.type == "ReplanSuggested" and c.status == "True" for c in again.status.conditions)
