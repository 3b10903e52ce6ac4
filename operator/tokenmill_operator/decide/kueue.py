"""A run behind a Kueue LocalQueue: the Workload that stands for the whole run, and what its status says. Pure.

Kueue (v0.17) admits a StatefulSet through its pod-group integration (every pod gated until the group is admitted)
and a Job through its batch/job integration: two Workloads, admitted independently, so the server could hold its
GPUs while the runner waits for its quota, or the other way round. Instead the operator does what Kueue documents
for a job type managed by an external controller (`integrations.externalFrameworks`, registered by
pkg/controller/jobframework/setup.go:67): it creates ONE Workload with a pod set for the server pods and one for the
runner pods, owned by the DatasetGeneration, and creates no child pods until Kueue admits it, all or nothing. The
children carry no queue label, and Kueue treats pods and Jobs whose owner is an external framework as managed by
that owner (jobframework/integrationmanager.go:358 `IsOwnerManagedByKueueForObject`), so nothing is queued twice.

Eviction (preemption, a deactivated Workload) follows Kueue's own job reconciler (jobframework/reconciler.go:592):
the operator stops the server and the runner, and only then hands the quota back by clearing the admission
(`QuotaReserved` False, reason Pending), which puts the Workload back in its queue. The run resumes from what is
committed once it is admitted again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

from tokenmill_runner.spec.resource import DatasetGenerationSpec

from . import cache, manifests, names
from .facts import QueueState
from .planner import ServerPlan

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
WORKLOAD_API = "kueue.x-k8s.io/v1beta2"
WORKLOAD_KIND = "Workload"
SERVER_POD_SET = "server"
RUNNER_POD_SET = "runner"
SHAPE_ANNOTATION = "tokenmill.io/pod-sets-hash"
# The GroupVersionKind to list in Kueue's `integrations.externalFrameworks` (docs/cluster.md).
EXTERNAL_FRAMEWORK = "DatasetGeneration.v1alpha1.tokenmill.io"

Manifest = dict[str, Any]


def queue_name(labels: dict[str, str] | None) -> str | None:
    """The LocalQueue a DatasetGeneration asks for with Kueue's own label, or None (no queueing)."""
    value = (labels or {}).get(QUEUE_LABEL, "").strip()
    return value or None


def workload_name(name: str) -> str:
    return names.bounded(name, "run")


def _accounted(containers: list[Manifest]) -> list[Manifest]:
    # Names and resources only: an image change (a new default runner image with an operator upgrade) must not make
    # a running run's Workload look outdated, and Kueue counts no image.
    return [{"name": c["name"], "resources": c.get("resources", {})} for c in containers]


def pod_set(name: str, count: int, template: Manifest) -> Manifest:
    """A pod set: `count` pods like `template`, reduced to what Kueue reads to pick a flavor and count quota
    (containers' and init containers' resources, node selector, tolerations)."""
    spec = template["spec"]
    reduced: Manifest = {"containers": _accounted(spec["containers"])}
    if spec.get("initContainers"):
        reduced["initContainers"] = _accounted(spec["initContainers"])
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        if spec.get(key):
            reduced[key] = spec[key]
    return {"name": name, "count": count, "template": {"spec": reduced}}


def _shape_hash(pod_sets: list[Manifest]) -> str:
    return hashlib.sha256(json.dumps(pod_sets, sort_keys=True).encode()).hexdigest()[:16]


def workload(name: str, namespace: str, owner: dict[str, Any], queue: str, pod_sets: list[Manifest]) -> Manifest:
    """The Workload of the whole run. Its pod sets are fixed once Kueue reserved quota for them, so it records
    their hash: a spec edit that changes what the run needs makes a new Workload (the run queues again)."""
    return {
        "apiVersion": WORKLOAD_API,
        "kind": WORKLOAD_KIND,
        "metadata": {
            "name": workload_name(name),
            "namespace": namespace,
            "labels": names.labels(name, "workload"),
            "annotations": {SHAPE_ANNOTATION: _shape_hash(pod_sets)},
            "ownerReferences": [dict(owner)],
        },
        "spec": {"queueName": queue, "podSets": pod_sets},
    }


def run_workload(name: str, namespace: str, owner: dict[str, Any], queue: str, spec: DatasetGenerationSpec,
                 plan: ServerPlan, runner_image: str, node_root: str = cache.DEFAULT_NODE_ROOT) -> Manifest:
    """The Workload of this run: its server pods and its runner pods, as the operator will create them."""
    server = manifests.server_statefulset(name, namespace, owner, spec, plan, node_root=node_root)
    urls = names.server_urls(name, namespace, spec.server.port, plan.replicas, plan.nodes_per_replica)
    runner = manifests.runner_job(name, namespace, owner, spec, runner_image, urls)
    return workload(name, namespace, owner, queue, [
        pod_set(SERVER_POD_SET, server["spec"]["replicas"], server["spec"]["template"]),
        pod_set(RUNNER_POD_SET, runner["spec"]["parallelism"], runner["spec"]["template"]),
    ])


# ------------------------------------------------------------------------------------------ reading its status


def _condition(obj: Manifest, type_: str) -> Manifest | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == type_), None)


