"""Fixtures for the e2e tests: a real Kubernetes control plane (kwokctl, binary runtime).

The session fixture ``cluster`` either reuses a live cluster or starts its own one:

* reuse: ``TOKENMILL_KUBECONFIG`` (if set) or the ``make cluster-up`` kubeconfig
  (``<repo>/.cluster/kubeconfig``) when it answers ``/readyz``; such a cluster is never torn down here;
* otherwise ``hack/cluster/cluster.sh up`` with a unique name ``tm-e2e-<pid>-<hex>`` and fresh
  free ports for every component, torn down again at the end of the session, also when tests
  fail, on SIGTERM (converted to SystemExit) and at interpreter exit. Clusters left behind by a
  SIGKILLed run are deleted by ``cluster.sh gc`` at the start of the next session.

Tests are never skipped: if the tools are not built, the fixture fails and says to run ``make tools``.

Fixtures exported for later tests:

* ``cluster`` (session): a :class:`Cluster` with ``.kubeconfig``, ``.api_client``,
  ``.kubectl(*args, check=True)``, ``.apply(manifest, namespace=...)``, ``.wait_for(...)``, ``.tools``;
* ``namespace`` (function): a fresh namespace (with its ``default`` ServiceAccount), deleted afterwards.

Holding Job pods: pods labelled ``tokenmill.io/hold: "true"`` become Running and Ready but do not
complete (see hack/cluster/stages.yaml); remove the label to let them complete.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

log = logging.getLogger("tokenmill.e2e")

REPO = Path(__file__).resolve().parents[2]
BUILD_TOOLS = REPO / "hack" / "build-tools.sh"
CLUSTER_SH = REPO / "hack" / "cluster" / "cluster.sh"
STATE_DIR = Path(os.environ.get("TOKENMILL_CLUSTER_DIR", str(REPO / ".cluster")))
MAKE_KUBECONFIG = STATE_DIR / "kubeconfig"

# Nodes created by hack/cluster/nodes.yaml.
GPU_NODES = ("gpu-h200-0", "gpu-h200-1", "gpu-h100-0")
H200_NODES = ("gpu-h200-0", "gpu-h200-1")
CPU_NODES = ("cpu-0", "cpu-1")
HOLD_LABEL = "tokenmill.io/hold"

T = TypeVar("T")


class ClusterError(RuntimeError):
    """A cluster or kubectl operation failed."""


def tool_paths() -> dict[str, str]:
    """KEY=VALUE paths of the cached tools (hack/build-tools.sh --print-env); builds nothing."""
    out = subprocess.run(
        ["bash", str(BUILD_TOOLS), "--print-env"], check=True, capture_output=True, text=True
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def require_tools() -> dict[str, str]:
    """The tool paths, or a pytest failure (never a skip) that says to run ``make tools``."""
    res = subprocess.run(["bash", str(BUILD_TOOLS), "--check"], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(
            "the local control-plane tools are not built; run `make tools` (hack/build-tools.sh).\n"
            + res.stderr.strip(),
            pytrace=False,
        )
    return tool_paths()


@dataclass
class Cluster:
    """A live cluster: kubeconfig, Python API client and a kubectl of the matching version."""

    name: str
    kubeconfig: Path
    api_client: k8s_client.ApiClient
    tools: dict[str, str]
    started_here: bool
    _apis: dict[type, Any] = field(default_factory=dict, repr=False)

    # -- kubectl -----------------------------------------------------------------------------
    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; with ``check`` a non-zero exit raises ClusterError."""
        cmd = [self.tools["KUBECTL_BIN"], "--kubeconfig", str(self.kubeconfig), *args]
        res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} exited {res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}"
            )
        return res

    def apply(
        self, manifest: str | dict | list, namespace: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl apply`` a YAML string, a dict or a list of dicts."""
        if isinstance(manifest, dict):
            text = yaml.safe_dump(manifest)
        elif isinstance(manifest, list):
            text = yaml.safe_dump_all(manifest)
        else:
            text = manifest
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=text, check=check)

    def get_json(self, *args: str) -> dict:
        """``kubectl get ARGS -o json`` parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    # -- Python client -----------------------------------------------------------------------
    def api(self, cls: type[T]) -> T:
        """A typed API object (e.g. ``cluster.api(kubernetes.client.CoreV1Api)``)."""
        if cls not in self._apis:
            self._apis[cls] = cls(self.api_client)
        return self._apis[cls]

    @property
    def core(self) -> k8s_client.CoreV1Api:
        return self.api(k8s_client.CoreV1Api)

    @property
    def apps(self) -> k8s_client.AppsV1Api:
        return self.api(k8s_client.AppsV1Api)

    @property
    def batch(self) -> k8s_client.BatchV1Api:
        return self.api(k8s_client.BatchV1Api)

    # -- waiting -----------------------------------------------------------------------------
    @staticmethod
    def wait_for(
        predicate: Callable[[], T], what: str, timeout: float = 60, interval: float = 0.5
    ) -> T:
        """Poll ``predicate`` until it returns a truthy value (returned); ClusterError on timeout."""
        deadline = time.monotonic() + timeout
        last_exc: Exception | None = None
        while True:
            try:
                value = predicate()
                if value:
                    return value
            except k8s_client.ApiException as exc:  # e.g. 404 while an object is being created
                last_exc = exc
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})")
            time.sleep(interval)

    def wait_established(self, crd: str, timeout: float = 60) -> None:
        """Wait until a CRD is served. Polled here rather than with `kubectl wait --for=condition=Established`: right
        after an apply the CRD may have no status.conditions yet, and kubectl then fails at once ("accessor error")
        instead of waiting."""
        def established() -> bool:
            res = self.kubectl("get", f"crd/{crd}", "-o",
                               "jsonpath={.status.conditions[?(@.type=='Established')].status}", check=False)
            return res.returncode == 0 and res.stdout.strip() == "True"

        self.wait_for(established, f"CRD {crd} Established", timeout=timeout)


