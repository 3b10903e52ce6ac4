"""The Helm chart on the real control plane: server-side dry-run of every rendering, helm install / uninstall.

The monitoring objects (ServiceMonitor, PodMonitor, PrometheusRule) need the Prometheus Operator's CRDs; the tests
apply minimal stand-ins from tests/e2e/fixtures/monitoring-crds.yaml (the real ones come from prometheus-operator,
e.g. kube-prometheus-stack). Under kwok no container runs: the operator's pod becomes Running and Ready without
pulling its image, which is enough to prove the Deployment, its RBAC and its settings are accepted and come up.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from .conftest import REPO, Cluster, ClusterError

pytestmark = pytest.mark.e2e

CHART = REPO / "charts" / "tokenmill"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
MONITORING_CRDS = REPO / "tests" / "e2e" / "fixtures" / "monitoring-crds.yaml"
CRD_NAME = "datasetgenerations.tokenmill.io"


class Helm:
    """helm against the test cluster, with its cache and config kept in a temporary folder."""

    def __init__(self, cluster: Cluster, home: Path) -> None:
        self.bin = cluster.tools["HELM_BIN"]
        self.env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "HELM_CACHE_HOME": str(home / "cache"),
                    "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}

    def __call__(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([self.bin, *args], check=False, capture_output=True, text=True, env=self.env,
                             timeout=timeout)
        if check and res.returncode != 0:
            raise ClusterError(f"helm {' '.join(args)} exited {res.returncode}\n{res.stdout}\n{res.stderr}")
        return res


@pytest.fixture(scope="module")
def helm(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(cluster, tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="module")
def monitoring_crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(MONITORING_CRDS))
    for plural in ("servicemonitors", "podmonitors", "prometheusrules"):
        cluster.wait_established(f"{plural}.monitoring.coreos.com")


@pytest.fixture
def extra_namespaces(cluster: Cluster) -> Iterator[list[str]]:
    """Namespaces a test creates besides its own; deleted afterwards (only those it created)."""
    created: list[str] = []
    yield created
    for name in created:
        cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def _ensure_namespace(cluster: Cluster, name: str, created: list[str]) -> None:
    try:
        cluster.core.create_namespace(k8s.V1Namespace(
            metadata=k8s.V1ObjectMeta(name=name, labels={"tokenmill.io/e2e": "true"})))
        created.append(name)
    except k8s.ApiException as exc:
        if exc.status != 409:
            raise


def _can_i(cluster: Cluster, sa: str, *args: str) -> bool:
    res = cluster.kubectl("auth", "can-i", *args, f"--as=system:serviceaccount:{sa}", check=False)
    assert res.stdout.strip() in ("yes", "no"), res.stdout + res.stderr
    return res.stdout.strip() == "yes"


def _release() -> str:
    return f"tm-{secrets.token_hex(3)}"


def _wait_gone(cluster: Cluster, *args: str) -> None:
    cluster.wait_for(lambda: cluster.kubectl("get", *args, check=False).returncode != 0
                     and "NotFound" in cluster.kubectl("get", *args, check=False).stderr,
                     f"{' '.join(args)} to be deleted", timeout=60)


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=["default", *(p.stem for p in CI_VALUES)])
def test_rendered_manifests_pass_server_side_dry_run(cluster: Cluster, helm: Helm, monitoring_crds: None,
                                                     namespace: str, extra_namespaces: list[str],
                                                     values: Path | None) -> None:
    """Everything the chart renders (CRD included) is accepted by the API server (schemas, RBAC, admission)."""
    args = ["template", "tm", str(CHART), "--namespace", namespace, "--include-crds"]
    if values is not None:
        args += ["-f", str(values)]
    rendered = helm(*args).stdout
    objects = [d for d in yaml.safe_load_all(rendered) if d]
    # Namespaced mode puts Roles into the watched namespaces: they must exist, as they would in a real cluster.
    for ns in sorted({o["metadata"].get("namespace") for o in objects} - {None, namespace}):
        _ensure_namespace(cluster, ns, extra_namespaces)
    res = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                          "--field-manager=tokenmill-chart-e2e", "-f", "-", input=rendered, check=False)
    assert res.returncode == 0, res.stderr
    applied = [line for line in res.stdout.splitlines() if "(server dry run)" in line]
    assert len(applied) == len(objects), res.stdout


def test_helm_install_brings_up_the_operator(cluster: Cluster, helm: Helm, namespace: str) -> None:
    release = _release()
    fullname = f"{release}-tokenmill"
    sa = f"{namespace}:{fullname}"
    helm("install", release, str(CHART), "--namespace", namespace, "--wait", "--timeout", "120s")
    try:
        # The CRD is there (installed by helm, or already present: helm never replaces an existing CRD).
        cluster.wait_established(CRD_NAME)

        deployment = cluster.apps.read_namespaced_deployment(fullname, namespace)
        assert deployment.spec.replicas == 1
        assert deployment.spec.strategy.type == "Recreate"
        available = {c.type: c.status for c in deployment.status.conditions or []}
        assert available.get("Available") == "True", deployment.status
        assert deployment.status.available_replicas == 1
        pod_spec = deployment.spec.template.spec
        (container,) = pod_spec.containers
        assert container.liveness_probe.http_get.path == "/healthz"
        assert container.liveness_probe.http_get.port == "health"
        assert container.readiness_probe is None
        assert container.security_context.read_only_root_filesystem is True
        assert container.security_context.allow_privilege_escalation is False
        assert container.security_context.capabilities.drop == ["ALL"]
        assert pod_spec.security_context.run_as_non_root is True
        assert pod_spec.security_context.seccomp_profile.type == "RuntimeDefault"
        assert pod_spec.service_account_name == fullname

        pods = cluster.core.list_namespaced_pod(
            namespace, label_selector=f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator")
        assert len(pods.items) == 1 and pods.items[0].status.phase == "Running"

        # Least privilege, as the API server's authorizer sees it.
        assert _can_i(cluster, sa, "list", "datasetgenerations.tokenmill.io", "--all-namespaces")
        assert _can_i(cluster, sa, "watch", "datasetgenerations.tokenmill.io", "-n", "default")
        assert _can_i(cluster, sa, "patch", "datasetgenerations.tokenmill.io", "--subresource=status", "-n", "x")
        assert _can_i(cluster, sa, "create", "statefulsets.apps", "-n", "default")
        assert _can_i(cluster, sa, "create", "jobs.batch", "-n", "default")
        assert _can_i(cluster, sa, "get", "secrets", "-n", "default")
        assert _can_i(cluster, sa, "create", "events", "-n", "default")
        assert _can_i(cluster, sa, "list", "customresourcedefinitions.apiextensions.k8s.io")
        assert not _can_i(cluster, sa, "list", "secrets", "-n", "default")
        assert not _can_i(cluster, sa, "delete", "secrets", "-n", "default")
        assert not _can_i(cluster, sa, "update", "datasetgenerations.tokenmill.io", "-n", "default")
        assert not _can_i(cluster, sa, "create", "deployments.apps", "-n", "default")
        assert not _can_i(cluster, sa, "create", "pods", "-n", "default")

        status = json.loads(helm("status", release, "--namespace", namespace, "-o", "json").stdout)
        assert status["info"]["status"] == "deployed"
    finally:
        helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
    _wait_gone(cluster, "deployment", fullname, "-n", namespace)
    _wait_gone(cluster, "clusterrole", fullname)
    # Helm never deletes CRDs (nor the DatasetGenerations with them).
    cluster.kubectl("get", "crd", CRD_NAME)


def test_helm_install_namespaced_mode(cluster: Cluster, helm: Helm, namespace: str,
                                      extra_namespaces: list[str]) -> None:
    watched = f"{namespace}-w"
    _ensure_namespace(cluster, watched, extra_namespaces)
    release = _release()
    fullname = f"{release}-tokenmill"
    sa = f"{namespace}:{fullname}"
    helm("install", release, str(CHART), "--namespace", namespace, "--skip-crds", "--wait", "--timeout", "120s",
         "--set", "rbac.scope=namespace", "--set", f"rbac.namespaces={{{watched}}}")
    try:
        deployment = cluster.apps.read_namespaced_deployment(fullname, namespace)
        env = {e.name: e.value for e in deployment.spec.template.spec.containers[0].env}
        assert env["TOKENMILL_NAMESPACES"] == watched
        assert deployment.status.available_replicas == 1
        cluster.kubectl("get", "role", fullname, "-n", watched)
        assert _can_i(cluster, sa, "list", "datasetgenerations.tokenmill.io", "-n", watched)
        assert _can_i(cluster, sa, "create", "jobs.batch", "-n", watched)
        assert _can_i(cluster, sa, "list", "customresourcedefinitions.apiextensions.k8s.io")
        assert not _can_i(cluster, sa, "list", "datasetgenerations.tokenmill.io", "-n", namespace)
        assert not _can_i(cluster, sa, "list", "datasetgenerations.tokenmill.io", "--all-namespaces")
        assert not _can_i(cluster, sa, "list", "namespaces")
    finally:
        helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
    _wait_gone(cluster, "role", fullname, "-n", watched)


def test_helm_install_with_monitoring(cluster: Cluster, helm: Helm, monitoring_crds: None, namespace: str) -> None:
    release = _release()
    fullname = f"{release}-tokenmill"
    helm("install", release, str(CHART), "--namespace", namespace, "--skip-crds", "--wait", "--timeout", "120s",
         "-f", str(CHART / "ci" / "monitoring-values.yaml"))
    try:
        sm = cluster.get_json("servicemonitor", f"{fullname}-operator", "-n", namespace)
        assert sm["spec"]["endpoints"][0]["honorLabels"] is True
        for name in (f"{fullname}-runners", f"{fullname}-servers"):
            cluster.get_json("podmonitor", name, "-n", namespace)
        rule = cluster.get_json("prometheusrule", fullname, "-n", namespace)
        rules_file = yaml.safe_load((CHART / "rules" / "tokenmill.rules.yaml").read_text())
        assert rule["spec"] == rules_file, "the cluster must get exactly the rules file promtool tests"
        dashboard = cluster.get_json("configmap", f"{fullname}-dashboard-tokenmill", "-n", namespace)
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard["data"]["tokenmill.json"])["uid"] == "tokenmill"
        service = cluster.core.read_namespaced_service(f"{fullname}-metrics", namespace)
        assert service.spec.ports[0].target_port == "metrics"
    finally:
        helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
