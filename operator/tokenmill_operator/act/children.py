"""The pass's decision applied to the cluster: the children (server StatefulSet, Service, NetworkPolicies, API-key
Secret, runner ConfigMap and Job), the shared model cache's claim and fill Job, the runner Job replaced or
suspended, the Kueue Workload kept in step, and a deleted resource's GPUs given back. Every write is idempotent:
child names are deterministic, children are server-side applied, the Job and the Secret are create-only."""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

from tokenmill_runner.facts.hidden_states import ServedKind

from ..decide import cache, kueue, manifests, names, trialling
from ..decide.facts import Context, Decision, Facts, JobState, Queueing
from ..decide.planner import ServerPlan
from ..decide.settings import OperatorSettings
from ..faults import crash_point
from ..kube import Kube


def share(kube: Kube, manifest: dict[str, Any], owner: dict[str, Any]) -> None:
    """Create `manifest` owned by this resource, or add this resource to the owners of the one that exists. The
    garbage collector deletes an object once all its owners are gone, so a shared claim and its fill Job stay while
    any resource serving the model exists and go with the last one (security-a87e82b.md W8: they were never
    deleted). The Job goes with the claim: a completed fill Job is what says the claim is filled."""
    meta = manifest["metadata"]
    meta["ownerReferences"] = [owner]
    if kube.create_if_absent(manifest):
        return
    current = kube.get(manifest["apiVersion"], manifest["kind"], meta["name"], meta["namespace"])
    refs = list(((current or {}).get("metadata") or {}).get("ownerReferences") or [])
    if current is not None and all(ref.get("uid") != owner["uid"] for ref in refs):
        kube.patch(manifest["apiVersion"], manifest["kind"], meta["name"], meta["namespace"],
                   {"metadata": {"ownerReferences": [*refs, owner]}})


def ensure_shared_cache(kube: Kube, context: Context, plan: ServerPlan, settings: OperatorSettings) -> None:
    """The claim and the fill Job of the model's digest, made by the first resource that needs them (create-only:
    another resource serving the model finds them, reuses the copy and becomes one of their owners)."""
    spec, namespace = context.spec, context.namespace
    assert spec.model.cache is not None
    digest = cache.model_digest(spec, plan.weight_bytes)
    # Not the controller: several resources own them alike, and deleting one must not wait on them.
    owner = {**manifests.owner_reference(context.body), "controller": False, "blockOwnerDeletion": False}
    share(kube, cache.shared_claim(namespace, spec.model.cache, digest, plan.weight_bytes), owner)
    job = cache.fill_job(namespace, spec, digest)
    job["spec"]["template"]["metadata"]["labels"].update(settings.runner_pod_labels)
    share(kube, job, owner)


def ensure_children(kube: Kube, context: Context, plan: ServerPlan, settings: OperatorSettings,
                     server_replicas: int, create_job: bool, retry_token: str, layout: str,
                     states_pass: ServedKind | None, trial_sample: str) -> None:
    owner = manifests.owner_reference(context.body)
    name, namespace, spec = context.name, context.namespace, context.spec
    kube.create_if_absent(manifests.api_key_secret(name, namespace, owner, secrets.token_urlsafe(32)))
    kube.apply(manifests.server_service(name, namespace, owner, spec))
    kube.apply(manifests.network_policy(name, namespace, owner, spec, settings.scraper_namespace,
                                        settings.operator_namespace))
    kube.apply(manifests.runner_network_policy(name, namespace, owner, settings.scraper_namespace))
    kube.apply(manifests.server_statefulset(name, namespace, owner, spec, plan, server_replicas,
                                            settings.node_cache_root, states_pass or "aux"))
    crash_point("server-applied")
    if not create_job:
        return
    # The ConfigMap changes only together with a new Job: the pods of a running Job never read another spec.
    kube.apply(manifests.runner_configmap(name, namespace, owner, spec))
    image = spec.runner.image or settings.runner_image
    urls = names.server_urls(name, namespace, spec.server.port, plan.replicas, plan.nodes_per_replica)
    job = manifests.runner_job(name, namespace, owner, spec, image, urls, retry_token, layout, states_pass or "",
                               trial_sample)
    job["spec"]["template"]["metadata"].setdefault("labels", {}).update(settings.runner_pod_labels)
    kube.create_if_absent(job)
    crash_point("job-created")


