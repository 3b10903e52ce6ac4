"""The plan checked on the GPUs, on the real control plane: the operator reads the server's /metrics (the simulator,
serving SGLang's names, stands in for the server pod kwok does not run) and records PlanVerified with the plan's
batch and step beside the server's."""

from __future__ import annotations

import json
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


def test_a_new_plan_on_the_cluster_starts_from_the_measured_constants_in_the_operators_configmap(
        cluster, namespace, operator, credentials, s3_world):
    from tokenmill_operator.decide.planner import model_facts, plan_server
    from tokenmill_operator.decide.planner.verify import CONFIGMAP_NAME, constants_entry, plan_constants_key
    from tokenmill_runner.facts.refit import Refit
    from tokenmill_runner.spec.resource import parse_document

    from .conftest import REPO

    resource = b5_resource(namespace, s3_world)
    fixture = json.loads((REPO / "tests" / "fixtures" / "models" / "kimi-k2.5.json").read_text())
    facts = model_facts(fixture["config"], fixture["weight_bytes"])
    published = plan_server(parse_document(resource).spec, facts)
    key = plan_constants_key(published, facts.architecture)
    # What an earlier run on this cluster measured: expert reads at 60 % of the published speed.
    slower = Refit(0.6, 1.0, 1.0, samples=40, error_before=0.4, error_after=0.02, fitted=("experts",))
    cluster.core.create_namespaced_config_map(namespace, k8s.V1ConfigMap(
        metadata=k8s.V1ObjectMeta(name=CONFIGMAP_NAME), data={key: constants_entry(slower)}))
    operator.stop()
    operator.env["TOKENMILL_OPERATOR_NAMESPACE"] = namespace
    operator.start()
    cluster.apply(resource)

    def planned():
        plan = (dsgen(cluster, namespace).get("status") or {}).get("serverPlan")
        return plan if plan and plan.get("prediction") else None

    plan = cluster.wait_for(planned, "a server plan", timeout=90)
    assert plan["measuredConstants"] == key
    assert plan["prediction"]["decodeTokensPerSecond"] < published.prediction.decode_tokens_per_second
