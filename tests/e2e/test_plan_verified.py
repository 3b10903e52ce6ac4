"""The plan checked on the GPUs, on the real control plane: the operator reads the server's /metrics (the simulator,
serving SGLang's names, stands in for the server pod kwok does not run) and records PlanVerified with the plan's
batch and step beside the server's."""

from __future__ import annotations

import threading

import httpx
import pytest
from kubernetes import client as k8s

from .operator_kit import (  # noqa: F401  (fixtures)
    NAME,
    b5_resource,
    condition,
    crd,
    credentials,
    dsgen,
    free_port,
    operator,
    s3_world,
    simulator_for,
    wait_phase,
)

pytestmark = pytest.mark.e2e


def _load(url: str, api_key: str, stop: threading.Event) -> None:
    """Keep requests running on the simulator until told to stop (the runner's part, without its output)."""
    body = {"input_ids": list(range(100, 400)), "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {api_key}"}) as client:
        while not stop.is_set():
            try:
                client.post("/generate", json=body)
            except httpx.HTTPError:
                pass


def test_the_plan_is_verified_or_said_off_from_the_servers_own_metrics(cluster, namespace, operator, credentials,
                                                                       s3_world):
    port = free_port()
    operator.stop()
    operator.env["TOKENMILL_SERVER_METRICS_URL"] = f"http://127.0.0.1:{port}"
    operator.env["TOKENMILL_OPERATOR_NAMESPACE"] = namespace  # where it keeps the cluster's measured constants
    operator.start()
    cluster.apply(b5_resource(namespace, s3_world, **{"server.verifyWindowSeconds": 2}))
    generating = wait_phase(cluster, namespace, "Generating", timeout=120)
    plan = generating["status"]["serverPlan"]
    waiting = condition(generating, "PlanVerified")
    assert waiting is not None and (waiting["status"], waiting["reason"]) == ("Unknown", "Verifying")

    stop = threading.Event()
    with simulator_for(cluster, namespace, port=port) as simulator:
        key = simulator.config.api_key
        workers = [threading.Thread(target=_load, args=(simulator.url, key, stop), daemon=True) for _ in range(24)]
        for worker in workers:
            worker.start()
        try:
            def checked():
                obj = dsgen(cluster, namespace)
                found = condition(obj, "PlanVerified")
                return obj if found and found["status"] in ("True", "False") else None

            obj = cluster.wait_for(checked, "PlanVerified True or False", timeout=120)
        finally:
            stop.set()
            for worker in workers:
                worker.join(timeout=60)

    found = condition(obj, "PlanVerified")
    verification = obj["status"]["verification"]
    assert found["reason"] == ("PlanVerified" if found["status"] == "True" else "PlanOff")
    assert verification["verified"] is (found["status"] == "True")
    assert verification["predictedBatch"] == plan["prediction"]["batchPerReplica"]
    # The simulator runs at most 64 requests (its max_running_requests): the window saw them.
    assert 1 <= verification["observedBatch"] <= 64 and verification["samples"] >= 1
    assert f"batch predicted {verification['predictedBatch']:,}, observed {verification['observedBatch']:,}" \
        in found["message"]
    assert f"observed {float(verification['observedStepMilliseconds']):,.1f} ms" in found["message"]
    assert verification["windowSeconds"] >= 2
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                             f"involvedObject.name={NAME}").stdout
    assert found["reason"] in events
    # The server's NetworkPolicy admits the operator's pods from its namespace to read /metrics.
    policy = cluster.api(k8s.NetworkingV1Api).read_namespaced_network_policy(f"{NAME}-server", namespace)
    peers = [peer for rule in policy.spec.ingress for peer in rule._from or []]
    assert any(peer.namespace_selector and peer.namespace_selector.match_labels == {
        "kubernetes.io/metadata.name": namespace} and peer.pod_selector.match_labels.get(
        "app.kubernetes.io/component") == "operator" for peer in peers)
