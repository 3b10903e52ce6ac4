"""The operator on the real control plane: kubectl apply the b5 example → planned server → runner Job → report.

Under kwok no container runs, so the test plays each runner pod itself: it runs the real `tokenmill` process
with that pod's arguments and environment (secrets resolved, the ConfigMap's spec written to a file) against the
simulator and the S3 server on loopback, then lets kwok complete the pod.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from kubernetes import client as k8s

from tokenmill_runner.shards import read_committed_rows
from tokenmill_runner.storage import open_storage, s3_client

from .conftest import H200_NODES, HOLD_LABEL, REPO, Cluster

pytestmark = pytest.mark.e2e

NAME = "b5-openthoughts"
MODEL_PREFIX = "moonshotai/Kimi-K2.5/"
PROMPTS = REPO / "examples" / "prompts" / "reasoning.jsonl"
TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
GROUP_VERSION = ("tokenmill.io", "v1alpha1", "datasetgenerations")


# -- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/datasetgenerations.tokenmill.io", "--timeout=60s")


@pytest.fixture(scope="module")
def s3_world(s3_endpoint: str) -> str:
    """A model prefix with Kimi-K2.5's config.json and the demo tokenizer, and the B5 prompts."""
    s3 = s3_client(s3_endpoint)
    for bucket in ("models", "tokenmill-data"):
        s3.create_bucket(Bucket=bucket)
    fixture = json.loads((REPO / "tests" / "fixtures" / "models" / "kimi-k2.5.json").read_text())
    s3.put_object(Bucket="models", Key=MODEL_PREFIX + "config.json", Body=json.dumps(fixture["config"]).encode())
    s3.put_object(Bucket="models", Key=MODEL_PREFIX + "model.safetensors.index.json",
                  Body=json.dumps({"metadata": {"total_size": fixture["weight_bytes"]}}).encode())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        s3.put_object(Bucket="models", Key=MODEL_PREFIX + name,
                      Body=(REPO / "examples" / "demo-model" / name).read_bytes())
    s3.put_object(Bucket="tokenmill-data", Key="prompts/B5_openthoughts.jsonl", Body=PROMPTS.read_bytes())
    return s3_endpoint


class Operator:
    """The operator as a subprocess, watching one namespace; restartable."""

    def __init__(self, cluster: Cluster, namespace: str, log: Path) -> None:
        self.env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "TOKENMILL_NAMESPACES": namespace,
                    "TOKENMILL_RESYNC_SECONDS": "1", "TOKENMILL_HEALTH_PORT": str(_free_port()),
                    "TOKENMILL_RUNNER_POD_LABELS": json.dumps({HOLD_LABEL: "true"}),
                    "TOKENMILL_RUNNER_IMAGE": "registry.invalid/tokenmill:test"}
        self.log = log
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        handle = self.log.open("ab")
        self.process = subprocess.Popen([str(Path(sys.executable).parent / "tokenmill-operator")], env=self.env,
                                        stdout=handle, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def operator(cluster: Cluster, namespace: str, crd: None, tmp_path: Path) -> Iterator[Operator]:
    running = Operator(cluster, namespace, tmp_path / "operator.log")
    running.start()
    try:
        yield running
    finally:
        running.stop()
        print(running.log.read_text()[-6000:], file=sys.stderr)


@pytest.fixture
def credentials(cluster: Cluster, namespace: str) -> None:
    cluster.core.create_namespaced_secret(namespace, k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name="s3-creds"),
        string_data={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}))


def b5_resource(namespace: str, endpoint: str, **spec_changes: Any) -> dict[str, Any]:
    """examples/b5-openthoughts.yaml, pointed at this namespace, the test S3 server and its own output prefix."""
    resource = yaml.safe_load((REPO / "examples" / "b5-openthoughts.yaml").read_text())
    resource["metadata"]["namespace"] = namespace
    resource["spec"]["output"]["endpoint"] = endpoint
    resource["spec"]["output"]["uri"] = f"s3://tokenmill-data/runs/{namespace}/"
    for path, value in spec_changes.items():
        node = resource["spec"]
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return resource


# -- helpers -------------------------------------------------------------------------------------------------
def dsgen(cluster: Cluster, namespace: str, name: str = NAME) -> dict[str, Any]:
    return cluster.api(k8s.CustomObjectsApi).get_namespaced_custom_object(*GROUP_VERSION[:2], namespace,
                                                                          GROUP_VERSION[2], name)


def wait_phase(cluster: Cluster, namespace: str, phase: str, timeout: float = 120) -> dict[str, Any]:
    return cluster.wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("phase") == phase else None)(
        dsgen(cluster, namespace)), f"phase {phase}", timeout=timeout)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), None)


def runner_pods(cluster: Cluster, namespace: str) -> list[k8s.V1Pod]:
    selector = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=runner"
    return cluster.core.list_namespaced_pod(namespace, label_selector=selector).items


def _env_of(cluster: Cluster, namespace: str, container: k8s.V1Container) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.env_from or []:
        if source.secret_ref:
            secret = cluster.core.read_namespaced_secret(source.secret_ref.name, namespace)
            env.update({k: _b64(v) for k, v in (secret.data or {}).items()})
    for var in container.env or []:
        if var.value is not None:
            env[var.name] = var.value
        elif var.value_from and var.value_from.secret_key_ref:
            ref = var.value_from.secret_key_ref
            env[var.name] = _b64(cluster.core.read_namespaced_secret(ref.name, namespace).data[ref.key])
    return env