def _true(obj: Manifest, type_: str) -> bool:
    condition = _condition(obj, type_)
    return condition is not None and condition.get("status") == "True"


def _waiting(obj: Manifest, queue: str) -> bool:
    return (obj.get("spec", {}).get("queueName") == queue and not _true(obj, "QuotaReserved")
            and not _true(obj, "Finished") and not obj.get("metadata", {}).get("deletionTimestamp"))


def _queue_order(obj: Manifest) -> tuple[int, str, str]:
    # Kueue's queue order: priority first, then the queue-order timestamp, which is the creation time unless an
    # admission check or a PodsReady timeout evicted it (pkg/cache/queue/cluster_queue.go:778,
    # pkg/workload/workload.go:1256-1274). Neither applies to a run the operator evicts itself.
    meta = obj.get("metadata", {})
    return -int(obj.get("spec", {}).get("priority") or 0), meta.get("creationTimestamp") or "", meta.get("name", "")


def position(mine: Manifest, queued: list[Manifest], queue: str) -> int | None:
    """1-based place of `mine` among the LocalQueue's workloads waiting for quota, or None when it is not waiting."""
    if not _waiting(mine, queue):
        return None
    order = sorted((w for w in queued if _waiting(w, queue)), key=_queue_order)
    names_in_order = [w["metadata"]["name"] for w in order]
    name = mine["metadata"]["name"]
    return names_in_order.index(name) + 1 if name in names_in_order else len(names_in_order) + 1


def queue_state(queue: str, desired: Manifest, current: Manifest | None, queued: list[Manifest]) -> QueueState:
    """What the Workload says about the run: admitted, waiting (where), or evicted and still holding quota."""
    name = desired["metadata"]["name"]
    if current is None:
        return QueueState(queue=queue, workload=name, exists=False, message=f"submitting Workload {name} to "
                                                                           f"LocalQueue {queue}")
    reshaped = ((current.get("metadata", {}).get("annotations") or {}).get(SHAPE_ANNOTATION)
                != desired["metadata"]["annotations"][SHAPE_ANNOTATION])
    cluster_queue = ((current.get("status") or {}).get("admission") or {}).get("clusterQueue")
    evicted = _condition(current, "Evicted") if _true(current, "Evicted") else None
    reserved = _true(current, "QuotaReserved")
    common = {"queue": queue, "workload": name, "exists": True, "reshaped": reshaped, "cluster_queue": cluster_queue,
              "finished": _true(current, "Finished")}
    queued_in = (current.get("spec") or {}).get("queueName")
    if queued_in != queue:
        return QueueState(**common, leaving=True,
                          message=f"the {QUEUE_LABEL} label moved the run from LocalQueue {queued_in} to {queue}: "
                                  f"stopping the server and the runner, then Workload {name} is replaced and the run "
                                  f"queues in {queue}; it resumes from what is committed")
    if reshaped:
        return QueueState(**common, message=f"what the run needs changed (a spec edit, or the operator's switch to "
                                            f"another layout): Workload {name} is replaced once the run's pods are "
                                            "stopped, and the run queues again; it resumes from what is committed")
    if evicted is not None and reserved:
        reason = evicted.get("reason", "Evicted")
        return QueueState(**common, evicted=True,
                          message=f"evicted by Kueue ({reason}: {evicted.get('message', '')}); stopping the server "
                                  "and the runner, then queueing again; the run resumes from what is committed")
    if _true(current, "Admitted") and evicted is None:
        return QueueState(**common, admitted=True, message=f"admitted by ClusterQueue {cluster_queue} "
                                                           f"(LocalQueue {queue})")
    place = position(current, queued, queue)
    pending = _condition(current, "QuotaReserved") or {}
    why = pending.get("message") or "waiting for quota"
    where = f" at position {place}" if place is not None else ""
    return QueueState(**common, position=place,
                      message=f"queued in LocalQueue {queue}{where}: {why}; nothing holds a GPU while it waits")


def left(state: QueueState) -> QueueState:
    """The Workload of a run whose queue label was removed: given back like an evicted one, once the pods stopped."""
    return replace(state, leaving=True, admitted=False, evicted=False, position=None,
                   message=f"the {QUEUE_LABEL} label was removed: stopping the server and the runner, then Workload "
                           f"{state.workload} leaves LocalQueue {state.queue} and hands its quota back")


def release_patch(current: Manifest, now: str) -> Manifest:
    """The status patch that hands an evicted Workload's quota back once the run's pods are stopped (what Kueue's
    job reconciler does for its own integrations: `UnsetQuotaReservationWithCondition(wl, "Pending", ...)`)."""
    kept = [c for c in (current.get("status") or {}).get("conditions") or []
            if c.get("type") not in ("QuotaReserved", "Admitted")]
    message = (_condition(current, "Evicted") or {}).get("message", "evicted")
    generation = current.get("metadata", {}).get("generation", 0)
    unset = [{"type": type_, "status": "False", "reason": reason, "message": message, "lastTransitionTime": now,
              "observedGeneration": generation}
             for type_, reason in (("QuotaReserved", "Pending"), ("Admitted", "NoReservation"))]
    return {"admission": None, "conditions": kept + unset}
