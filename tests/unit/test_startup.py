"""Start-up in the plan: the copy and the load of Kimi-K2.5's weights predicted per way they travel, added to the ETA
and the GPU-hours, shown separately, and the startup probe sized from the load."""

from __future__ import annotations

import math

from tokenmill_operator.decide import manifests
from tokenmill_operator.decide.planner import plan_server, render_plan
from tokenmill_operator.decide.planner.startup import (
    LOCAL_READ_BYTES_PER_S,
    NETWORK_READ_BYTES_PER_S,
    PROBE_FLOOR_S,
    S3_COPY_BYTES_PER_S,
    WARMUP_S,
)

from .test_planner import H200, facts, fixture, make_spec

OWNER = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "name": "k", "uid": "u",
         "controller": True, "blockOwnerDeletion": True}
KIMI_BYTES = fixture("kimi-k2.5")["weight_bytes"]


def kimi(model: dict | None = None, **server):
    spec = make_spec({"gpuProduct": H200, **server}, model=model)
    return spec, plan_server(spec, facts("kimi-k2.5"))


def test_kimi_plan_shows_copy_load_and_generation_and_adds_them_up():
    _, plan = kimi()
    startup, prediction = plan.startup, plan.prediction
    assert startup.copy_seconds == math.ceil(KIMI_BYTES / S3_COPY_BYTES_PER_S)  # ~594 GB at 400 MB/s: ~25 min
    assert startup.load_seconds == math.ceil(KIMI_BYTES / LOCAL_READ_BYTES_PER_S) + WARMUP_S
    assert prediction.eta_seconds == prediction.generation_seconds + startup.copy_seconds + startup.load_seconds
    # Every pod holds its 8 GPUs while it copies and loads: they are in the GPU-hours.
    held = prediction.generation_seconds + startup.copy_seconds + startup.load_seconds
    assert prediction.gpu_hours == round(held * 8 / 3600, 1)
    text = render_plan(plan)
    assert "ETA                   copy 24m 45s at 400 MB/s" in text
    assert "+ load 7m 57s" in text and "+ generation " in text


def test_a_shared_cache_copies_without_holding_gpus_and_loads_from_the_network():
    _, plan = kimi({"path": "s3://models/m/", "cache": {"mode": "sharedVolume"}})
    startup, prediction = plan.startup, plan.prediction
    assert not startup.copy_holds_gpus and "once" in startup.source
    assert startup.load_seconds == math.ceil(KIMI_BYTES / NETWORK_READ_BYTES_PER_S) + WARMUP_S
    held = prediction.generation_seconds + startup.load_seconds
    assert prediction.gpu_hours == round(held * 8 / 3600, 1)


def test_a_filled_volume_copies_nothing():
    _, plan = kimi({"path": "pvc://weights/kimi"})
    assert plan.startup.copy_seconds == 0
    assert plan.prediction.eta_seconds == plan.prediction.generation_seconds + plan.startup.load_seconds


def test_every_candidate_layout_carries_the_start_up():
    _, plan = kimi()
    for candidate in plan.candidates:
        if candidate.prediction is not None:
            assert candidate.prediction.generation_seconds < candidate.prediction.eta_seconds


def probe_seconds(spec, plan) -> int:
    container = manifests.server_statefulset("k", "ns", OWNER, spec, plan)["spec"]["template"]["spec"]["containers"][0]
    probe = container["startupProbe"]
    return probe["failureThreshold"] * probe["periodSeconds"]


def test_the_startup_probe_is_sized_from_the_predicted_load():
    spec, plan = kimi()
    assert plan.startup.probe_seconds == max(PROBE_FLOOR_S, 3 * plan.startup.load_seconds)
    assert probe_seconds(spec, plan) == plan.startup.probe_seconds
    slow = plan.model_copy(update={"startup": plan.startup.model_copy(update={"probe_seconds": 7200})})
    assert probe_seconds(spec, slow) == 7200
    pinned, pinned_plan = kimi(startupTimeoutSeconds=2705)
    assert probe_seconds(pinned, pinned_plan) == 2710  # the spec wins, rounded up to the 10 s period


def server_pod(created: str, copy: tuple[str, str] | None, started: str, ready: str | None) -> dict:
    status: dict = {"containerStatuses": [{"name": "sglang", "state": {"running": {"startedAt": started}}}],
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                    "lastTransitionTime": ready or started}]}
    if copy:
        status["initContainerStatuses"] = [{"name": "sync-models", "state": {"terminated": {
            "exitCode": 0, "startedAt": copy[0], "finishedAt": copy[1]}}}]
    return {"metadata": {"creationTimestamp": created}, "status": status}


def test_status_records_the_observed_copy_and_load_next_to_the_prediction():
    from tokenmill_operator.decide.lifecycle import Observed, ServerState, decide
    from tokenmill_operator.decide.status import DatasetGenerationStatus
    from tokenmill_operator.observe.gather import startup_times

    from .test_lifecycle import T0

    pods = [server_pod("2026-11-29T10:00:00Z", ("2026-11-29T10:00:05Z", "2026-11-29T10:31:05Z"),
                       "2026-11-29T10:31:10Z", "2026-11-29T10:40:10Z"),
            server_pod("2026-11-29T11:00:00Z", None, "2026-11-29T11:00:10Z", None)]  # still loading
    assert startup_times(pods) == (1860, 540)
    _, plan = kimi()
    decision = decide(Observed(generation=1, now=T0, suspended=False, previous=DatasetGenerationStatus(), plan=plan,
                               server=ServerState(1, 1, copy_seconds=1860, load_seconds=540)))
    startup = decision.status.startup
    assert (startup.predicted_copy_seconds, startup.observed_copy_seconds) == (plan.startup.copy_seconds, 1860)
    assert (startup.predicted_load_seconds, startup.observed_load_seconds) == (plan.startup.load_seconds, 540)
    later = decide(Observed(generation=1, now=T0, suspended=False, previous=decision.status, plan=plan,
                            server=ServerState(1, 1)))
    assert later.status.startup.observed_copy_seconds == 1860  # kept once the pod is gone
