"""What the operator tests share: the operator as a restartable subprocess, the S3 world of the b5 example, and
the test playing the runner pods.

Under kwok no container runs, so the tests play each runner pod themselves: they run the real `tokenmill` process
with that pod's arguments and environment (secrets resolved, the ConfigMap's spec written to a file) against the
simulator and the S3 server on loopback, then let kwok complete the pod.
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

from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import open_storage, s3_client

from .conftest import HOLD_LABEL, REPO, Cluster

NAME = "b5-openthoughts"
MODEL_PREFIX = "moonshotai/Kimi-K2.5/"
PROMPTS = REPO / "examples" / "prompts" / "reasoning.jsonl"
TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
GROUP_VERSION = ("tokenmill.io", "v1alpha1", "datasetgenerations")


# -- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    cluster.wait_established("datasetgenerations.tokenmill.io")


@pytest.fixture(scope="session")
def s3_world(s3_endpoint: str) -> str:
    return seed_b5_world(s3_endpoint)


def seed_b5_world(s3_endpoint: str) -> str:
    """A model prefix with Kimi-K2.5's config.json and the demo tokenizer, and the B5 prompts (also what
    `make cluster-demo` serves from its S3 server, hack/cluster_demo.py)."""
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
                    "TOKENMILL_RESYNC_SECONDS": "1", "TOKENMILL_HEALTH_PORT": str(free_port()),
                    "TOKENMILL_METRICS_PORT": str(free_port()),
                    "TOKENMILL_RUNNER_POD_LABELS": json.dumps({HOLD_LABEL: "true"}),
                    "TOKENMILL_RUNNER_IMAGE": "registry.invalid/tokenmill:test"}
        self.log = log
        self.args: list[str] = []  # kopf's own flags (--verbose, --debug)
        self.process: subprocess.Popen | None = None

    def start(self, crash_at: str | None = None) -> None:
        """Start it; with `crash_at` it SIGKILLs itself when a pass reaches that point (tokenmill_operator.faults)."""
        env = {**self.env, "TOKENMILL_OPERATOR_CRASH_AT": crash_at} if crash_at else self.env
        handle = self.log.open("ab")
        self.process = subprocess.Popen([str(Path(sys.executable).parent / "tokenmill-operator"), *self.args], env=env,
                                        stdout=handle, stderr=subprocess.STDOUT)

    def wait_killed(self, timeout: float = 90) -> None:
        """Wait until it killed itself at its crash point (SIGKILL, as `kill -9` or the OOM killer would)."""
        assert self.process is not None
        code = self.process.wait(timeout=timeout)
        assert code == -signal.SIGKILL, f"the operator exited {code}, not at its crash point:\n" + self.tail()

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

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


def free_port() -> int:
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


def b5_resource(namespace: str, endpoint: str, name: str = NAME, **spec_changes: Any) -> dict[str, Any]:
    """examples/b5-openthoughts.yaml, pointed at this namespace, the test S3 server and its own output prefix."""
    resource = yaml.safe_load((REPO / "examples" / "b5-openthoughts.yaml").read_text())
    resource["metadata"]["namespace"] = namespace
    resource["metadata"]["name"] = name
    resource["spec"]["output"]["endpoint"] = endpoint
    resource["spec"]["output"]["uri"] = f"s3://tokenmill-data/runs/{namespace}/"
    for path, value in spec_changes.items():
        node = resource["spec"]
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        node[int(leaf) if leaf.isdigit() else leaf] = value
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


def play_pod(cluster: Cluster, namespace: str, pod: k8s.V1Pod, server_url: str, work: Path,
             s3_endpoint: str | None = None, extra_args: tuple[str, ...] = (),
             env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the real runner with this pod's arguments and environment, talking to the local simulator (and to
    `s3_endpoint` instead of the spec's, when the test puts a faulty proxy between the operator and S3 only);
    `extra_args` and `env` are the test's own additions (a fault point, a short server wait)."""
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
    args = [str(free_port()) if i > 0 and args[i - 1] == "--metrics-port" else a for i, a in enumerate(args)]
    if s3_endpoint:
        args = [s3_endpoint if i > 0 and args[i - 1] == "--s3-endpoint" else a for i, a in enumerate(args)]
    index = pod.metadata.annotations["batch.kubernetes.io/job-completion-index"]
    environment = {**os.environ, **_env_of(cluster, namespace, container), "JOB_COMPLETION_INDEX": index,
                   "HF_HOME": str(work / "hf"), "TOKENMILL_CACHE": str(work / "cache"), "HOME": str(work),
                   **(env or {})}
    log = (work / f"{pod.metadata.name}.log").open("wb")
    return subprocess.Popen([TOKENMILL, "-q", *args, *extra_args], env=environment, stdout=log,
                            stderr=subprocess.STDOUT)


def release_pod(cluster: Cluster, namespace: str, pod: k8s.V1Pod) -> None:
    cluster.core.patch_namespaced_pod(pod.metadata.name, namespace, {"metadata": {"labels": {HOLD_LABEL: None}}})


def play_runner_pods(cluster: Cluster, namespace: str, server_url: str, work: Path, count: int,
                     indexes: set[str] | None = None, s3_endpoint: str | None = None,
                     ok_codes: tuple[int, ...] = (0,), extra_args: tuple[str, ...] = (),
                     env: dict[str, str] | None = None) -> None:
    """Run the runner for each held pod (or only the given completion indexes), then let kwok complete them."""
    def held() -> list[k8s.V1Pod]:
        pods = [p for p in runner_pods(cluster, namespace) if p.status.phase == "Running"
                and (p.metadata.labels or {}).get(HOLD_LABEL) == "true" and p.metadata.deletion_timestamp is None]
        wanted = [p for p in pods if indexes is None
                  or p.metadata.annotations["batch.kubernetes.io/job-completion-index"] in indexes]
        return wanted if len(wanted) >= count else []

    pods = cluster.wait_for(held, f"{count} held runner pods", timeout=90)
    work.mkdir(parents=True, exist_ok=True)
    processes = [(pod, play_pod(cluster, namespace, pod, server_url, work, s3_endpoint, extra_args, env))
                 for pod in pods[:count]]
    for pod, process in processes:
        code = process.wait(timeout=300)
        assert code in ok_codes, (work / f"{pod.metadata.name}.log").read_text()[-3000:]
        release_pod(cluster, namespace, pod)


def committed_ids(endpoint: str, namespace: str) -> Counter[str]:
    storage = open_storage(f"s3://tokenmill-data/runs/{namespace}/", endpoint)
    return Counter(row["sample_id"] for row in read_committed_rows(storage, "B5_openthoughts"))


def expected_ids() -> set[str]:
    return {orjson.loads(line)["sample_id"] for line in PROMPTS.read_bytes().splitlines() if line.strip()}


def simulator_for(cluster: Cluster, namespace: str, port: int = 0, **faults: Any):
    """The simulator with the server's API key (on `port`, 0: any free one); `faults` are SimConfig's fault_*
    settings."""
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    secret = cluster.core.read_namespaced_secret(f"{NAME}-server-key", namespace)
    return SimServer(SimConfig(model_path=str(REPO / "examples" / "demo-model"), api_key=_b64(secret.data["api-key"]),
                               context_length=262144, time_scale=5000.0, max_running_requests=64, **faults),
                     port=port)


