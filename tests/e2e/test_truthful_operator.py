"""What the operator says about a run is true, on the real API server (issue 19): a lowered `samples` over a run
killed part-way does not end Succeeded, a replaced Job whose pods end before any runner recorded the run's layout is
not judged by the previous layout, and runner pods the scheduler cannot place end the run and give the GPUs back.

The runner pods are played as in every operator test (operator_kit): the real `tokenmill` process with the pod's
arguments and environment, against the simulator and the S3 server; kwok then completes the pod.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from .conftest import Cluster
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
    release_pod,
    runner_pods,
    s3_world,
    simulator_for,
    wait_phase,
)
from .test_operator_faults import JOB, SERVER, patch_spec

pytestmark = pytest.mark.e2e

DATASET = {"name": "B5_openthoughts", "source": "s3://tokenmill-data/prompts/B5_openthoughts.jsonl", "limit": 10000,
           "sampling": {"maxNewTokens": 32768}}
BLOCKED = "tokenmill.io/e2e-runner-blocked"


def job_hash(cluster: Cluster, namespace: str) -> str | None:
    jobs = [j for j in cluster.batch.list_namespaced_job(namespace).items
            if j.metadata.name == JOB and j.metadata.deletion_timestamp is None]
    return jobs[0].metadata.annotations["tokenmill.io/job-hash"] if jobs else None


def new_job(cluster: Cluster, namespace: str, old_hash: str | None) -> str:
    return cluster.wait_for(lambda: (h := job_hash(cluster, namespace)) and h != old_hash and h,
                            "the replacement runner Job", timeout=90)


def started(cluster: Cluster, namespace: str) -> str:
    """The first runner Job's hash, once the operator made it (the server's API key Secret with it)."""
    return new_job(cluster, namespace, None)


def held_pods(cluster: Cluster, namespace: str, count: int) -> list:
    return cluster.wait_for(lambda: (pods := [p for p in runner_pods(cluster, namespace)
                                              if p.status.phase == "Running" and p.metadata.deletion_timestamp is None])
                            and len(pods) >= count and pods, f"{count} runner pods", timeout=90)


def test_samples_lowered_over_a_run_killed_part_way_does_not_end_succeeded(cluster, namespace, operator, credentials,
                                                                           s3_world, tmp_path):
    # Review 1 on the API server: 75 prompts at samples 4, every worker killed after its 4th shard of 10 (at least
    # 160 of 300 slots committed, more than the 150 slots of samples 2), samples lowered to 2, and the new Job's
    # runners stop before generating anything (the server is gone). Counting outcomes said 160 >= 150: Succeeded.
    # Shards close at 10 samples only (an hour's shardMaxSeconds, not the example's 60 s): in a loaded CI run the
    # 4 killed workers' 16 markers once held 158 slots, a shard closed short by its timer.
    resource = b5_resource(namespace, s3_world, **{"datasets.0.samples": 4, "runner.shardMaxSamples": 10,
                                                   "runner.shardMaxSeconds": 3600, "runner.outageBudgetSeconds": 1})
    cluster.apply(resource)
    first = started(cluster, namespace)
    with simulator_for(cluster, namespace) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "killed", count=4,
                         env={"TOKENMILL_FAULT": "kill-after:marker:4"}, ok_codes=(-signal.SIGKILL,))
    killed = sum(committed_ids(s3_world, namespace).values())
    assert 160 <= killed < 4 * len(expected_ids())
    patch_spec(cluster, namespace, {"datasets": [{**DATASET, "samples": 2}]})
    new_job(cluster, namespace, first)
    play_runner_pods(cluster, namespace, "http://127.0.0.1:9", tmp_path / "lowered", count=4,
                     extra_args=("--server-wait", "1"), ok_codes=(4,))  # no server within 1 s: exit 4
    failed = wait_phase(cluster, namespace, "Failed", timeout=90)
    reason = condition(failed, "Failed")
    assert reason["reason"] == "SamplesMissing", reason
    assert "lack sample 0" in reason["message"] and "lack sample 1" in reason["message"], reason["message"]
    assert failed["status"]["phase"] != "Succeeded" and condition(failed, "Ready")["status"] == "False"


def test_a_replaced_job_that_ends_before_its_runner_records_the_layout_is_not_judged_by_the_old_one(
        cluster, namespace, operator, credentials, s3_world, tmp_path):
    # Review 2 on the API server: a finished run (samples 1), samples raised to 2, and the new Job's pods end
    # before any runner writes run.json. The old run.json is settled; judged by it, the run ended Succeeded.
    cluster.apply(b5_resource(namespace, s3_world))
    started(cluster, namespace)
    with simulator_for(cluster, namespace) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "first", count=4)
    done = wait_phase(cluster, namespace, "Succeeded", timeout=120)
    first = done["status"]["run"]["jobHash"]
    patch_spec(cluster, namespace, {"datasets": [{**DATASET, "samples": 2}]})
    new_job(cluster, namespace, first)  # Succeeded said every slot of the spec is settled; samples 2 asks for more
    for pod in held_pods(cluster, namespace, 4):
        release_pod(cluster, namespace, pod)  # the pods end (kwok completes them) with no runner ever run
    failed = wait_phase(cluster, namespace, "Failed", timeout=90)
    reason = condition(failed, "Failed")
    assert reason["reason"] == "SamplesMissing", reason
    assert "ended before its runner recorded the run's layout" in reason["message"], reason["message"]
    assert dsgen(cluster, namespace)["status"]["phase"] == "Failed"


@contextmanager
def runner_nodes_blocked(cluster: Cluster) -> Iterator[None]:
    """Taint every node without a GPU taint: server pods (which tolerate the GPU taint) still schedule on the GPU
    nodes, runner pods fit nowhere and stay Pending, Unschedulable, as with a quota or a selector no node meets."""
    nodes = [n.metadata.name for n in cluster.core.list_node().items
             if not any(t.key == "nvidia.com/gpu" for t in n.spec.taints or [])]
    assert nodes, "the test cluster has CPU nodes (hack/cluster/nodes.yaml)"
    try:
        for node in nodes:
            cluster.kubectl("taint", "node", node, f"{BLOCKED}=true:NoSchedule", "--overwrite")
        yield
    finally:
        for node in nodes:
            cluster.kubectl("taint", "node", node, f"{BLOCKED}-", check=False)


def test_runner_pods_the_scheduler_cannot_place_end_the_run_and_give_the_gpus_back(cluster, namespace, operator,
                                                                                   credentials, s3_world):
    # Review 10 on the API server: the server is up, the runner pods stay Pending; past startDeadlineSeconds the
    # run ends Failed, RunnerCannotStart, naming the scheduler's reason, and the GPU StatefulSet goes.
    with runner_nodes_blocked(cluster):
        cluster.apply(b5_resource(namespace, s3_world, **{"runner.startDeadlineSeconds": 5}))
        failed = wait_phase(cluster, namespace, "Failed", timeout=120)
        reason = condition(failed, "Failed")
        assert reason["reason"] == "RunnerCannotStart", reason
        assert "Unschedulable" in reason["message"] and "startDeadlineSeconds" in reason["message"], reason["message"]
        cluster.wait_for(lambda: not cluster.apps.list_namespaced_stateful_set(namespace).items,
                         "the server StatefulSet deleted", timeout=60)
        job = cluster.batch.read_namespaced_job(JOB, namespace)
        assert job.spec.suspend, "the runner Job is suspended: its Pending pods go"
        assert SERVER not in {s.metadata.name for s in cluster.apps.list_namespaced_stateful_set(namespace).items}
