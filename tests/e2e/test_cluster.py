"""The local control plane itself: real scheduler, controllers, GC, CRD validation, tools.

These tests pin down the behaviour the operator's e2e tests rely on (see hack/cluster/README.md).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from pathlib import Path

import pytest
from kubernetes import client as k8s

from .conftest import CPU_NODES, GPU_NODES, H200_NODES, HOLD_LABEL, Cluster

pytestmark = pytest.mark.e2e

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def statefulset(name: str, *, gpus: int = 0, tolerate: bool = True, replicas: int = 1, **pod_spec) -> dict:
    container: dict = {"name": "main", "image": "registry.invalid/tokenmill/fake:0"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    spec: dict = {"containers": [container], **pod_spec}
    if tolerate:
        spec["tolerations"] = [GPU_TOLERATION]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name},
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


def pods_of(cluster: Cluster, namespace: str, selector: str) -> list[k8s.V1Pod]:
    return cluster.core.list_namespaced_pod(namespace, label_selector=selector).items


def condition(pod: k8s.V1Pod, type_: str) -> k8s.V1PodCondition | None:
    return next((c for c in (pod.status.conditions or []) if c.type == type_), None)


def is_ready(pod: k8s.V1Pod) -> bool:
    c = condition(pod, "Ready")
    return pod.status.phase == "Running" and c is not None and c.status == "True"


# ---------------------------------------------------------------------------------------------


def test_control_plane_versions_and_nodes(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    want = "v" + cluster.tools["KUBE_VERSION"]
    assert version["serverVersion"]["gitVersion"] == want  # version-stamped build
    assert version["clientVersion"]["gitVersion"] == want

    nodes = {n.metadata.name: n for n in cluster.core.list_node().items}
    assert set(GPU_NODES + CPU_NODES) <= set(nodes)
    for name in GPU_NODES + CPU_NODES:
        ready = next(c for c in nodes[name].status.conditions if c.type == "Ready")
        assert ready.status == "True", name
    for name in H200_NODES:
        n = nodes[name]
        assert n.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert n.metadata.labels["nvidia.com/gpu.memory"] == "143771"
        assert n.metadata.labels["nvidia.com/gpu.count"] == "8"
        assert n.status.allocatable["nvidia.com/gpu"] == "8"
        assert [(t.key, t.effect) for t in n.spec.taints] == [("nvidia.com/gpu", "NoSchedule")]
    h100 = nodes["gpu-h100-0"]
    assert h100.metadata.labels["nvidia.com/gpu.product"].startswith("NVIDIA-H100")
    assert h100.status.allocatable["nvidia.com/gpu"] == "8"
    for name in CPU_NODES:
        assert "nvidia.com/gpu" not in (nodes[name].status.allocatable or {})
        assert not nodes[name].spec.taints


def test_statefulset_with_8_gpus_schedules_on_a_gpu_node_and_becomes_ready(
    cluster: Cluster, namespace: str
) -> None:
    cluster.apply(statefulset("gpu8", gpus=8), namespace)
    sts = cluster.wait_for(
        lambda: (s := cluster.apps.read_namespaced_stateful_set("gpu8", namespace)).status.ready_replicas == 1
        and s,
        "StatefulSet gpu8 to be Ready",
    )
    assert sts.status.ready_replicas == 1
    (pod,) = pods_of(cluster, namespace, "app=gpu8")
    assert pod.spec.node_name in GPU_NODES
    assert is_ready(pod)


def test_statefulset_with_9_gpus_stays_pending_with_the_schedulers_reason(
    cluster: Cluster, namespace: str
) -> None:
    cluster.apply(statefulset("gpu9", gpus=9), namespace)

    def unschedulable() -> k8s.V1PodCondition | None:
        pods = pods_of(cluster, namespace, "app=gpu9")
        c = condition(pods[0], "PodScheduled") if pods else None
        return c if c is not None and c.status == "False" else None

    cond = cluster.wait_for(unschedulable, "gpu9-0 to be marked unschedulable")
    assert cond.reason == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in cond.message
    time.sleep(2)
    (pod,) = pods_of(cluster, namespace, "app=gpu9")
    assert pod.status.phase == "Pending" and not pod.spec.node_name
    events = cluster.core.list_namespaced_event(namespace, field_selector="involvedObject.name=gpu9-0").items
    assert any(e.reason == "FailedScheduling" for e in events)


def test_pods_without_the_toleration_do_not_land_on_gpu_nodes(cluster: Cluster, namespace: str) -> None:
    # Plain pods spread over the untainted CPU nodes only.
    cluster.apply(statefulset("plain", tolerate=False, replicas=4), namespace)
    cluster.wait_for(
        lambda: cluster.apps.read_namespaced_stateful_set("plain", namespace).status.ready_replicas == 4,
        "StatefulSet plain to have 4 Ready replicas",
        timeout=90,
    )
    assert {p.spec.node_name for p in pods_of(cluster, namespace, "app=plain")} <= set(CPU_NODES)

    # Asking for a GPU node explicitly without the toleration: the taint keeps it Pending.
    cluster.apply(
        statefulset(
            "notol",
            gpus=1,
            tolerate=False,
            nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H200"},
        ),
        namespace,
    )

    def unschedulable() -> k8s.V1PodCondition | None:
        pods = pods_of(cluster, namespace, "app=notol")
        c = condition(pods[0], "PodScheduled") if pods else None
        return c if c is not None and c.status == "False" else None

    cond = cluster.wait_for(unschedulable, "notol-0 to be marked unschedulable")
    # e.g. "0/5 nodes are available: 2 node(s) didn't match Pod's node affinity/selector,
    #       3 node(s) had untolerated taint(s). ..." (the message does not name the taint)
    assert cond.reason == "Unschedulable"
    assert f"{len(GPU_NODES)} node(s) had untolerated taint" in cond.message
    (pod,) = pods_of(cluster, namespace, "app=notol")
    assert not pod.spec.node_name


def test_indexed_job_completes_and_is_garbage_collected_with_its_owner(
    cluster: Cluster, namespace: str
) -> None:
    owner = cluster.core.create_namespaced_config_map(
        namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="owner"), data={"k": "v"})
    )
    cluster.apply(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": "idx",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
                ],
            },
            "spec": {
                "completionMode": "Indexed",
                "completions": 4,
                "parallelism": 2,
                "backoffLimit": 0,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "main", "image": "registry.invalid/tokenmill/fake:0"}],
                    }
                },
            },
        },
        namespace,
    )

    def complete() -> bool:
        job = cluster.batch.read_namespaced_job("idx", namespace)
        return any(c.type == "Complete" and c.status == "True" for c in (job.status.conditions or []))

    cluster.wait_for(complete, "Job idx to complete", timeout=90)
    job = cluster.batch.read_namespaced_job("idx", namespace)
    assert job.status.succeeded == 4
    pods = pods_of(cluster, namespace, "job-name=idx")
    indexes = {p.metadata.annotations["batch.kubernetes.io/job-completion-index"] for p in pods}
    assert indexes == {"0", "1", "2", "3"}
    assert all(p.status.phase == "Succeeded" for p in pods)

    # Garbage collection: deleting the owner deletes the Job and its pods.
    cluster.core.delete_namespaced_config_map("owner", namespace)

    def job_gone() -> bool:
        try:
            cluster.batch.read_namespaced_job("idx", namespace)
        except k8s.ApiException as exc:
            return exc.status == 404
        return False

    cluster.wait_for(job_gone, "the garbage collector to delete Job idx", timeout=90)
    cluster.wait_for(
        lambda: not pods_of(cluster, namespace, "job-name=idx"), "the Job's pods to be deleted", timeout=90
    )


def test_job_pods_labelled_hold_stay_running_until_released(cluster: Cluster, namespace: str) -> None:
    cluster.apply(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "held"},
            "spec": {
                "completions": 1,
                "backoffLimit": 0,
                "template": {
                    "metadata": {"labels": {HOLD_LABEL: "true"}},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "main", "image": "registry.invalid/tokenmill/fake:0"}],
                    },
                },
            },
        },
        namespace,
    )
    pods = cluster.wait_for(
        lambda: [p for p in pods_of(cluster, namespace, "job-name=held") if is_ready(p)],
        "the held Job pod to be Running and Ready",
    )
    time.sleep(3)
    (pod,) = pods_of(cluster, namespace, "job-name=held")
    assert pod.metadata.name == pods[0].metadata.name and is_ready(pod)
    job = cluster.batch.read_namespaced_job("held", namespace)
    assert job.status.active == 1 and not job.status.succeeded

    # Releasing the hold lets kwok complete the pod, and the Job completes.
    cluster.kubectl("label", "pod", pod.metadata.name, f"{HOLD_LABEL}-", "-n", namespace)
    cluster.wait_for(
        lambda: cluster.batch.read_namespaced_job("held", namespace).status.succeeded == 1,
        "the released Job to succeed",
    )


@pytest.fixture(scope="module")
def widget_crd(cluster: Cluster):
    """A throwaway CRD (random group, so concurrent runs on a shared cluster do not collide)."""
    group = f"w{secrets.token_hex(3)}.e2e.tokenmill.io"
    name = f"widgets.{group}"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": name},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Min", "type": "integer", "jsonPath": ".spec.minReplicas"},
                        {"name": "Max", "type": "integer", "jsonPath": ".spec.maxReplicas"},
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "description": "Desired state of the widget.",
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.minReplicas <= self.maxReplicas",
                                            "message": "minReplicas must not exceed maxReplicas",
                                        }
                                    ],
                                    "properties": {
                                        "minReplicas": {"type": "integer", "default": 1},
                                        "maxReplicas": {
                                            "type": "integer",
                                            "description": "Upper bound of the replica count.",
                                        },
                                    },
                                    "required": ["maxReplicas"],
                                },
                                "status": {
                                    "type": "object",
                                    "properties": {"phase": {"type": "string"}},
                                },
                            },
                        }
                    },
                }
            ],
        },
    }
    cluster.apply(crd)
    cluster.wait_established(name)
    yield group
    cluster.kubectl("delete", "crd", name, "--wait=false", check=False)


def widget(name: str, group: str, **spec) -> dict:
    return {"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}


def test_crd_cel_rule_rejects_a_bad_object_at_apply_time(
    cluster: Cluster, namespace: str, widget_crd: str
) -> None:
    bad = cluster.apply(widget("bad", widget_crd, minReplicas=5, maxReplicas=2), namespace, check=False)
    assert bad.returncode != 0
    assert "minReplicas must not exceed maxReplicas" in bad.stderr

    # Structural schema defaults and the CEL rule (with the default) on a good object.
    cluster.apply(widget("good", widget_crd, maxReplicas=3), namespace)
    good = cluster.get_json(f"widgets.{widget_crd}", "good", "-n", namespace)
    assert good["spec"] == {"minReplicas": 1, "maxReplicas": 3}
    assert good["metadata"]["generation"] == 1


def test_crd_status_subresource_printer_columns_and_explain(
    cluster: Cluster, namespace: str, widget_crd: str
) -> None:
    resource = f"widgets.{widget_crd}"
    cluster.apply(widget("w", widget_crd, maxReplicas=3), namespace)
    # /status updates do not bump metadata.generation; spec updates do.
    cluster.kubectl(
        "patch", resource, "w", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", '{"status": {"phase": "Ready"}}',
    )  # fmt: skip
    obj = cluster.get_json(resource, "w", "-n", namespace)
    assert obj["status"] == {"phase": "Ready"} and obj["metadata"]["generation"] == 1
    cluster.kubectl("patch", resource, "w", "-n", namespace, "--type=merge", "-p", '{"spec": {"maxReplicas": 4}}')
    assert cluster.get_json(resource, "w", "-n", namespace)["metadata"]["generation"] == 2

    table = cluster.kubectl("get", resource, "-n", namespace).stdout.split("\n")
    # (with additionalPrinterColumns, AGE only shows up if listed)
    assert table[0].split() == ["NAME", "MIN", "MAX", "PHASE"]
    assert table[1].split() == ["w", "1", "4", "Ready"]

    explain = cluster.kubectl("explain", f"{resource}.spec.maxReplicas").stdout
    assert "Upper bound of the replica count." in explain


def test_helm_and_promtool_run_from_the_cache(cluster: Cluster, tmp_path: Path) -> None:
    cache = Path(cluster.tools["TOKENMILL_CACHE"])
    helm, promtool = Path(cluster.tools["HELM_BIN"]), Path(cluster.tools["PROMTOOL_BIN"])
    assert cache in helm.parents and cache in promtool.parents

    out = subprocess.run([helm, "version", "--short"], check=True, capture_output=True, text=True).stdout
    assert out.startswith("v" + cluster.tools["HELM_VERSION"])
    env = {"HOME": str(tmp_path), "HELM_CACHE_HOME": str(tmp_path / "c"), "HELM_CONFIG_HOME": str(tmp_path / "f"),
           "HELM_DATA_HOME": str(tmp_path / "d"), "PATH": "/usr/bin:/bin"}  # fmt: skip
    subprocess.run([helm, "create", "demo"], cwd=tmp_path, env=env, check=True, capture_output=True)
    lint = subprocess.run([helm, "lint", "demo"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    rendered = subprocess.run(
        [helm, "template", "r1", "demo"], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    ).stdout
    assert "kind: Deployment" in rendered

    out = subprocess.run([promtool, "--version"], check=True, capture_output=True, text=True)
    assert f"promtool, version {cluster.tools['PROMETHEUS_VERSION']}" in out.stdout + out.stderr
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "groups:\n- name: g\n  rules:\n  - alert: PodsNotReady\n"
        "    expr: sum(kube_pod_status_ready{condition=\"false\"}) > 0\n    for: 5m\n"
    )
    check = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
