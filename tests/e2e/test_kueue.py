"""Runs behind a Kueue LocalQueue, with the real Kueue controller on the real control plane.

Two DatasetGenerations each need one node's 8 GPUs; the ClusterQueue has 8 fake GPUs. The second waits, Queued
with its position and no pod at all, while the first runs to Succeeded; then it is admitted and starts. A sampler
checks throughout that at most one run has server pods (GPUs) at any moment, terminating ones included. An
eviction mid-run stops the pods, hands the quota back, and once readmitted the run finishes with every sample
committed exactly once.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from .conftest import Cluster
from .kueue_kit import gpu_queue, kueue_controller  # noqa: F401  (fixtures)
from .operator_kit import (  # noqa: F401  (fixtures)
    NAME,
    b5_resource,
    committed_ids,
    condition,
    crd,
    credentials,
    dsgen,
    expected_ids,
    operator,
    play_runner_pods,
    s3_world,
    simulator_for,
    wait_phase,
)

pytestmark = pytest.mark.e2e

SECOND = "b5-second"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
SERVER = "app.kubernetes.io/component=server"


def queued_resource(namespace: str, endpoint: str, name: str) -> dict:
    resource = b5_resource(namespace, endpoint, name, **{"output.uri": f"s3://tokenmill-data/runs/{namespace}/{name}/"})
    resource["metadata"]["labels"] = {QUEUE_LABEL: "gpu-queue"}
    return resource


def pods_of(cluster: Cluster, namespace: str, name: str) -> list:
    selector = f"app.kubernetes.io/instance={name}"
    return [p for p in cluster.core.list_namespaced_pod(namespace, label_selector=selector).items
            if p.status.phase not in ("Succeeded", "Failed")]


def phase_of(cluster: Cluster, namespace: str, name: str) -> dict | None:
    obj = dsgen(cluster, namespace, name)
    return obj if (obj.get("status") or {}).get("phase") else None


@contextmanager
def gpu_holders(cluster: Cluster, namespace: str) -> Iterator[list[set[str]]]:
    """Samples, every 0.2 s, which runs have server pods (scheduled or not, terminating included)."""
    samples: list[set[str]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                pods = cluster.core.list_namespaced_pod(namespace, label_selector=SERVER, _request_timeout=10).items
            except Exception:  # noqa: BLE001  (a slow API server under CI load skips a sample, never ends sampling)
                time.sleep(0.2)
                continue
            samples.append({p.metadata.labels["app.kubernetes.io/instance"] for p in pods
                            if p.status.phase not in ("Succeeded", "Failed")})
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join(timeout=10)


def server_ready(cluster: Cluster, namespace: str, name: str):
    ready = [p for p in pods_of(cluster, namespace, name) if "server" in p.metadata.name
             and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
    return ready[0] if ready else None


def test_two_runs_competing_for_one_nodes_gpus_run_one_after_the_other(
        cluster, namespace, kueue_controller, operator, credentials, s3_world, tmp_path):
    cluster.apply(gpu_queue(namespace, gpus=8))
    with gpu_holders(cluster, namespace) as holders:
        cluster.apply(queued_resource(namespace, s3_world, NAME))
        cluster.wait_for(lambda: server_ready(cluster, namespace, NAME), "the first run's server", timeout=120)
        first = dsgen(cluster, namespace, NAME)["status"]
        assert first["queue"]["admitted"] and first["queue"]["clusterQueue"] == f"{namespace}-gpus"

        cluster.apply(queued_resource(namespace, s3_world, SECOND))
        waiting = cluster.wait_for(
            lambda: (lambda o: o if o and o["status"]["phase"] == "Queued" and o["status"]["queue"].get("position")
                     else None)(phase_of(cluster, namespace, SECOND)), "the second run Queued", timeout=60)
        queue = waiting["status"]["queue"]
        assert queue["position"] == 1 and queue["name"] == "gpu-queue" and not queue["admitted"]
        assert "insufficient" in queue["message"].lower() or "quota" in queue["message"].lower(), queue
        # Waiting holds nothing: no server pod, no runner Job, while the first run generates.
        time.sleep(3)
        assert pods_of(cluster, namespace, SECOND) == []
        assert not cluster.batch.list_namespaced_job(namespace, label_selector=f"app.kubernetes.io/instance={SECOND}"
                                                     ).items

        with simulator_for(cluster, namespace) as simulator:
            play_runner_pods(cluster, namespace, simulator.url, tmp_path, count=4)
        wait_phase(cluster, namespace, "Succeeded", timeout=120)

        cluster.wait_for(lambda: server_ready(cluster, namespace, SECOND), "the second run's server", timeout=120)
        second = dsgen(cluster, namespace, SECOND)["status"]
        assert second["queue"]["admitted"] and second["phase"] in ("StartingServer", "Generating")
        # kwok makes a pod ready as it is created: under load the sampler's next look can come after the block
        # ends. It must see the second run's pods before it stops, or the check below says nothing about them.
        cluster.wait_for(lambda: any(SECOND in sample for sample in holders), "a sample with the second run's pods",
                         timeout=60)
    # The first run gave its Workload (and its quota) up when it ended.
    left = cluster.kubectl("get", "workloads.kueue.x-k8s.io", f"{NAME}-run", "-n", namespace, "--ignore-not-found")
    assert left.stdout.strip() == ""
    both = [sample for sample in holders if len(sample) > 1]
    assert not both, f"both runs held server pods at once in {len(both)} of {len(holders)} samples"
    seen = {frozenset(sample) for sample in holders}
    assert {NAME} in holders and {SECOND} in holders, f"{len(holders)} samples saw only {seen}"


def test_an_eviction_is_an_outage_the_run_survives(cluster, namespace, kueue_controller, operator, credentials,
                                                   s3_world, tmp_path):
    cluster.apply(gpu_queue(namespace, gpus=8))
    resource = b5_resource(namespace, s3_world)
    resource["metadata"]["labels"] = {QUEUE_LABEL: "gpu-queue"}
    cluster.apply(resource)
    cluster.wait_for(lambda: cluster.batch.read_namespaced_job(f"{NAME}-runner", namespace), "the runner Job", 120)
    workload = f"{NAME}-run"
    with simulator_for(cluster, namespace) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "first", count=1, indexes={"0"})
        assert sum(committed_ids(s3_world, namespace).values()) > 0

        # Deactivating is how an administrator evicts a workload; preemption takes the same path (Evicted).
        cluster.kubectl("patch", "workloads.kueue.x-k8s.io", workload, "-n", namespace, "--type=merge",
                        "-p", '{"spec": {"active": false}}')
        queued = wait_phase(cluster, namespace, "Queued", timeout=60)
        assert condition(queued, "Progressing")["reason"] == "Evicted" and "report" not in queued["status"]
        cluster.wait_for(lambda: not pods_of(cluster, namespace, NAME), "the run's pods gone", timeout=60)
        assert cluster.batch.read_namespaced_job(f"{NAME}-runner", namespace).spec.suspend
        released = cluster.wait_for(lambda: (lambda w: w if not (w.get("status") or {}).get("admission") else None)(
            cluster.get_json("workloads.kueue.x-k8s.io", workload, "-n", namespace)), "the quota handed back",
            timeout=60)
        assert any(c["type"] == "Evicted" and c["status"] == "True" for c in released["status"]["conditions"])

        cluster.kubectl("patch", "workloads.kueue.x-k8s.io", workload, "-n", namespace, "--type=merge",
                        "-p", '{"spec": {"active": true}}')
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "second", count=3, indexes={"1", "2", "3"})
    done = wait_phase(cluster, namespace, "Succeeded", timeout=120)
    ids = committed_ids(s3_world, namespace)
    assert set(ids) == expected_ids() and max(ids.values()) == 1, "resumed from what was committed, nothing twice"
    assert len(cluster.batch.list_namespaced_job(namespace).items) == 1, "one runner Job across the eviction"
    cluster.wait_for(lambda: not cluster.kubectl("get", "workloads.kueue.x-k8s.io", "-n", namespace,
                                                 "--no-headers", "--ignore-not-found").stdout.strip(),
                     "the Workload deleted once the run ended", timeout=60)
    assert done["status"]["startup"]["predictedCopySeconds"] > 0


def test_removing_the_queue_label_stops_the_pods_before_the_quota_goes_and_a_queue_can_be_required(
        cluster, namespace, kueue_controller, crd, credentials, s3_world, tmp_path):
    """security-a87e82b.md B5: on a87e82b removing the label deleted the Workload in the same pass while the server
    kept its GPUs (reconcile.py:399), so Kueue counted them free; and no setting required a queue."""
    from .operator_kit import Operator

    running = Operator(cluster, namespace, tmp_path / "operator.log")
    running.env["TOKENMILL_REQUIRE_QUEUE"] = "true"
    running.start()
    try:
        cluster.apply(gpu_queue(namespace, gpus=8))
        cluster.apply(queued_resource(namespace, s3_world, NAME))
        cluster.wait_for(lambda: server_ready(cluster, namespace, NAME), "the run's server, admitted", timeout=120)
        cluster.wait_for(lambda: cluster.batch.read_namespaced_job(f"{NAME}-runner", namespace), "the runner Job",
                         timeout=120)
        workload = f"{NAME}-run"
        uncounted: list[int] = []  # pods alive in each sample that found the Workload gone
        counted: list[int] = []  # ... and in each that found it there
        stop = threading.Event()

        def sample() -> None:
            # The Workload first, then the pods: pods seen after the Workload was seen gone held GPUs uncounted.
            while not stop.is_set():
                try:
                    gone = not cluster.kubectl("get", "workloads.kueue.x-k8s.io", workload, "-n", namespace,
                                               "--ignore-not-found", "-o", "name").stdout.strip()
                    holding = len(pods_of(cluster, namespace, NAME))
                except Exception:  # noqa: BLE001  (a slow API server skips a sample)
                    continue
                (uncounted if gone else counted).append(holding)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            cluster.kubectl("label", "datasetgenerations.tokenmill.io", NAME, "-n", namespace, f"{QUEUE_LABEL}-")
            cluster.wait_for(lambda: not pods_of(cluster, namespace, NAME), "the run's pods stopped", timeout=90)
            cluster.wait_for(lambda: not cluster.kubectl("get", "workloads.kueue.x-k8s.io", workload, "-n",
                                                         namespace, "--ignore-not-found", "-o", "name"
                                                         ).stdout.strip(), "the Workload given back", timeout=60)
            refused = cluster.wait_for(lambda: (lambda o: o if (condition(o, "Ready") or {}).get("reason")
                                                == "QueueRequired" else None)(dsgen(cluster, namespace, NAME)),
                                       "Ready=False QueueRequired", timeout=60)
        finally:
            stop.set()
            thread.join(timeout=30)
        assert not any(uncounted), f"pods held with no Workload in {sum(map(bool, uncounted))} samples"
        assert any(counted), f"no sample saw the pods stopping ({len(counted)} samples)"
        assert f"{QUEUE_LABEL}=<LocalQueue>" in condition(refused, "Ready")["message"]
        assert cluster.batch.read_namespaced_job(f"{NAME}-runner", namespace).spec.suspend
        assert not pods_of(cluster, namespace, NAME), "refused: no pod comes back outside Kueue"

        # A run that never named a queue is refused before anything is made.
        cluster.apply(b5_resource(namespace, s3_world, SECOND,
                                  **{"output.uri": f"s3://tokenmill-data/runs/{namespace}/{SECOND}/"}))
        cluster.wait_for(lambda: (lambda o: o if (condition(o, "Ready") or {}).get("reason") == "QueueRequired"
                                  else None)(dsgen(cluster, namespace, SECOND)), "the unqueued run refused",
                         timeout=60)
        assert not cluster.apps.list_namespaced_stateful_set(
            namespace, label_selector=f"app.kubernetes.io/instance={SECOND}").items
    finally:
        running.stop()
        print(running.tail(), file=sys.stderr)
