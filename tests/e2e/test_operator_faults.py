"""The operator under faults, on the real control plane: killed at each lifecycle point, edits while suspended,
deletion during a pass, S3 faults while it reads markers, a server node lost, a runner pod evicted, samples given up
and retried, a Job deleted to run what is missing.

Each test ends the run and checks what a user relies on: every prompt exactly once in the output, the GPUs given
back, and a status that says what happened. Runner pods are played by the test (operator_kit.py).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from tests.faults.s3_proxy import FOREVER, Rule, S3FaultProxy
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import open_storage

from .conftest import H200_NODES, REPO, Cluster
from .operator_kit import (  # noqa: F401  (fixtures)
    NAME,
    Operator,
    b5_resource,
    committed_ids,
    condition,
    crd,
    credentials,
    dsgen,
    expected_ids,
    operator,
    play_pod,
    play_runner_pods,
    release_pod,
    runner_pods,
    s3_world,
    simulator_for,
    wait_phase,
)

pytestmark = pytest.mark.e2e

JOB, SERVER = f"{NAME}-runner", f"{NAME}-server"
SERVER_PODS = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=server"


# -- helpers -------------------------------------------------------------------------------------------------
def patch_spec(cluster: Cluster, namespace: str, spec: dict, name: str = NAME) -> None:
    cluster.kubectl("patch", "dsgen", name, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec}))


def job_or_none(cluster: Cluster, namespace: str) -> k8s.V1Job | None:
    jobs = [j for j in cluster.batch.list_namespaced_job(namespace).items if j.metadata.name == JOB]
    return jobs[0] if jobs else None


def wait_job(cluster: Cluster, namespace: str, timeout: float = 90) -> k8s.V1Job:
    return cluster.wait_for(lambda: job_or_none(cluster, namespace), "the runner Job", timeout=timeout)


def server_gone(cluster: Cluster, namespace: str) -> bool:
    return not cluster.apps.list_namespaced_stateful_set(namespace).items


def assert_done_exactly_once(cluster: Cluster, namespace: str, endpoint: str) -> dict:
    done = wait_phase(cluster, namespace, "Succeeded", timeout=150)
    ids = committed_ids(endpoint, namespace)
    assert set(ids) == expected_ids() and max(ids.values()) == 1, "every prompt exactly once"
    cluster.wait_for(lambda: server_gone(cluster, namespace), "the StatefulSet removed (GPUs back)", timeout=60)
    total = len(expected_ids())
    assert done["status"]["progress"]["completed"] + done["status"]["progress"]["failed"] == total
    return done


def finish(cluster: Cluster, namespace: str, endpoint: str, work: Path, **faults: float) -> dict:
    """Play the four runner pods against the simulator, then wait for Succeeded and check the output."""
    wait_job(cluster, namespace)  # the server's API key Secret exists by then
    with simulator_for(cluster, namespace, **faults) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, work, count=4)
    return assert_done_exactly_once(cluster, namespace, endpoint)


@contextmanager
def phases_seen(cluster: Cluster, namespace: str) -> Iterator[list[str]]:
    """Every phase the resource shows while the block runs (polled a few times a second)."""
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                phase = (dsgen(cluster, namespace).get("status") or {}).get("phase")
            except k8s.ApiException:
                phase = None
            if phase and (not seen or seen[-1] != phase):
                seen.append(phase)
            stop.wait(0.3)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


# -- the operator killed at each lifecycle point ---------------------------------------------------------------
def _killed_at(point: str, operator: Operator, then: Callable[[], object] = lambda: None) -> None:
    """Restart the operator so that it kills itself (SIGKILL, as `kill -9` or the OOM killer would) when a pass reaches
    `point`, do what brings the run there, wait for the kill and restart it plainly, as a Deployment would."""
    operator.kill()
    operator.start(crash_at=point)
    then()
    operator.wait_killed()
    operator.start()


def test_operator_killed_at_each_lifecycle_point_finishes_the_run_exactly_once(
        cluster, namespace, operator, credentials, s3_world, tmp_path):
    """One run, the operator killed at every lifecycle point in the order a run meets them (faults.POINTS): the kills
    compose, and the run still ends Succeeded with every prompt once, one Job and nothing left behind."""
    from tokenmill_operator.faults import POINTS

    met: list[str] = []

    def kill_at(point: str, then: Callable[[], object] = lambda: None) -> None:
        _killed_at(point, operator, then)
        met.append(point)

    kill_at("planned", lambda: cluster.apply(b5_resource(namespace, s3_world)))
    kill_at("server-applied")
    kill_at("job-created")
    first_job = job_or_none(cluster, namespace)
    assert first_job is not None
    assert wait_job(cluster, namespace).metadata.uid == first_job.metadata.uid, "the Job was not made twice"
    wait_phase(cluster, namespace, "Generating", timeout=90)

    kill_at("suspended", lambda: patch_spec(cluster, namespace, {"suspend": True}))
    suspended = wait_phase(cluster, namespace, "Suspended", timeout=60)
    assert condition(suspended, "Progressing")["reason"] == "Suspended"
    cluster.wait_for(lambda: cluster.apps.read_namespaced_stateful_set(SERVER, namespace).spec.replicas == 0,
                     "the server scaled to zero", timeout=60)
    assert wait_job(cluster, namespace).spec.suspend
    patch_spec(cluster, namespace, {"suspend": False})
    wait_phase(cluster, namespace, "Generating", timeout=90)

    replaced = wait_job(cluster, namespace)  # read before the edit: the API server may forget it once deleted
    kill_at("job-replaced", lambda: patch_spec(cluster, namespace, {"sampling": {"maxNewTokens": 4096}}))
    job = cluster.wait_for(lambda: (j := job_or_none(cluster, namespace)) and j.metadata.deletion_timestamp is None
                           and j.metadata.uid != replaced.metadata.uid and j, "the replacement Job", timeout=90)
    assert "--retry-failed" not in job.spec.template.spec.containers[0].args

    def play() -> None:
        with simulator_for(cluster, namespace) as simulator:
            play_runner_pods(cluster, namespace, simulator.url, tmp_path / "runners", count=4)

    kill_at("report-written", play)
    assert sorted(met) == sorted(POINTS), "every crash point is met once"
    done = assert_done_exactly_once(cluster, namespace, s3_world)
    assert done["status"]["report"]["verdict"] in ("pass", "warn")
    assert len(cluster.batch.list_namespaced_job(namespace).items) == 1, "one runner Job"
    assert condition(done, "Ready")["status"] == "True"


# -- spec edit while suspended ---------------------------------------------------------------------------------
def test_job_affecting_edit_while_suspended_replaces_the_job_and_keeps_committed_work(
        cluster, namespace, operator, credentials, s3_world, tmp_path):
    cluster.apply(b5_resource(namespace, s3_world))
    first = wait_job(cluster, namespace)
    with simulator_for(cluster, namespace) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "first", count=1, indexes={"0"})
    before = set(committed_ids(s3_world, namespace))
    assert before and before < expected_ids()
    patch_spec(cluster, namespace, {"suspend": True})
    wait_phase(cluster, namespace, "Suspended", timeout=60)
    patch_spec(cluster, namespace, {"sampling": {"maxNewTokens": 4096}, "datasets": [
        {"name": "B5_openthoughts", "source": "s3://tokenmill-data/prompts/B5_openthoughts.jsonl", "limit": 10000,
         "sampling": {"maxNewTokens": 2048}}]})
    # The old Job goes at once (its pods first); the new one is made when the run resumes.
    cluster.wait_for(lambda: job_or_none(cluster, namespace) is None, "the old Job deleted while suspended",
                     timeout=60)
    assert wait_phase(cluster, namespace, "Suspended")["status"]["run"]["jobHash"] == \
        first.metadata.annotations["tokenmill.io/job-hash"]
    patch_spec(cluster, namespace, {"suspend": False})
    replaced = wait_job(cluster, namespace)
    assert replaced.metadata.uid != first.metadata.uid and not replaced.spec.suspend
    assert replaced.metadata.annotations["tokenmill.io/job-hash"] != first.metadata.annotations["tokenmill.io/job-hash"]
    config = yaml.safe_load(cluster.core.read_namespaced_config_map(JOB, namespace).data["spec.yaml"])
    assert config["spec"]["datasets"][0]["sampling"]["maxNewTokens"] == 2048
    cluster.wait_for(lambda: dsgen(cluster, namespace)["status"]["run"]["jobHash"] ==
                     replaced.metadata.annotations["tokenmill.io/job-hash"], "status.run follows the new Job",
                     timeout=30)
    finish(cluster, namespace, s3_world, tmp_path / "second")
    storage = open_storage(f"s3://tokenmill-data/runs/{namespace}/", s3_world)
    caps = {row["sample_id"]: row["max_new_tokens"] for row in read_committed_rows(storage, "B5_openthoughts")}
    assert {caps[i] for i in before} == {32768}, "what was committed before the edit is kept as it was"
    assert {caps[i] for i in set(caps) - before} == {2048}, "the rest follows the edited spec"


# -- deletion during a pass --------------------------------------------------------------------------------------
def test_deleting_during_a_slow_pass_frees_the_gpus_within_seconds(cluster, namespace, operator, credentials,
                                                                    s3_world):
    timings = []
    with S3FaultProxy(s3_world) as proxy:
        for attempt in range(3):
            name = f"del-{attempt}"
            cluster.apply(b5_resource(namespace, proxy.url, name=name))
            cluster.wait_for(lambda name=name: [j for j in cluster.batch.list_namespaced_job(namespace).items
                                                if j.metadata.name == f"{name}-runner"], f"{name}'s runner Job", timeout=90)
            proxy.only(Rule("delay", delay_s=8.0, times=FOREVER))  # every storage call of a pass now takes 8 s
            proxy.wait_fired("delay")  # a pass is reading the commit markers right now
            started = time.monotonic()
            cluster.kubectl("delete", "dsgen", name, "-n", namespace, "--wait=false")

            def freed(name: str = name) -> bool:  # bound now: the loop moves on
                sts = [s for s in cluster.apps.list_namespaced_stateful_set(namespace).items
                       if s.metadata.name == f"{name}-server"]
                jobs = [j for j in cluster.batch.list_namespaced_job(namespace).items
                        if j.metadata.name == f"{name}-runner"]
                pods = cluster.core.list_namespaced_pod(
                    namespace, label_selector=f"app.kubernetes.io/instance={name},app.kubernetes.io/component=server")
                gone = cluster.kubectl("get", "dsgen", name, "-n", namespace, check=False).returncode != 0
                return not sts and not jobs and not pods.items and gone

            cluster.wait_for(freed, f"{name}: StatefulSet, server pods, Job and the resource gone", timeout=120,
                             interval=0.2)
            timings.append(time.monotonic() - started)
            proxy.clear()
        # SIGTERM (a rollout, a drained node) while a pass waits on the slow store: the operator exits at once, not
        # when the abandoned read ends (f9665d2..35d21cb: 20 s and more, past a Deployment's grace period).
        cluster.apply(b5_resource(namespace, proxy.url, name="del-term"))
        proxy.only(Rule("delay", delay_s=8.0, times=FOREVER))
        proxy.wait_fired("delay")
        assert operator.process is not None
        stopping = time.monotonic()
        operator.process.terminate()
        code = operator.process.wait(timeout=30)
        stopped_in = time.monotonic() - stopping
        proxy.clear()
    print(f"deletion to GPUs freed: {[round(t, 2) for t in timings]} s; SIGTERM to exit {stopped_in:.2f} s",
          file=sys.stderr)
    assert max(timings) < 5, f"deletion took {[round(t, 1) for t in timings]} s"
    assert code == 0 and stopped_in < 5, f"the operator exited {code} {stopped_in:.1f} s after SIGTERM"
    stopping_log = operator.tail(200_000).split("Signal SIGTERM is received")[-1]
    assert "Traceback" not in stopping_log, f"errors while stopping:\n{stopping_log[-3000:]}"


# -- S3 faults while the operator reads markers ---------------------------------------------------------------------
def test_s3_errors_resets_and_slowness_while_reading_markers_never_fail_the_run(
        cluster, namespace, operator, credentials, s3_world, tmp_path):
    with S3FaultProxy(s3_world) as proxy, phases_seen(cluster, namespace) as phases:
        cluster.apply(b5_resource(namespace, proxy.url))
        wait_phase(cluster, namespace, "Generating", timeout=90)
        # S3 throttles the operator: 503 SlowDown on every request.
        proxy.only(Rule("status", status=503, times=FOREVER))
        with simulator_for(cluster, namespace) as simulator:
            # The runners reach S3 directly and finish: the Job completes while its markers cannot be read.
            play_runner_pods(cluster, namespace, simulator.url, tmp_path, count=4, s3_endpoint=s3_world)

        def observation_failed() -> dict | None:
            obj = dsgen(cluster, namespace)
            ready = condition(obj, "Ready")
            return obj if ready and ready["reason"] == "ObservationFailed" else None

        blind = cluster.wait_for(observation_failed, "Ready=False ObservationFailed", timeout=120)
        assert blind["status"]["phase"] == "Generating" and blind["status"]["observationFailedSince"]
        assert "SlowDown" in condition(blind, "Ready")["message"] or "503" in condition(blind, "Ready")["message"]
        assert cluster.apps.read_namespaced_stateful_set(SERVER, namespace).spec.replicas == 1, "children kept"
        proxy.only(Rule("reset_request", times=FOREVER))  # connections reset before any answer
        proxy.wait_fired("reset_request", 10, timeout=120)
        proxy.only(Rule("delay", delay_s=2.0, times=FOREVER))
        proxy.wait_fired("delay", 3, timeout=120)
        proxy.clear()
        done = assert_done_exactly_once(cluster, namespace, s3_world)
    assert "Failed" not in phases, f"phases seen: {phases}"
    assert "observationFailedSince" not in done["status"]
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                             f"involvedObject.name={NAME},reason=ObservationFailed", "-o", "name").stdout.split()
    assert len(events) == 1, "said once, not on every pass"


# -- the server's node deleted ------------------------------------------------------------------------------------
def _node_doc(name: str) -> dict:
    return next(d for d in yaml.safe_load_all((REPO / "hack" / "cluster" / "nodes.yaml").read_text())
                if d and d["metadata"]["name"] == name)


def test_server_node_deleted_the_server_moves_and_the_run_goes_on(cluster, namespace, operator, credentials,
                                                                  s3_world, tmp_path):
    cluster.apply(b5_resource(namespace, s3_world))
    wait_phase(cluster, namespace, "Generating", timeout=90)
    job = wait_job(cluster, namespace)
    lost = cluster.core.list_namespaced_pod(namespace, label_selector=SERVER_PODS).items[0].spec.node_name
    [spare] = [node for node in H200_NODES if node != lost]
    # The other H200 node is cordoned first, so the server has nowhere to go for a while: that makes
    # ServerReady=False observable (it would otherwise flip back within a second).
    cluster.kubectl("cordon", spare)
    try:
        cluster.core.delete_node(lost)

        def server_unschedulable() -> dict | None:
            obj = dsgen(cluster, namespace)
            ready = condition(obj, "ServerReady")
            return obj if ready["status"] == "False" and ready["reason"] == "Unschedulable" else None

        # The pod garbage collector removes the pods of a deleted node (after about 40 s), the StatefulSet makes a
        # new pod, and the scheduler finds no H200 node for it.
        waiting = cluster.wait_for(server_unschedulable, "ServerReady=False (Unschedulable)", timeout=150)
        assert waiting["status"]["phase"] == "Generating", "a lost server is not a failed run"
        cluster.kubectl("uncordon", spare)
        ready = cluster.wait_for(lambda: (o := dsgen(cluster, namespace)) and
                                 condition(o, "ServerReady")["status"] == "True" and o, "ServerReady=True again",
                                 timeout=60)
        assert ready["status"]["phase"] == "Generating"
        [pod] = cluster.core.list_namespaced_pod(namespace, label_selector=SERVER_PODS).items
        assert pod.spec.node_name == spare
        same = wait_job(cluster, namespace)
        assert same.metadata.uid == job.metadata.uid and not same.spec.suspend, "the runners were left alone"
        finish(cluster, namespace, s3_world, tmp_path)
    finally:
        cluster.kubectl("uncordon", spare, check=False)
        if not [n for n in cluster.core.list_node().items if n.metadata.name == lost]:
            cluster.apply(_node_doc(lost))
        cluster.wait_for(lambda: any(c.type == "Ready" and c.status == "True"
                                     for c in cluster.core.read_node(lost).status.conditions or []),
                         f"node {lost} back", timeout=60)


# -- a runner pod evicted ------------------------------------------------------------------------------------------
def test_evicted_runner_pod_is_a_disruption_not_a_failure(cluster, namespace, operator, credentials, s3_world,
                                                          tmp_path):
    cluster.apply(b5_resource(namespace, s3_world))
    wait_job(cluster, namespace)
    victim = cluster.wait_for(lambda: [p for p in runner_pods(cluster, namespace) if p.status.phase == "Running"
                                       and p.metadata.annotations["batch.kubernetes.io/job-completion-index"] == "0"],
                              "runner pod 0", timeout=90)[0]
    with simulator_for(cluster, namespace) as simulator:
        work = tmp_path / "evicted"
        work.mkdir()
        process = play_pod(cluster, namespace, victim, simulator.url, work)
        cluster.core.create_namespaced_pod_eviction(victim.metadata.name, namespace, k8s.V1Eviction(
            metadata=k8s.V1ObjectMeta(name=victim.metadata.name, namespace=namespace)))
        process.terminate()  # the kubelet's SIGTERM: the runner commits what is finished and exits
        process.wait(timeout=120)

        def replacement() -> list:
            return [p for p in runner_pods(cluster, namespace) if p.metadata.uid != victim.metadata.uid
                    and p.metadata.annotations["batch.kubernetes.io/job-completion-index"] == "0"
                    and p.status.phase == "Running"]

        cluster.wait_for(replacement, "a new pod for index 0", timeout=90)
        job = wait_job(cluster, namespace)
        assert not job.status.failed, "an eviction is not counted against the index's retries"
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "rest", count=4)
    done = assert_done_exactly_once(cluster, namespace, s3_world)
    assert condition(done, "Failed")["status"] == "False"


# -- samples given up, then retried with the annotation ----------------------------------------------------------
def test_given_up_samples_fail_the_run_until_the_retry_annotation_runs_them(
        cluster, namespace, operator, credentials, s3_world, tmp_path):
    cluster.apply(b5_resource(namespace, s3_world, **{"runner.maxAttempts": 1}))
    first = wait_job(cluster, namespace)
    # Half the requests end in an abort (finish_reason type abort, no status: counted against the sample, unlike a
    # 503, which the client waits out) and nothing is retried.
    with simulator_for(cluster, namespace, fault_abort_rate=0.5) as simulator:
        # A worker that gave samples up exits 3 (the ledger's exit codes) or, before that change, 0.
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "first", count=4, ok_codes=(0, 3))
    failed = wait_phase(cluster, namespace, "Failed", timeout=120)
    status = failed["status"]
    assert condition(failed, "Failed")["reason"] == "SamplesGivenUp"
    given_up = status["progress"]["givenUp"]
    assert given_up > 0 and status["progress"]["failedByReason"]["retries_exhausted"] == given_up
    assert f"{given_up} of {len(expected_ids())} samples were given up" in status["message"]
    assert "tokenmill.io/retry-failed" in status["message"]
    assert status["report"]["uri"].endswith("report.json"), "the report is written all the same"
    cluster.wait_for(lambda: server_gone(cluster, namespace), "the GPUs given back", timeout=60)

    cluster.kubectl("annotate", "dsgen", NAME, "-n", namespace, "tokenmill.io/retry-failed=1")
    retry_job = cluster.wait_for(
        lambda: (j := job_or_none(cluster, namespace)) and j.metadata.uid != first.metadata.uid and j,
        "a new runner Job", timeout=90)
    assert "--retry-failed" in retry_job.spec.template.spec.containers[0].args
    handled = dsgen(cluster, namespace)["status"]["retry"]
    assert handled["handled"] == "1" and "--retry-failed" in handled["outcome"]
    done = finish(cluster, namespace, s3_world, tmp_path / "retry")
    assert done["status"]["progress"]["givenUp"] == 0 and done["status"]["progress"]["failed"] == 0
    assert "report" in done["status"]


# -- SamplesMissing, then the advice: delete the Job ---------------------------------------------------------------
def test_deleting_the_job_after_samples_missing_runs_the_missing_samples(
        cluster, namespace, operator, credentials, s3_world, tmp_path):
    cluster.apply(b5_resource(namespace, s3_world))
    first = wait_job(cluster, namespace)
    with simulator_for(cluster, namespace) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "three", count=3, indexes={"0", "1", "2"})
        # Worker 3 "exits 0" without doing its share: the Job completes with samples missing.
        pod = next(p for p in runner_pods(cluster, namespace)
                   if p.metadata.annotations["batch.kubernetes.io/job-completion-index"] == "3")
        release_pod(cluster, namespace, pod)
        failed = wait_phase(cluster, namespace, "Failed", timeout=90)
        assert condition(failed, "Failed")["reason"] == "SamplesMissing"
        assert f"kubectl delete job {JOB}" in failed["status"]["message"]
        cluster.kubectl("delete", "job", JOB, "-n", namespace, "--cascade=foreground")
        cluster.wait_for(lambda: (j := job_or_none(cluster, namespace)) and j.metadata.uid != first.metadata.uid,
                         "a new runner Job", timeout=120)
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "again", count=4)
    assert_done_exactly_once(cluster, namespace, s3_world)