def replace_job(kube: Kube, context: Context, job: JobState) -> None:
    """Stop and delete the runner Job. Foreground deletion keeps the Job until its pods are gone, and the next Job
    is created only once the old one is: never two live workers for one index."""
    name = names.runner_name(context.name)
    if not job.finished and not job.suspended:
        kube.patch("batch/v1", "Job", name, context.namespace, {"spec": {"suspend": True}})
    kube.delete("batch/v1", "Job", name, context.namespace, propagation="Foreground")
    crash_point("job-replaced")


def apply_decision(kube: Kube, context: Context, decision: Decision, plan: ServerPlan | None,
           settings: OperatorSettings, facts: Facts, retry_token: str) -> None:
    name, namespace, job = context.name, context.namespace, facts.job
    if decision.replace_job and job is not None:
        replace_job(kube, context, job)
    if decision.delete_server:
        kube.delete("apps/v1", "StatefulSet", names.server_name(name), namespace)
    elif plan is not None and decision.server_replicas is not None:
        # The shared cache is filled while the run starts or waits in its Kueue queue (the fill holds no GPU and
        # no quota), never while it is suspended; no server pod exists before it is filled.
        if not facts.cache_ready and decision.status.phase in ("Queued", "StartingServer", "Generating"):
            ensure_shared_cache(kube, context, plan, settings)
        override = decision.status.layout_override  # the plan's, kept while it is this generation's
        states = decision.status.states_pass
        ensure_children(kube, context, plan, settings, decision.server_replicas if facts.cache_ready else 0,
                         decision.create_job, retry_token, override.token if override is not None else "",
                         states.kind if states is not None else None, trialling.sample_token(decision.status.trial))
    if job is None or decision.replace_job or job.finished or job.deleting:
        return
    if job.suspended != decision.suspend_job:
        kube.patch("batch/v1", "Job", names.runner_name(name), namespace, {"spec": {"suspend": decision.suspend_job}})
        if decision.suspend_job:
            crash_point("suspended")


def apply_queueing(kube: Kube, context: Context, decision: Decision, queueing: Queueing | None,
                    now: datetime) -> None:
    """Keep the run's Workload in step with the decision. Kueue's quota is handed back only once the run's pods
    are gone (as Kueue's own job integrations do): a run that ended or was suspended deletes its Workload (and
    leaves the queue), an outdated one or one whose queue label changed or was removed is deleted (and made anew in
    the new queue, if any), an evicted one has its admission cleared and queues again."""
    workload = kueue.workload_name(context.name)
    if queueing is None:
        return
    state = queueing.state
    leaving = (decision.status.phase in ("Succeeded", "Failed", "Suspended") or state.finished or state.reshaped
               or state.leaving)
    if not state.exists:
        if not leaving:
            kube.create_if_absent(queueing.desired)
    elif state.pods_left:
        return
    elif leaving:
        kube.delete(kueue.WORKLOAD_API, kueue.WORKLOAD_KIND, workload, context.namespace)
    elif state.evicted and queueing.current is not None:
        kube.patch_status(kueue.WORKLOAD_API, kueue.WORKLOAD_KIND, workload, context.namespace,
                          kueue.release_patch(queueing.current, now.isoformat().replace("+00:00", "Z")))


def release(kube: Kube, name: str, namespace: str) -> None:
    """A deleted resource's server and runner Job, deleted now: the GPUs are given back before kopf drops the
    finalizer (garbage collection would wait for it)."""
    kube.delete("apps/v1", "StatefulSet", names.server_name(name), namespace)
    kube.delete("batch/v1", "Job", names.runner_name(name), namespace)
