"""spec.model.cache on the real control plane: the claim and the one fill Job per model digest, no server pod
before the fill succeeded, a second resource serving the same model reusing the copy; node-local objects."""

from __future__ import annotations

import pytest
from kubernetes import client as k8s

from tokenmill_operator.decide import cache

from .conftest import HOLD_LABEL, Cluster
from .operator_kit import (  # noqa: F401  (fixtures)
    NAME,
    b5_resource,
    condition,
    crd,
    credentials,
    dsgen,
    operator,
    s3_world,
)

pytestmark = pytest.mark.e2e

SECOND = "b5-second"
FILL = "app.kubernetes.io/component=model-cache"


def cached(namespace: str, endpoint: str, name: str, cache: dict) -> dict:
    return b5_resource(namespace, endpoint, name, **{"model.cache": cache,
                                                     "output.uri": f"s3://tokenmill-data/runs/{namespace}/{name}/"})


def server_pods(cluster: Cluster, namespace: str, name: str) -> list:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=server"
    return cluster.core.list_namespaced_pod(namespace, label_selector=selector).items


def ready(pods: list) -> list:
    return [p for p in pods if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]


@pytest.fixture
def shared_class(cluster: Cluster, namespace: str):
    """A storage class name with one pre-made ReadWriteMany volume (the local cluster has no provisioner)."""
    name = f"{namespace}-shared"
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
                   "spec": {"storageClassName": name, "capacity": {"storage": "2Ti"},
                            "accessModes": ["ReadWriteMany"], "hostPath": {"path": f"/tmp/{name}"}}})
    yield name
    cluster.kubectl("delete", "pv", name, "--ignore-not-found", "--wait=false")


def test_shared_volume_is_filled_once_before_any_server_and_reused(cluster, namespace, operator, credentials,
                                                                    s3_world, shared_class):
    cluster.apply(cached(namespace, s3_world, NAME, {"mode": "sharedVolume", "storageClass": shared_class}))
    fill_pod = cluster.wait_for(lambda: [p for p in cluster.core.list_namespaced_pod(
        namespace, label_selector=FILL).items if p.status.phase == "Running"], "the fill pod running", timeout=90)[0]
    digest = fill_pod.metadata.labels["tokenmill.io/model-digest"]
    claim = cluster.core.read_namespaced_persistent_volume_claim(f"tokenmill-model-{digest}", namespace)
    assert claim.spec.storage_class_name == shared_class and claim.spec.access_modes == ["ReadWriteMany"]
    # Shared: owned by each resource serving the model, none its controller; it goes with the last of them.
    assert [(o.name, o.controller) for o in claim.metadata.owner_references] == [(NAME, False)]
    filling = cluster.wait_for(lambda: (lambda o: o if (condition(o, "ServerReady") or {}).get("reason")
                                        == "FillingModelCache" else None)(dsgen(cluster, namespace)),
                               "ServerReady FillingModelCache", timeout=60)
    assert f"tokenmill-model-{digest}" in condition(filling, "ServerReady")["message"]

    cluster.apply(cached(namespace, s3_world, SECOND, {"mode": "sharedVolume", "storageClass": shared_class}))
    cluster.wait_for(lambda: (lambda o: o if (condition(o, "ServerReady") or {}).get("reason")
                              == "FillingModelCache" else None)(dsgen(cluster, namespace, SECOND)),
                     "the second resource waiting for the same fill", timeout=60)
    assert server_pods(cluster, namespace, NAME) == [] and server_pods(cluster, namespace, SECOND) == []
    assert len(cluster.batch.list_namespaced_job(namespace, label_selector=FILL).items) == 1
    owners = lambda: sorted(o.name for o in cluster.core.read_namespaced_persistent_volume_claim(  # noqa: E731
        f"tokenmill-model-{digest}", namespace).metadata.owner_references)
    cluster.wait_for(lambda: owners() == sorted([NAME, SECOND]), "the second resource among the claim's owners",
                     timeout=60)
    job_owners = cluster.batch.read_namespaced_job(f"tokenmill-fill-{digest}", namespace).metadata.owner_references
    assert sorted(o.name for o in job_owners) == sorted([NAME, SECOND])

    cluster.core.patch_namespaced_pod(fill_pod.metadata.name, namespace, {"metadata": {"labels": {HOLD_LABEL: None}}})
    job = cluster.wait_for(lambda: (lambda j: j if j.status.completion_time else None)(
        cluster.batch.read_namespaced_job(f"tokenmill-fill-{digest}", namespace)), "the fill Job complete", timeout=60)
    for name in (NAME, SECOND):
        [pod] = cluster.wait_for(lambda name=name: ready(server_pods(cluster, namespace, name)), f"{name}'s server", timeout=90)
        assert pod.metadata.creation_timestamp >= job.status.completion_time  # never before the copy is whole
        [volume] = [v for v in pod.spec.volumes if v.name == "models"]
        assert volume.persistent_volume_claim.claim_name == f"tokenmill-model-{digest}"
        assert volume.persistent_volume_claim.read_only
        assert [c.name for c in pod.spec.init_containers] == ["verify-model-cache"]
        args = pod.spec.containers[0].args
        assert args[args.index("--model-path") + 1] == f"/models/{digest}/model"
    assert len(cluster.batch.list_namespaced_job(namespace, label_selector=FILL).items) == 1

    # The garbage collector: the claim stays while one resource serving the model is left, and goes with the last.
    claim_name = f"tokenmill-model-{digest}"
    custom = cluster.api(k8s.CustomObjectsApi)
    custom.delete_namespaced_custom_object("tokenmill.io", "v1alpha1", namespace, "datasetgenerations", NAME)
    cluster.wait_for(lambda: owners() == [SECOND], "the first resource gone from the claim's owners", timeout=90)
    custom.delete_namespaced_custom_object("tokenmill.io", "v1alpha1", namespace, "datasetgenerations", SECOND)

    def claim_gone() -> bool:
        try:
            claim = cluster.core.read_namespaced_persistent_volume_claim(claim_name, namespace)
        except k8s.exceptions.ApiException as error:
            return error.status == 404
        return claim.metadata.deletion_timestamp is not None  # pvc-protection holds it while a pod mounts it

    cluster.wait_for(claim_gone, "the claim deleted with its last owner", timeout=120)


