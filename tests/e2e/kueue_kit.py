"""The real Kueue controller manager (built by hack/build-tools.sh from sigs.k8s.io/kueue) on the local control
plane, run as a process next to the API server, like the operator.

What it needs there, and why:

* Kueue's CRDs, from the module (`config/components/crd/bases`). Kueue's own installation adds a conversion webhook
  to five of them (config/components/crd/patches); its internal certificate manager injects its CA into exactly
  those (pkg/util/cert/cert.go:145-166) and waits for the injection before anything else starts
  (BootstrapCerts, cert.go:46), so the same stanza is added here. Nothing converts: only v1beta2 is served.
* Internal certificate management on, its (empty) Secret in `kueue-system` as Kueue's manifests create it, the
  webhook server on a free loopback port. In a pod that Secret is mounted at the certificate folder; here the
  fixture copies the certificates the rotator wrote into it to a temporary folder (the rotator waits for them,
  cert-controller rotator.go `ensureCertsMounted`). No webhook configuration is registered: the operator writes complete
  Workloads, and no Kueue webhook is needed to admit them (the validating/mutating configurations are looked up
  by the cert rotator and skipped when absent, cert-controller rotator.go `ensureCerts`).
* The on-demand visibility server off: it writes certificates to a fixed `/visibility` folder
  (pkg/visibility/server.go:65) and serves an aggregated API the loopback API server cannot reach.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tokenmill_operator.decide.kueue import EXTERNAL_FRAMEWORK

from .conftest import Cluster

KUEUE_NAMESPACE = "kueue-system"
WEBHOOK_SERVICE = "kueue-webhook-service"
WEBHOOK_SECRET = "kueue-webhook-server-cert"
CONVERTED = ("localqueues", "clusterqueues", "workloads", "cohorts", "multikueueclusters")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _crds(crd_dir: Path) -> list[dict]:
    documents = []
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["metadata"]["name"].split(".")[0] in CONVERTED:
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "conversionReviewVersions": ["v1"],
                "clientConfig": {"service": {"name": WEBHOOK_SERVICE, "namespace": KUEUE_NAMESPACE,
                                             "path": "/convert"}}}}
        documents.append(crd)
    return documents


def _configuration(certs: Path, health_port: int) -> dict:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": _free_port(), "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": WEBHOOK_SERVICE,
                                   "webhookSecretName": WEBHOOK_SECRET},
        # docs/cluster.md: a DatasetGeneration is a job type managed by an external controller (the operator).
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
    }


def _mount_certificates(cluster: Cluster, certs: Path) -> None:
    def written() -> dict | None:
        data = cluster.core.read_namespaced_secret(WEBHOOK_SECRET, KUEUE_NAMESPACE).data or {}
        return data if "tls.crt" in data and "tls.key" in data else None

    data = cluster.wait_for(written, "Kueue's certificates in its Secret", timeout=90)
    certs.mkdir(parents=True, exist_ok=True)
    for key in ("tls.crt", "tls.key"):
        (certs / key).write_bytes(base64.b64decode(data[key]))


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


@pytest.fixture(scope="session")
def kueue_controller(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    work = tmp_path_factory.mktemp("kueue")
    # Server-side: the Workload CRD is larger than client-side apply's last-applied annotation may be.
    cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(_crds(Path(
        cluster.tools["KUEUE_CRD_DIR"]))))
    cluster.wait_for(lambda: any(c["type"] == "Established" and c["status"] == "True" for c in (cluster.get_json(
        "crd", "workloads.kueue.x-k8s.io").get("status") or {}).get("conditions") or []), "Kueue's CRDs", timeout=60)
    cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}},
                   {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": WEBHOOK_SECRET,
                                                                       "namespace": KUEUE_NAMESPACE}}])
    health_port, certs = _free_port(), work / "certs"
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(_configuration(certs, health_port)))
    log = work / "kueue.log"
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    process = subprocess.Popen([cluster.tools["KUEUE_BIN"], f"--config={config}",
                                "--feature-gates=VisibilityOnDemand=false"],
                               env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        _mount_certificates(cluster, certs)
        cluster.wait_for(lambda: process.poll() is None and _ready(health_port), "Kueue ready", timeout=120)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        print(log.read_text(errors="replace")[-6000:], file=sys.stderr)


def gpu_queue(namespace: str, gpus: int) -> list[dict]:
    """A ResourceFlavor, a ClusterQueue with `gpus` fake GPUs (one node's worth) that only this namespace uses, and
    the LocalQueue `gpu-queue` pointing at it."""
    flavor, cluster_queue = f"{namespace}-nodes", f"{namespace}-gpus"
    return [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cluster_queue},
         "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                  "resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                                      "flavors": [{"name": flavor, "resources": [
                                          {"name": "cpu", "nominalQuota": "64"},
                                          {"name": "memory", "nominalQuota": "512Gi"},
                                          {"name": "nvidia.com/gpu", "nominalQuota": str(gpus)}]}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": "gpu-queue", "namespace": namespace}, "spec": {"clusterQueue": cluster_queue}},
    ]