def _b64(value: str) -> str:
    import base64

    return base64.b64decode(value).decode()


def play_pod(cluster: Cluster, namespace: str, pod: k8s.V1Pod, server_url: str, work: Path) -> subprocess.Popen:
    """Start the real runner with this pod's arguments and environment, talking to the local simulator."""
    container = pod.spec.containers[0]
    configmap = next(v.config_map.name for v in pod.spec.volumes if v.config_map)
    spec_file = work / f"{pod.metadata.name}.yaml"
    spec_file.write_text(cluster.core.read_namespaced_config_map(configmap, namespace).data["spec.yaml"])
    args = list(container.args)
    mount = next(m.mount_path for m in container.volume_mounts if m.name == next(
        v.name for v in pod.spec.volumes if v.config_map))
    args = [str(spec_file) if a.startswith(mount) else a for a in args]
    args = [server_url if i > 0 and args[i - 1] == "--server" else a for i, a in enumerate(args)]
    # Four "pods" share this machine: each gets its own metrics port.
    args = [str(_free_port()) if i > 0 and args[i - 1] == "--metrics-port" else a for i, a in enumerate(args)]
    index = pod.metadata.annotations["batch.kubernetes.io/job-completion-index"]
    env = {**os.environ, **_env_of(cluster, namespace, container), "JOB_COMPLETION_INDEX": index,
           "HF_HOME": str(work / "hf"), "TOKENMILL_CACHE": str(work / "cache"), "HOME": str(work)}
    log = (work / f"{pod.metadata.name}.log").open("wb")
    return subprocess.Popen([TOKENMILL, "-q", *args], env=env, stdout=log, stderr=subprocess.STDOUT)


def release_pod(cluster: Cluster, namespace: str, pod: k8s.V1Pod) -> None:
    cluster.core.patch_namespaced_pod(pod.metadata.name, namespace, {"metadata": {"labels": {HOLD_LABEL: None}}})


def play_runner_pods(cluster: Cluster, namespace: str, server_url: str, work: Path, count: int,
                     indexes: set[str] | None = None) -> None:
    """Run the runner for each held pod (or only the given completion indexes), then let kwok complete them."""
    def held() -> list[k8s.V1Pod]:
        pods = [p for p in runner_pods(cluster, namespace) if p.status.phase == "Running"
                and (p.metadata.labels or {}).get(HOLD_LABEL) == "true" and p.metadata.deletion_timestamp is None]
        wanted = [p for p in pods if indexes is None
                  or p.metadata.annotations["batch.kubernetes.io/job-completion-index"] in indexes]
        return wanted if len(wanted) >= count else []

    pods = cluster.wait_for(held, f"{count} held runner pods", timeout=90)
    work.mkdir(parents=True, exist_ok=True)
    processes = [(pod, play_pod(cluster, namespace, pod, server_url, work)) for pod in pods[:count]]
    for pod, process in processes:
        code = process.wait(timeout=300)
        assert code == 0, (work / f"{pod.metadata.name}.log").read_text()[-3000:]
        release_pod(cluster, namespace, pod)


def committed_ids(endpoint: str, namespace: str) -> Counter[str]:
    storage = open_storage(f"s3://tokenmill-data/runs/{namespace}/", endpoint)
    return Counter(row["sample_id"] for row in read_committed_rows(storage, "B5_openthoughts"))


def expected_ids() -> set[str]:
    return {orjson.loads(line)["sample_id"] for line in PROMPTS.read_bytes().splitlines() if line.strip()}


def simulator_for(cluster: Cluster, namespace: str):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    secret = cluster.core.read_namespaced_secret(f"{NAME}-server-key", namespace)
    return SimServer(SimConfig(model_path=str(REPO / "examples" / "demo-model"), api_key=_b64(secret.data["api-key"]),
                               context_length=262144, time_scale=5000.0, max_running_requests=64))


# -- tests ---------------------------------------------------------------------------------------------------
def test_b5_example_runs_to_succeeded(cluster, namespace, operator, credentials, s3_world, tmp_path):
    cluster.apply(b5_resource(namespace, s3_world))
    statefulset = cluster.wait_for(lambda: cluster.apps.read_namespaced_stateful_set(f"{NAME}-server", namespace),
                                   "the server StatefulSet", timeout=60)
    args = statefulset.spec.template.spec.containers[0].args
    flat = " ".join(args)
    for flag in ("--tp-size 8", "--host 0.0.0.0", "--enable-metrics", "--trust-remote-code",
                 "--mem-fraction-static", "--context-length 262144", "--max-running-requests"):
        assert flag in flat, (flag, args)
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
]


@pytest.mark.parametrize(("path", "value", "message"), INVALID, ids=[f"{p}={v}" for p, v, _ in INVALID])
def test_invalid_resources_are_rejected_with_the_field(cluster, namespace, crd, path, value, message):
    resource = b5_resource(namespace, "http://127.0.0.1:9", **{path: value})
    result = cluster.apply(resource, check=False)
    assert result.returncode != 0, f"{path}={value!r} was accepted"
    assert message in result.stderr, result.stderr


IMMUTABLE = [("model.path", "s3://models/other/", "spec.model.path cannot change once the run has started"),
             ("model.tokenizer", "s3://models/tok/", "spec.model.tokenizer cannot change once the run has started"),
             ("output.uri", "s3://tokenmill-data/elsewhere/", "spec.output.uri cannot change once the run has started")]


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
