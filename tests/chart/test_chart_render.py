"""The Helm chart without a cluster: lint, render (default values and every ci/ file), schema, RBAC, monitoring."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenmill_operator.decide.manifests import OPERATOR_POD_LABELS
from tokenmill_operator.decide.planner.verify import CONFIGMAP_NAME

from .tools import CHART, CI_VALUES, DASHBOARD, REPO, RULES, by_kind, one, run, template

VALUES_FILES = [None, *CI_VALUES]
VALUES_IDS = ["default", *(p.stem for p in CI_VALUES)]


def _args(values: Path | None) -> list[str]:
    return [] if values is None else ["-f", str(values)]


def _chart() -> dict[str, Any]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def _env(objects: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in _container(objects)["env"]}


# -- CRD ------------------------------------------------------------------------------------------------------
def test_chart_crd_is_the_generated_crd() -> None:
    """charts/tokenmill/crds/ must be a byte-identical copy of the generated crds/ (Helm cannot template it)."""
    generated = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    shipped = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert shipped == generated, "charts/tokenmill/crds/ and crds/ list different files"
    for name in generated:
        assert (CHART / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes(), (
            f"charts/tokenmill/crds/{name} differs from crds/{name}: cp crds/{name} charts/tokenmill/crds/")


# -- lint and render ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values", VALUES_FILES, ids=VALUES_IDS)
def test_helm_lint_strict(helm: str, henv: dict[str, str], values: Path | None) -> None:
    res = run([helm, "lint", "--strict", str(CHART), *_args(values)], env=henv)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 chart(s) failed" in res.stdout


@pytest.mark.parametrize("values", VALUES_FILES, ids=VALUES_IDS)
def test_helm_template_renders(helm: str, henv: dict[str, str], values: Path | None) -> None:
    objects = template(helm, *_args(values), "--include-crds", env=henv)
    kinds = {o["kind"] for o in objects}
    assert {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"} <= kinds
    for obj in objects:
        assert obj["metadata"]["name"], obj
        if obj["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"].get("namespace"), f"{obj['kind']} {obj['metadata']['name']} has no namespace"
    # Never two operators.
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


# -- the operator Deployment ----------------------------------------------------------------------------------
def test_default_deployment(helm: str, henv: dict[str, str]) -> None:
    objects = template(helm, env=henv)
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _container(objects)
    app_version = _chart()["appVersion"]

    assert deployment["metadata"]["name"] == "tm-tokenmill"
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "tokenmill", "app.kubernetes.io/instance": "tm",
                        "app.kubernetes.io/component": "operator"}
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert container["image"] == f"ghcr.io/tokenmill/tokenmill-operator:{app_version}"
    assert container["imagePullPolicy"] == "IfNotPresent"
    # Liveness only (kopf's /healthz), no readiness probe.
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert "readinessProbe" not in container
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 8081}
    # Secure defaults: non-root, read-only root, no capabilities, no escalation, RuntimeDefault seccomp.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert pod["serviceAccountName"] == "tm-tokenmill"
    # What the operator reads from its environment.
    env = _env(objects)
    assert "TOKENMILL_NAMESPACES" not in env  # cluster scope: all namespaces
    assert env["TOKENMILL_RUNNER_IMAGE"] == f"ghcr.io/tokenmill/tokenmill-runner:{app_version}"
    assert env["TOKENMILL_RESYNC_SECONDS"] == "15"
    assert env["TOKENMILL_STALL_SECONDS"] == "900"
    assert env["TOKENMILL_HEALTH_PORT"] == "8080"
    assert env["TOKENMILL_METRICS_PORT"] == "8081"
    assert "TOKENMILL_RUNNER_POD_LABELS" not in env
    assert "resources" not in container


def test_images_tags_and_digests_from_values(helm: str, henv: dict[str, str]) -> None:
    objects = template(helm, "--set", "image.tag=1.2.3", "--set", "image.digest=sha256:" + "a" * 64,
                       "--set", "runnerImage.repository=reg.example/runner", "--set", "runnerImage.tag=9.9",
                       "--set", "operator.runnerPodLabels.team=ml", env=henv)
    assert _container(objects)["image"] == "ghcr.io/tokenmill/tokenmill-operator:1.2.3@sha256:" + "a" * 64
    env = _env(objects)
    assert env["TOKENMILL_RUNNER_IMAGE"] == "reg.example/runner:9.9"
    assert json.loads(env["TOKENMILL_RUNNER_POD_LABELS"]) == {"team": "ml"}


# -- RBAC -----------------------------------------------------------------------------------------------------
def _rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


NAMESPACED_NEEDS = {
    ("tokenmill.io", "datasetgenerations"): {"get", "list", "watch", "patch"},
    ("tokenmill.io", "datasetgenerations/status"): {"get", "patch", "update"},
    ("tokenmill.io", "datasetgenerations/finalizers"): {"update"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    ("apps", "statefulsets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "pods"): {"get", "list", "watch"},
    ("batch", "jobs"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "services"): {"get", "create", "patch"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch"},
    ("", "secrets"): {"get", "create"},
    # spec.model.cache (sharedVolume): the claim per model digest; Kueue: the run's Workload (docs/cluster.md).
    ("", "persistentvolumeclaims"): {"get", "create", "patch"},
    ("kueue.x-k8s.io", "workloads"): {"get", "list", "create", "delete"},
    ("kueue.x-k8s.io", "workloads/status"): {"patch"},
}
CRD_NEEDS = {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"}}
NODE_NEEDS = {("", "nodes"): {"list"}}  # the GPU nodes' driver label, read when a plan is made


MEASURED_CONSTANTS_RULES = [
    {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [CONFIGMAP_NAME], "verbs": ["get", "patch"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
]


def _constants_role(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Role", "RoleBinding")
            and o["metadata"]["name"].endswith("-measured-constants")]


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_the_measured_constants_are_one_configmap_in_the_operators_own_namespace(helm: str, henv: dict[str, str],
                                                                                 scope: str) -> None:
    objects = template(helm, "--set", f"rbac.scope={scope}", "--set", "rbac.namespaces={team-a}", env=henv)
    role, binding = sorted(_constants_role(objects), key=lambda o: o["kind"] == "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "tokenmill-system"
    assert role["rules"] == MEASURED_CONSTANTS_RULES
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tm-tokenmill", "namespace": "tokenmill-system"}]
    env = {e["name"]: e for e in _container(objects)["env"]}
    assert env["TOKENMILL_OPERATOR_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # The server pods' NetworkPolicies admit the operator by these labels (manifests.OPERATOR_POD_LABELS).
    labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert OPERATOR_POD_LABELS.items() <= labels.items()


def test_rbac_cluster_scope_is_least_privilege(helm: str, henv: dict[str, str]) -> None:
    objects = template(helm, env=henv)
    objects = [o for o in objects if o not in _constants_role(objects)]
    assert by_kind(objects, "Role") == [] and by_kind(objects, "RoleBinding") == []
    role = one(objects, "ClusterRole")
    assert _rules(role) == {**NAMESPACED_NEEDS, **CRD_NEEDS, **NODE_NEEDS, ("", "namespaces"): {"list", "watch"}}
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tm-tokenmill", "namespace": "tokenmill-system"}]
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    # The operator never writes spec through update, and never lists Secrets.
    assert "update" not in _rules(role)[("tokenmill.io", "datasetgenerations")]
    assert {"list", "watch"}.isdisjoint(_rules(role)[("", "secrets")])


def test_rbac_namespace_scope(helm: str, henv: dict[str, str]) -> None:
    objects = template(helm, "--set", "rbac.scope=namespace", "--set", "rbac.namespaces={team-a,team-b}",
                       "--set", "metrics.runners.podMonitor.enabled=true", env=henv)
    assert _rules(one(objects, "ClusterRole")) == {**CRD_NEEDS, **NODE_NEEDS}
    objects = [o for o in objects if o not in _constants_role(objects)]
    roles = by_kind(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert _rules(role) == NAMESPACED_NEEDS
    bindings = by_kind(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["roleRef"]["kind"] == "Role"
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "tm-tokenmill", "namespace": "tokenmill-system"}]
    assert _env(objects)["TOKENMILL_NAMESPACES"] == "team-a,team-b"
    monitor = one(objects, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_rbac_and_service_account_can_be_external(helm: str, henv: dict[str, str]) -> None:
    objects = template(helm, "--set", "rbac.create=false", "--set", "serviceAccount.create=false",
                       "--set", "serviceAccount.name=ops-tokenmill", env=henv)
    kinds = {o["kind"] for o in objects}
    assert kinds.isdisjoint({"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops-tokenmill"


# -- schema ---------------------------------------------------------------------------------------------------
BAD_VALUES = [
    (["--set", "replicas=2"], "/replicas", "value must be 1"),
    (["--set", "image.tag=2"], "/image/tag", "want string"),
    (["--set", "runnerImage.tag=true"], "/runnerImage/tag", "want string"),
    (["--set", "rbac.scope=everywhere"], "/rbac/scope", "'cluster', 'namespace'"),
    (["--set", "rbac.scope=namespace"], "/rbac/namespaces", "minItems"),
    (["--set", "rbac.scope=namespace", "--set", "rbac.namespaces={Not_A_Namespace}"], "/rbac/namespaces/0",
     "does not match pattern"),
    (["--set", "replica=1"], "additional properties 'replica' not allowed", ""),
    (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy", "'Always', 'IfNotPresent', 'Never'"),
    (["--set", "image.digest=latest"], "/image/digest", "does not match pattern"),
    (["--set", "metrics.operator.serviceMonitor.interval=30"], "/metrics/operator/serviceMonitor/interval",
     "want string"),
    (["--set", "metrics.runners.podMonitor.enabled=yes"], "/metrics/runners/podMonitor/enabled", "want boolean"),
    (["--set", "operator.metricsPort=70000"], "/operator/metricsPort", "maximum"),
    (["--set", "argocd.syncWave=first"], "/argocd/syncWave", "does not match pattern"),
    (["--set", "prometheusRule.runnerRules=sometimes"], "/prometheusRule/runnerRules", "want null or boolean"),
]


@pytest.mark.parametrize(("args", "path", "message"), BAD_VALUES, ids=[" ".join(a) for a, _, _ in BAD_VALUES])
def test_schema_rejects_bad_values(helm: str, henv: dict[str, str], args: list[str], path: str,
                                   message: str) -> None:
    for command in (["template", "tm"], ["lint", "--strict"]):
        res = run([helm, *command, str(CHART), *args], env=henv)
        assert res.returncode != 0, f"helm {command[0]} accepted {args}"
        output = res.stdout + res.stderr
        assert "values don't meet the specifications of the schema" in output, output
        assert path in output and message in output, output


def test_schema_rejects_a_numeric_tag_from_a_values_file(helm: str, henv: dict[str, str], tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("image:\n  tag: 1.10\n")  # YAML reads 1.1: why tags must be strings
    res = run([helm, "template", "tm", str(CHART), "-f", str(values)], env=henv)
    assert res.returncode != 0
    assert "at '/image/tag': got number, want string" in res.stderr


def test_service_monitor_needs_the_service(helm: str, henv: dict[str, str]) -> None:
    res = run([helm, "template", "tm", str(CHART), "--set", "metrics.operator.serviceMonitor.enabled=true",
               "--set", "metrics.operator.service.enabled=false"], env=henv)
    assert res.returncode != 0
    assert "metrics.operator.serviceMonitor.enabled needs metrics.operator.service.enabled" in res.stderr


# -- monitoring, dashboards, Argo CD --------------------------------------------------------------------------
def test_monitoring_is_off_by_default(helm: str, henv: dict[str, str]) -> None:
    objects = template(helm, env=henv)
    kinds = {o["kind"] for o in objects}
    assert kinds.isdisjoint({"ServiceMonitor", "PodMonitor", "PrometheusRule"})
    assert not [o for o in by_kind(objects, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
    # The metrics Service exists anyway (cheap; any scraper can use it).
    service = one(objects, "Service")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}]


def test_monitoring_objects(helm: str, henv: dict[str, str]) -> None:
    objects = template(helm, "-f", str(CHART / "ci" / "monitoring-values.yaml"), env=henv)
    service = one(objects, "Service")
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()

    sm = one(objects, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["tokenmill-system"]}
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # the series' own namespace label must survive
    assert endpoint["interval"] == "15s"
    assert endpoint["metricRelabelings"][0]["action"] == "drop"

    monitors = {m["metadata"]["name"]: m for m in by_kind(objects, "PodMonitor")}
    runners, servers = monitors["tm-tokenmill-runners"], monitors["tm-tokenmill-servers"]
    assert runners["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "tokenmill",
                                                          "app.kubernetes.io/component": "runner"}
    assert runners["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert runners["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    assert runners["spec"]["namespaceSelector"] == {"any": True}
    assert servers["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "tokenmill",
                                                          "app.kubernetes.io/component": "server"}
    assert servers["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert servers["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
    # The operator's pods are never scraped as runners or servers.
    for monitor in (runners, servers):
        assert not monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load(RULES.read_text()), "the PrometheusRule must be the rules file, unchanged"

    (dashboard,) = [o for o in by_kind(objects, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"]["grafana_folder"] == "LLM"
    assert json.loads(dashboard["data"]["tokenmill.json"]) == json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize(("args", "runner_group"), [
    ([], False),
    (["--set", "metrics.runners.podMonitor.enabled=true"], True),
    (["--set", "prometheusRule.runnerRules=true"], True),
    (["--set", "metrics.runners.podMonitor.enabled=true", "--set", "prometheusRule.runnerRules=false"], False),
])
def test_prometheus_rule_runner_group(helm: str, henv: dict[str, str], args: list[str], runner_group: bool) -> None:
    objects = template(helm, "--set", "prometheusRule.enabled=true", *args, env=henv)
    groups = {g["name"]: g for g in one(objects, "PrometheusRule")["spec"]["groups"]}
    expected = {g["name"]: g for g in yaml.safe_load(RULES.read_text())["groups"]}
    if not runner_group:
        del expected["tokenmill-runner"]
    assert groups == expected


def test_dashboard_label_and_namespace_configurable(helm: str, henv: dict[str, str]) -> None:
    objects = template(helm, "--set", "dashboards.enabled=true", "--set", "dashboards.label=grafana_dash",
                       "--set-string", "dashboards.labelValue=yes", "--set", "dashboards.namespace=monitoring",
                       env=henv)
    (dashboard,) = [o for o in by_kind(objects, "ConfigMap") if "grafana_dash" in o["metadata"]["labels"]]
    assert dashboard["metadata"]["labels"]["grafana_dash"] == "yes"
    assert dashboard["metadata"]["namespace"] == "monitoring"


def test_argocd_sync_wave_on_every_templated_object(helm: str, henv: dict[str, str]) -> None:
    objects = template(helm, "-f", str(CHART / "ci" / "monitoring-values.yaml"), env=henv)
    for obj in objects:
        annotations = obj["metadata"].get("annotations") or {}
        assert annotations.get("argocd.argoproj.io/sync-wave") == "0", f"{obj['kind']} {obj['metadata']['name']}"
    objects = template(helm, "--set", "argocd.syncWave=", env=henv)
    for obj in objects:
        assert "argocd.argoproj.io/sync-wave" not in (obj["metadata"].get("annotations") or {})
    objects = template(helm, "--set-string", "argocd.syncWave=-1", env=henv)
    assert one(objects, "Deployment")["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"] == "-1"


def test_chart_metadata() -> None:
    chart = _chart()
    assert chart["apiVersion"] == "v2" and chart["name"] == "tokenmill" and chart["type"] == "application"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'version = "{chart["appVersion"]}"' in pyproject, "appVersion must be the project's version"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values) <= set(schema["properties"]), "every top-level value needs a schema entry"
    assert schema["additionalProperties"] is False