# ---------------------------------------------------------------------------------------------
# lifecycle


def _is_live(kubectl: str, kubeconfig: Path) -> bool:
    if not kubeconfig.is_file():
        return False
    try:
        res = subprocess.run(
            [kubectl, "--kubeconfig", str(kubeconfig), "get", "--raw", "/readyz", "--request-timeout=5s"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        return False
    return res.returncode == 0


class _OwnCluster:
    """A cluster started by this session; ``down()`` is idempotent and safe from atexit."""

    def __init__(self, name: str, kubeconfig: Path) -> None:
        self.name = name
        self.kubeconfig = kubeconfig
        self._up_called = False
        self._down_done = False

    def _run(
        self, *args: str, timeout: float, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(CLUSTER_SH), *args, "--name", self.name, "--kubeconfig", str(self.kubeconfig)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )

    def up(self) -> float:
        self._up_called = True
        t0 = time.monotonic()
        try:
            res = self._run("up", timeout=600)
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"cluster.sh up --name {self.name} timed out: {exc.stderr}") from exc
        if res.returncode != 0:
            raise ClusterError(f"cluster.sh up --name {self.name} failed ({res.returncode}):\n{res.stderr}")
        return time.monotonic() - t0

    def down(self, keep_logs: bool = False) -> None:
        if self._down_done or not self._up_called:
            return
        self._down_done = True
        env = {**os.environ, "TOKENMILL_KEEP_LOGS": "1"} if keep_logs else None
        try:
            res = self._run("down", timeout=180, env=env)
        except subprocess.TimeoutExpired:
            log.error("cluster.sh down --name %s timed out", self.name)
            return
        if res.returncode != 0:
            log.error("cluster.sh down --name %s failed: %s", self.name, res.stderr)


def _sigterm_to_exit() -> None:
    """Turn SIGTERM into SystemExit so that finally blocks and atexit handlers (teardown) run."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:

        def _handler(signum: int, frame: object) -> None:
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, _handler)


def _make_cluster(name: str, kubeconfig: Path, tools: dict[str, str], started_here: bool) -> Cluster:
    api_client = k8s_config.new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    return Cluster(name=name, kubeconfig=kubeconfig, api_client=api_client, tools=tools, started_here=started_here)


def _check_nodes(c: Cluster) -> None:
    names = {n.metadata.name for n in c.core.list_node().items}
    missing = sorted(set(GPU_NODES + CPU_NODES) - names)
    if missing:
        pytest.fail(
            f"cluster at {c.kubeconfig} lacks the test nodes {missing} (hack/cluster/nodes.yaml); "
            "is it a tokenmill test cluster?",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The session's cluster (reused when one is live, else started here and torn down)."""
    tools = require_tools()
    env_kc = os.environ.get("TOKENMILL_KUBECONFIG")
    candidates = [Path(env_kc)] if env_kc else [MAKE_KUBECONFIG]
    for kc in candidates:
        if _is_live(tools["KUBECTL_BIN"], kc):
            log.info("reusing the live cluster of %s", kc)
            c = _make_cluster(f"reused:{kc}", kc, tools, started_here=False)
            _check_nodes(c)
            yield c
            c.api_client.close()
            return
        if env_kc:
            log.warning("TOKENMILL_KUBECONFIG=%s does not answer; starting a cluster", kc)

    STATE_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(["bash", str(CLUSTER_SH), "gc"], capture_output=True, text=True, timeout=300)
    name = f"tm-e2e-{os.getpid()}-{secrets.token_hex(3)}"
    own = _OwnCluster(name, STATE_DIR / f"{name}.kubeconfig")
    atexit.register(own.down)
    _sigterm_to_exit()
    try:
        try:
            elapsed = own.up()
        except ClusterError as exc:
            pytest.fail(str(exc), pytrace=False)
        log.info("cluster %s up in %.1fs", name, elapsed)
        c = _make_cluster(name, own.kubeconfig, tools, started_here=True)
        try:
            yield c
        finally:
            c.api_client.close()
    finally:
        # Keep the component logs (under .cluster/logs/<name>/) when something failed.
        own.down(keep_logs=request.session.testsfailed > 0 or sys.exc_info()[0] is not None)


def _ns_name(nodeid: str) -> str:
    # The parameters are cut off with the rest past 40 characters, so a test's cases differ only in the random
    # part: 4 bytes of it (2 collided in CI with a case's namespace still being deleted).
    base = re.sub(r"[^a-z0-9-]+", "-", nodeid.split("::")[-1].lower()).strip("-")[:40].strip("-")
    return f"e2e-{base}-{secrets.token_hex(4)}"


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test (its default ServiceAccount exists); deleted afterwards."""
    name = _ns_name(request.node.nodeid)
    cluster.core.create_namespace(
        k8s_client.V1Namespace(
            metadata=k8s_client.V1ObjectMeta(name=name, labels={"tokenmill.io/e2e": "true"})
        )
    )
    try:
        cluster.wait_for(
            lambda: cluster.core.read_namespaced_service_account("default", name),
            f"the default ServiceAccount of namespace {name}",
            timeout=60,
        )
        yield name
    finally:
        _release_finalizers(cluster, name)
        try:
            cluster.core.delete_namespace(name, propagation_policy="Background")
        except k8s_client.ApiException as exc:
            if exc.status != 404:
                raise


def _release_finalizers(cluster: Cluster, namespace: str) -> None:
    """The test's operator is gone by now, so nothing would remove its finalizer from the namespace's
    DatasetGenerations: the namespace would stay Terminating for the rest of the session, its controllers deleting
    and recreating the runner pods of a Job they cannot remove, thousands of API calls a minute that slow every later
    test. What the operator does on a delete is tested where it runs (test_operator.py)."""
    custom = cluster.api(k8s_client.CustomObjectsApi)
    try:
        found = custom.list_namespaced_custom_object("tokenmill.io", "v1alpha1", namespace, "datasetgenerations")
    except k8s_client.ApiException as exc:
        if exc.status == 404:  # no CRD in this test (the cluster's own checks)
            return
        raise
    for item in found.get("items", []):
        if item["metadata"].get("finalizers"):
            try:
                custom.patch_namespaced_custom_object("tokenmill.io", "v1alpha1", namespace, "datasetgenerations",
                                                      item["metadata"]["name"], {"metadata": {"finalizers": None}})
            except k8s_client.ApiException as exc:
                if exc.status != 404:
                    raise
