"""The operator on the real control plane: kubectl apply the b5 example → planned server → runner Job → report.

The runner pods are played by the test (see operator_kit.py).
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client as k8s

from .conftest import H200_NODES
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
    runner_pods,
    s3_world,
    simulator_for,
    wait_phase,
)

pytestmark = pytest.mark.e2e


# -- tests ---------------------------------------------------------------------------------------------------
def test_b5_example_runs_to_succeeded(cluster, namespace, operator, credentials, s3_world, tmp_path):
    cluster.apply(b5_resource(namespace, s3_world))
    statefulset = cluster.wait_for(lambda: cluster.apps.read_namespaced_stateful_set(f"{NAME}-server", namespace),
                                   "the server StatefulSet", timeout=60)
    args = statefulset.spec.template.spec.containers[0].args
    flat = " ".join(args)
    for flag in ("--tp-size 8", "--host 0.0.0.0", "--enable-metrics", "--trust-remote-code",
                 "--mem-fraction-static", "--context-length", "--max-running-requests"):
        assert flag in flat, (flag, args)
    # The operator read the 75-row source at plan time: the context is what the job needs (its longest prompt's
    # bytes, twice, + maxNewTokens 32,768), not Kimi-K2.5's 262,144.
    context = int(args[args.index("--context-length") + 1])
    assert 32768 < context < 65536, context
    assert "--reasoning-parser" not in flat
    limits = statefulset.spec.template.spec.containers[0].resources.limits
    assert limits["nvidia.com/gpu"] == "8"

    def server_pod_ready():
        pods = cluster.core.list_namespaced_pod(namespace, label_selector=(
            f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=server")).items
        ready = [p for p in pods if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
        return ready[0] if ready else None

    pod = cluster.wait_for(server_pod_ready, "a Ready server pod", timeout=90)
    assert pod.spec.node_name in H200_NODES
    ready_at = next(c.last_transition_time for c in pod.status.conditions if c.type == "Ready")
    job = cluster.wait_for(lambda: cluster.batch.read_namespaced_job(f"{NAME}-runner", namespace), "the runner Job",
                           timeout=60)
    assert job.metadata.creation_timestamp >= ready_at.replace(microsecond=0), "runner only after the server"
    assert job.spec.completion_mode == "Indexed" and job.spec.parallelism == 4
    generating = wait_phase(cluster, namespace, "Generating")
    assert condition(generating, "ServerReady")["status"] == "True"
    assert generating["status"]["serverPlan"]["tensorParallel"] == 8
    assert generating["status"]["serverPlan"]["nodesPerReplica"] == 1

    with simulator_for(cluster, namespace) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, tmp_path, count=4)

    done = wait_phase(cluster, namespace, "Succeeded", timeout=120)
    status = done["status"]
    assert status["report"]["verdict"] in ("pass", "warn") and status["report"]["uri"].endswith("report.json")
    total = len(expected_ids())
    assert status["progress"]["completed"] + status["progress"]["failed"] == total
    assert status["progress"]["display"] == f"{total}/{total} (100.0%)"
    assert condition(done, "Succeeded")["status"] == "True" and condition(done, "Ready")["status"] == "True"
    cluster.wait_for(lambda: not cluster.apps.list_namespaced_stateful_set(namespace).items,
                     "the StatefulSet to be removed (GPUs released)", timeout=60)
    ids = committed_ids(s3_world, namespace)
    assert set(ids) == expected_ids() and max(ids.values()) == 1

    table = cluster.kubectl("get", "dsgen", "-n", namespace).stdout
    header, row = table.splitlines()[:2]
    for column in ("PHASE", "PROGRESS", "TOKENS/S", "ETA", "AGE"):
        assert column in header
    assert "Succeeded" in row and f"{total}/{total} (100.0%)" in row
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                             f"involvedObject.name={NAME}").stdout
    assert "Succeeded" in events
    explain = cluster.kubectl("explain", "dsgen.spec.server.tensorParallel").stdout
    assert "Tensor-parallel size" in explain


def test_impossible_gpu_request_reports_the_schedulers_reason(cluster, namespace, operator, credentials, s3_world):
    cluster.apply(b5_resource(namespace, s3_world, **{"server.gpusPerNode": 16, "server.tensorParallel": 16}))

    def unschedulable():
        obj = dsgen(cluster, namespace)
        ready = condition(obj, "ServerReady")
        return obj if ready and ready["reason"] == "Unschedulable" else None

    obj = cluster.wait_for(unschedulable, "ServerReady=False with the scheduler's reason", timeout=90)
    ready = condition(obj, "ServerReady")
    assert ready["status"] == "False" and "Insufficient nvidia.com/gpu" in ready["message"]
    assert obj["status"]["phase"] == "StartingServer"
    assert not cluster.batch.list_namespaced_job(namespace).items, "no runner while the server cannot start"


def test_restart_suspend_resume_and_delete(cluster, namespace, operator, credentials, s3_world, tmp_path):
    cluster.apply(b5_resource(namespace, s3_world))
    cluster.wait_for(lambda: cluster.batch.read_namespaced_job(f"{NAME}-runner", namespace), "the runner Job", 90)
    with simulator_for(cluster, namespace) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "first", count=1, indexes={"0"})
        first = sum(committed_ids(s3_world, namespace).values())
        assert first > 0

        operator.kill()  # anywhere in the run: nothing may be duplicated or lost
        operator.start()
        cluster.kubectl("patch", "dsgen", NAME, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
        wait_phase(cluster, namespace, "Suspended", timeout=60)
        cluster.wait_for(lambda: cluster.apps.read_namespaced_stateful_set(f"{NAME}-server", namespace).spec.replicas
                         == 0, "the server scaled to zero", timeout=60)
        cluster.wait_for(lambda: cluster.batch.read_namespaced_job(f"{NAME}-runner", namespace).spec.suspend,
                         "the runner Job suspended", timeout=60)
        cluster.wait_for(lambda: not [p for p in runner_pods(cluster, namespace) if p.status.phase == "Running"],
                         "runner pods gone while suspended", timeout=60)

        cluster.kubectl("patch", "dsgen", NAME, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}')
        cluster.wait_for(lambda: cluster.apps.read_namespaced_stateful_set(f"{NAME}-server", namespace).spec.replicas
                         == 1, "the server back", timeout=60)
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "second", count=3, indexes={"1", "2", "3"})
    wait_phase(cluster, namespace, "Succeeded", timeout=120)
    assert len(cluster.apps.list_namespaced_stateful_set(namespace).items) == 0
    assert len(cluster.batch.list_namespaced_job(namespace).items) == 1, "one runner Job across restarts"
    ids = committed_ids(s3_world, namespace)
    assert set(ids) == expected_ids() and max(ids.values()) == 1, "resumed from what was committed"

    cluster.kubectl("delete", "dsgen", NAME, "-n", namespace, "--wait=true", "--timeout=60s")
    cluster.wait_for(lambda: not cluster.batch.list_namespaced_job(namespace).items
                     and not cluster.core.list_namespaced_config_map(
                         namespace, label_selector=f"app.kubernetes.io/instance={NAME}").items,
                     "children garbage-collected", timeout=90)
    assert set(committed_ids(s3_world, namespace)) == expected_ids(), "deleting the resource keeps the data"


INVALID = [
    ("datasets", [{"name": "a", "source": "s3://b/a.jsonl"}, {"name": "a", "source": "s3://b/b.jsonl"}],
     "dataset names must be unique"),
    ("sampling.maxNewTokens", 0, "spec.sampling.maxNewTokens"),
    ("server.tensorParallel", 6, "power of two"),
    ("server", {"gpusPerNode": 12, "tensorParallel": 16}, "must span whole nodes"),
    ("server.memFractionStatic", "1.2", "fraction between 0 and 1"),
    ("validation.maxTruncatedFraction", "0", "fraction between 0 and 1"),
    ("output.uri", "gs://bucket/x/", "output.uri must be s3://"),
    ("datasets", [{"name": "a", "source": "/local/file.jsonl"}], "sources are read from S3"),
    ("datasets", [{"name": "bad name", "source": "s3://b/a.jsonl"}], "spec.datasets[0].name"),
    ("server.extraArgs", ["--tp-size", "4"], "flags the operator manages"),
    ("sampling.temperature", "warm", "decimal number"),
    # SGLang's SamplingParams.verify answers 400 to these (sampling/sampling_params.py:257-277 in 0.5.23).
    ("sampling.temperature", "-0.1", "must be a number >= 0"),
    ("sampling.topP", "0", "must be in (0, 1]"),
    ("sampling.minP", "1.5", "must be in [0, 1]"),
    ("sampling.topK", 0, "must be -1 (the whole vocabulary) or at least 1"),
    ("datasets", [{"name": "a", "source": "s3://b/a.jsonl", "sampling": {"repetitionPenalty": "0"}}],
     "must be in (0, 2]"),
    ("server.contextLength", 8192, "below server.contextLength"),
    ("runner.parallelism", 0, "spec.runner.parallelism"),
    # n samples per prompt and the input layout (issue 12)
    ("datasets", [{"name": "a", "source": "s3://b/a.jsonl", "samples": 0}], "spec.datasets[0].samples"),
    ("datasets", [{"name": "a", "source": "s3://b/a.jsonl", "samples": 65}], "spec.datasets[0].samples"),
    ("datasets", [{"name": "a", "source": "s3://b/a.jsonl", "input": {"format": "alpaca"}}],
     "spec.datasets[0].input.format"),
    ("datasets", [{"name": "a", "source": "s3://b/a.jsonl", "input": {"fields": {"prompt": ""}}}],
     "spec.datasets[0].input.fields.prompt"),
    ("seed", -1, "spec.seed"),
    # a moving tag names no release (issue 21)
    ("server.image", "lmsysorg/sglang:latest", "has a tag SGLang moves to each new build"),
]


@pytest.mark.parametrize(("path", "value", "message"), INVALID, ids=[f"{p}={v}" for p, v, _ in INVALID])
def test_invalid_resources_are_rejected_with_the_field(cluster, namespace, crd, path, value, message):
    resource = b5_resource(namespace, "http://127.0.0.1:9", **{path: value})
    result = cluster.apply(resource, check=False)
    assert result.returncode != 0, f"{path}={value!r} was accepted"
    assert message in result.stderr, result.stderr


IMMUTABLE = [("model.path", "s3://models/other/", "spec.model.path cannot change once the run has started"),
             ("model.tokenizer", "s3://models/tok/", "spec.model.tokenizer cannot change once the run has started"),
             ("output.uri", "s3://tokenmill-data/elsewhere/", "spec.output.uri cannot change once the run has started"),
             ("datasets.0.source", "s3://tokenmill-data/prompts/replaced.jsonl",
              "spec.datasets[].source and .input cannot change once the run has started"),
             ("datasets.0.input", {"format": "sharegpt"},
              "spec.datasets[].source and .input cannot change once the run has started")]


@pytest.mark.parametrize(("path", "value", "message"), IMMUTABLE, ids=[p for p, _, _ in IMMUTABLE])
def test_what_the_run_started_with_cannot_change_even_when_suspended(cluster, namespace, crd, path, value, message):
    # No operator here: the status is written as the operator writes it when it creates the first runner Job.
    cluster.apply(b5_resource(namespace, "http://127.0.0.1:9", suspend=True))
    before = cluster.apply(b5_resource(namespace, "http://127.0.0.1:9", suspend=True, **{path: value}), check=False)
    assert before.returncode == 0, f"before the run started {path} may still be corrected: {before.stderr}"
    cluster.apply(b5_resource(namespace, "http://127.0.0.1:9", suspend=True))
    run = {"modelPath": "s3://models/moonshotai/Kimi-K2.5/", "tokenizer": "s3://models/moonshotai/Kimi-K2.5/",
           "outputUri": f"s3://tokenmill-data/runs/{namespace}/", "jobHash": "0123456789abcdef"}
    cluster.kubectl("patch", "dsgen", NAME, "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"run": run}}))
    changed = cluster.apply(b5_resource(namespace, "http://127.0.0.1:9", suspend=True, **{path: value}), check=False)
    assert changed.returncode != 0 and message in changed.stderr, changed.stderr
    assert "create a new DatasetGeneration" in changed.stderr
    other = cluster.apply(b5_resource(namespace, "http://127.0.0.1:9", suspend=True, **{"runner.parallelism": 2}),
                          check=False)
    assert other.returncode == 0, f"other fields stay editable: {other.stderr}"
    layout = cluster.apply(b5_resource(namespace, "http://127.0.0.1:9", suspend=True,
                                       **{"datasets.0.limit": 500, "datasets.0.samples": 2}), check=False)
    assert layout.returncode == 0, f"samples and limit may change (the layout says which is current): {layout.stderr}"


def test_missing_credentials_secret_is_reported_then_picked_up(cluster, namespace, operator, s3_world):
    cluster.apply(b5_resource(namespace, s3_world))

    def missing():
        obj = dsgen(cluster, namespace)
        ready = condition(obj, "Ready")
        return obj if ready and ready["reason"] == "MissingSecret" else None

    obj = cluster.wait_for(missing, "Ready=False MissingSecret", timeout=60)
    assert "s3-creds" in condition(obj, "Ready")["message"]
    assert not cluster.apps.list_namespaced_stateful_set(namespace).items, "nothing started without credentials"
    cluster.core.create_namespaced_secret(namespace, k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name="s3-creds"),
        string_data={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}))
    cluster.wait_for(lambda: cluster.apps.read_namespaced_stateful_set(f"{NAME}-server", namespace),
                     "the server once the Secret exists", timeout=60)


def test_an_output_another_live_resource_writes_is_in_use_and_holds_no_gpu(cluster, namespace, operator, credentials,
                                                                             s3_world):
    # Review 3: a second resource (another uid, the same model) on an output a first one writes. The first one's
    # runners hold the output's lease; the second fails OutputInUse before any server starts, naming the holder,
    # and starts once the lease is gone (the first one finished or was deleted, and its lease went stale).
    from datetime import UTC, datetime

    from tokenmill_runner.store.lease import LEASE, Lease
    from tokenmill_runner.store.manifest import Owner
    from tokenmill_runner.store.storage import open_storage

    storage = open_storage(f"s3://tokenmill-data/runs/{namespace}/", s3_world)
    first = Owner(kind="DatasetGeneration", name="first", namespace=namespace, uid="uid-of-the-first")
    storage.put(LEASE, Lease(first, "first-runner-0", datetime.now(UTC), datetime.now(UTC)).encode())
    cluster.apply(b5_resource(namespace, s3_world))
    failed = wait_phase(cluster, namespace, "Failed", timeout=90)
    reason = condition(failed, "Failed")
    assert reason["reason"] == "OutputInUse"
    assert f"DatasetGeneration {namespace}/first (uid uid-of-the-first)" in reason["message"]
    assert not cluster.apps.list_namespaced_stateful_set(namespace).items, "no GPU held while the output is in use"
    storage.delete(LEASE)
    cluster.wait_for(lambda: cluster.apps.read_namespaced_stateful_set(f"{NAME}-server", namespace),
                     "the server once the output is free", timeout=90)