def test_node_local_cache_fills_in_the_server_pod_under_the_lock(cluster, namespace, operator, credentials,
                                                                 s3_world):
    cluster.apply(cached(namespace, s3_world, NAME, {"mode": "nodeLocal"}))
    [pod] = cluster.wait_for(lambda: ready(server_pods(cluster, namespace, NAME)), "the server", timeout=90)
    [volume] = [v for v in pod.spec.volumes if v.name == "models"]
    # The operator's root (its TOKENMILL_NODE_CACHE_ROOT default), not a folder the resource chose.
    assert volume.host_path.path == "/mnt/nvme/tokenmill-models" and volume.host_path.type == "DirectoryOrCreate"
    [fill] = pod.spec.init_containers
    script = fill.command[2]
    assert fill.name == "fill-node-cache" and 'mkdir "$lock"' in script and "aws s3 sync" in script
    # The fill mounts only this namespace's folder of the root, as this namespace's own uid (security-f9665d2.md B1).
    assert [(m.mount_path, m.sub_path) for m in fill.volume_mounts] == [("/models", namespace)]
    assert fill.security_context.run_as_user == cache.namespace_uid(namespace) and not fill.env_from
    # SGLang (the tenant's image, as root) mounts only this namespace's copy of its own digest, read-only.
    [mount] = [m for m in pod.spec.containers[0].volume_mounts if m.name == "models"]
    assert mount.read_only and mount.sub_path.startswith(f"{namespace}/")
    args = pod.spec.containers[0].args
    assert args[args.index("--model-path") + 1] == "/models/model"
    assert cluster.core.list_namespaced_persistent_volume_claim(namespace).items == []
    assert cluster.batch.list_namespaced_job(namespace, label_selector=FILL).items == []


def test_a_resource_naming_its_own_node_folder_is_refused(cluster, namespace, operator, credentials, s3_world):
    cluster.apply(cached(namespace, s3_world, NAME, {"mode": "nodeLocal", "hostPath": "/var/lib/kubelet"}))
    refused = cluster.wait_for(lambda: (lambda o: o if (condition(o, "Ready") or {}).get("reason") == "NotAllowed"
                                        else None)(dsgen(cluster, namespace)), "Ready NotAllowed", timeout=60)
    assert "'/var/lib/kubelet'" in condition(refused, "Ready")["message"]
    assert server_pods(cluster, namespace, NAME) == []
