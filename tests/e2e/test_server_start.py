"""A server that never becomes ready does not hold its GPUs for ever, on the real API server (issue 29, scenario
5): its pod's container waits in CrashLoopBackOff (played by kwok, hack/cluster/stages.yaml `pod-crash-loop`)
before any runner Job exists. Past the stall window the run says Stalled, naming the pod's reason; past
spec.server.startDeadlineSeconds it ends Failed, ServerCannotStart, and the GPU StatefulSet goes. Before, it stayed
StartingServer, Stalled False, pass after pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from .conftest import Cluster
from .operator_kit import (  # noqa: F401  (fixtures)
    b5_resource,
    condition,
    crd,
    credentials,
    dsgen,
    operator,
    s3_world,
    wait_phase,
)
from .test_operator_faults import JOB, SERVER, SERVER_PODS

pytestmark = pytest.mark.e2e

BLOCKED = "tokenmill.io/e2e-server-blocked"
CRASH_LOOP = "tokenmill.io/e2e-crash-loop"


@contextmanager
def gpu_nodes_blocked(cluster: Cluster) -> Iterator[None]:
    """Taint the GPU nodes so the server pod waits, unscheduled, until it is labelled to crash."""
    nodes = [n.metadata.name for n in cluster.core.list_node().items
             if any(t.key == "nvidia.com/gpu" for t in n.spec.taints or [])]
    assert nodes, "the test cluster has GPU nodes (hack/cluster/nodes.yaml)"
    try:
        for node in nodes:
            cluster.kubectl("taint", "node", node, f"{BLOCKED}=true:NoSchedule", "--overwrite")
        yield
    finally:
        for node in nodes:
            cluster.kubectl("taint", "node", node, f"{BLOCKED}-", check=False)


def test_a_server_in_crash_loop_is_stalled_then_fails_server_cannot_start_and_gives_the_gpus_back(
        cluster, namespace, operator, credentials, s3_world):
    with gpu_nodes_blocked(cluster):
        cluster.apply(b5_resource(namespace, s3_world, **{"server.startDeadlineSeconds": 40,
                                                          "runner.stallSeconds": 2}))
        pod = cluster.wait_for(lambda: next(iter(cluster.core.list_namespaced_pod(
            namespace, label_selector=SERVER_PODS).items), None), "the server pod", timeout=90)
        cluster.kubectl("label", "pod", "-n", namespace, pod.metadata.name, f"{CRASH_LOOP}=true")
    crashing = cluster.wait_for(
        lambda: any(((c.state.waiting and c.state.waiting.reason) == "CrashLoopBackOff")
                    for p in cluster.core.list_namespaced_pod(namespace, label_selector=SERVER_PODS).items
                    for c in p.status.container_statuses or []), "the server pod in CrashLoopBackOff", timeout=90)
    assert crashing

    def stalled() -> dict | None:
        resource = dsgen(cluster, namespace)
        found = condition(resource, "Stalled")
        # While the pod waited unscheduled it was Stalled too (Unschedulable); the message follows the pod.
        return resource if found and found["status"] == "True" and "CrashLoopBackOff" in found["message"] else None

    waiting = cluster.wait_for(stalled, "Stalled=True naming CrashLoopBackOff", timeout=90)
    said = condition(waiting, "Stalled")
    assert said["reason"] == "ServerNotReady" and "CrashLoopBackOff" in said["message"], said
    assert waiting["status"]["phase"] == "StartingServer"

    failed = wait_phase(cluster, namespace, "Failed", timeout=150)
    reason = condition(failed, "Failed")
    assert reason["reason"] == "ServerCannotStart", reason
    assert "CrashLoopBackOff" in reason["message"] and "startDeadlineSeconds" in reason["message"], reason
    cluster.wait_for(lambda: SERVER not in {s.metadata.name for s in
                                            cluster.apps.list_namespaced_stateful_set(namespace).items},
                     "the server StatefulSet deleted", timeout=60)
    assert JOB not in {j.metadata.name for j in cluster.batch.list_namespaced_job(namespace).items}
    assert condition(dsgen(cluster, namespace), "Failed")["reason"] == "ServerCannotStart", "it stays ended"
