"""One reconcile pass for one DatasetGeneration: gather facts, `decide`, apply the decision.

Called by kopf on create/resume/spec change and by a timer. Every step is idempotent: child names are
deterministic, children are server-side applied (the runner Job and the API-key Secret are create-only), and
progress is read from the commit markers in storage, so an operator restarted anywhere picks up where it was.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from tokenmill_runner.ledger import COMMITS
from tokenmill_runner.report_files import REPORT_DIR, write_report
from tokenmill_runner.spec import DatasetGenerationSpec
from tokenmill_runner.storage import Storage, open_storage

from . import manifests, names
from .kube import Kube
from .lifecycle import Decision, JobState, Observed, ServerState, blocked, decide
from .model_files import make_plan
from .observe import parse_time, progress_facts
from .planner import PlanError, ServerPlan
from .status import DatasetGenerationStatus, ReportStatus

logger = logging.getLogger(__name__)

SERVER_PROBLEMS = ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError",
                   "InvalidImageName", "RunContainerError")


@dataclass(frozen=True)
class OperatorSettings:
    runner_image: str = os.environ.get("TOKENMILL_RUNNER_IMAGE", "ghcr.io/tokenmill/tokenmill-runner:0.1.0")
    stall_after_s: float = float(os.environ.get("TOKENMILL_STALL_SECONDS", "900"))
    # Extra labels on runner pods (JSON object); the e2e tests use it to hold Job pods running under kwok.
    runner_pod_labels: dict[str, str] = field(
        default_factory=lambda: orjson.loads(os.environ.get("TOKENMILL_RUNNER_POD_LABELS", "{}")))


@dataclass
class MarkerCache:
    """Commit markers never change once written: fetch each once per operator lifetime."""

    by_key: dict[str, dict[str, Any]] = field(default_factory=dict)

    def markers(self, storage: Storage, dataset: str) -> list[dict[str, Any]]:
        keys = [k for k in storage.list(f"{dataset}/{COMMITS}/") if k.endswith(".json")]
        for key in keys:
            if key not in self.by_key:
                self.by_key[key] = orjson.loads(storage.get(key))
        return [self.by_key[key] for key in keys]


def now_utc() -> datetime:
    return datetime.now(UTC)


def _credentials(kube: Kube, spec: DatasetGenerationSpec, namespace: str) -> dict[str, str] | None:
    secret = spec.output.credentials_secret
    return kube.secret_data(secret, namespace) if secret else None


def storage_for(uri: str, spec: DatasetGenerationSpec, credentials: dict[str, str] | None) -> Storage:
    return open_storage(uri, spec.output.endpoint, spec.output.region, credentials)


def observe_server(kube: Kube, name: str, namespace: str) -> ServerState | None:
    statefulset = kube.get("apps/v1", "StatefulSet", names.server_name(name), namespace)
    if statefulset is None:
        return None
    desired = statefulset["spec"].get("replicas") or 0
    ready = (statefulset.get("status") or {}).get("readyReplicas") or 0
    for pod in kube.list("v1", "Pod", namespace, names.selector_labels(name, names.SERVER_COMPONENT)):
        problem = pod_problem(pod)
        if problem:
            return ServerState(desired, ready, *problem)
    return ServerState(desired, ready)


def pod_problem(pod: dict[str, Any]) -> tuple[str, str] | None:
    """The scheduler's or the kubelet's reason a server pod cannot run, in its own words."""
    status = pod.get("status") or {}
    pod_name = pod["metadata"]["name"]
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return (condition.get("reason") or "Unschedulable",
                    f"pod {pod_name}: {condition.get('message') or 'cannot be scheduled'}")
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in SERVER_PROBLEMS:
            return waiting["reason"], f"pod {pod_name}: {waiting.get('message') or waiting['reason']}"
    return None


def observe_job(kube: Kube, name: str, namespace: str) -> tuple[JobState | None, datetime | None]:
    job = kube.get("batch/v1", "Job", names.runner_name(name), namespace)
    if job is None:
        return None, None
    status = job.get("status") or {}
    conditions = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
    failed = conditions.get("Failed")
    state = JobState(
        active=status.get("active") or 0, succeeded=status.get("succeeded") or 0, failed=status.get("failed") or 0,
        complete="Complete" in conditions,
        failed_message=(f"runner Job failed ({failed.get('reason')}): {failed.get('message', '')}"
                        if failed else None),
        suspended=bool(job["spec"].get("suspend")),
    )
    started = parse_time(status["startTime"]) if status.get("startTime") else None
    return state, started


def observe_progress(storage: Storage, cache: MarkerCache, now: datetime, started: datetime | None):
    if not storage.exists("run.json"):
        return None
    totals = {name: info["rows"] for name, info in orjson.loads(storage.get("run.json"))["datasets"].items()}
    markers = {name: cache.markers(storage, name) for name in totals}
    return progress_facts(markers, totals, now, started)


def write_report_status(storage: Storage) -> ReportStatus:
    """Write the report's files from what is committed, and say where they are and what they found."""
    report, _ = write_report(storage)
    findings = [f["message"] for f in report["findings"] if f["level"] != "pass"]
    return ReportStatus(uri=storage.uri(f"{REPORT_DIR}/report.json"), verdict=report["verdict"], findings=findings)


@dataclass
class Context:
    """One DatasetGeneration as kopf hands it over."""

    body: dict[str, Any]
    name: str
    namespace: str
    generation: int
    spec: DatasetGenerationSpec
    previous: DatasetGenerationStatus


def _plan(context: Context, credentials: dict[str, str] | None) -> tuple[ServerPlan | None, str | None]:
    previous = context.previous
    if previous.server_plan is not None and previous.observed_generation == context.generation:
        return previous.server_plan, None
    try:
        return make_plan(context.spec, credentials), None
    except (PlanError, LookupError, ValueError) as error:
        return None, str(error)
    except Exception as error:  # storage errors: say where it failed
        return None, f"cannot read the model files to plan the server: {error}"


def _ensure_children(kube: Kube, context: Context, plan: ServerPlan, settings: OperatorSettings,
                     server_replicas: int, create_job: bool) -> None:
    owner = manifests.owner_reference(context.body)
    name, namespace, spec = context.name, context.namespace, context.spec
    kube.create_if_absent(manifests.api_key_secret(name, namespace, owner, secrets.token_urlsafe(32)))
    kube.apply(manifests.server_service(name, namespace, owner, spec))
    kube.apply(manifests.network_policy(name, namespace, owner, spec))
    kube.apply(manifests.runner_configmap(name, namespace, owner, spec))
    kube.apply(manifests.server_statefulset(name, namespace, owner, spec, plan, server_replicas))
    if create_job:
        image = spec.runner.image or settings.runner_image
        job = manifests.runner_job(name, namespace, owner, spec, image,
                                   names.server_urls(name, namespace, spec.server.port, plan.replicas,
                                                     plan.nodes_per_replica))
        template_labels = job["spec"]["template"]["metadata"].setdefault("labels", {})
        template_labels.update(settings.runner_pod_labels)
        kube.create_if_absent(job)


def _apply(kube: Kube, context: Context, decision: Decision, plan: ServerPlan | None,
           settings: OperatorSettings, job: JobState | None) -> None:
    name, namespace = context.name, context.namespace
    if decision.delete_server:
        kube.delete("apps/v1", "StatefulSet", names.server_name(name), namespace)
    elif plan is not None and decision.server_replicas is not None:
        _ensure_children(kube, context, plan, settings, decision.server_replicas, decision.create_job)
    if job is not None and job.suspended != decision.suspend_job and not job.complete:
        kube.patch("batch/v1", "Job", names.runner_name(name), namespace, {"spec": {"suspend": decision.suspend_job}})


def reconcile(kube: Kube, context: Context, cache: MarkerCache, settings: OperatorSettings) -> Decision:
    spec, now = context.spec, now_utc()
    try:
        credentials = _credentials(kube, spec, context.namespace)
    except LookupError as error:
        observed = Observed(generation=context.generation, now=now, suspended=spec.suspend,
                            previous=context.previous)
        return blocked(observed, "MissingSecret",
                       f"{error}: create it with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (spec.output."
                       "credentialsSecret names it)")
    storage = storage_for(spec.output.uri, spec, credentials)
    plan, plan_error = _plan(context, credentials)
    job, started = observe_job(kube, context.name, context.namespace)
    observed = Observed(
        generation=context.generation, now=now, suspended=spec.suspend, previous=context.previous,
        plan=plan, plan_error=plan_error, server=observe_server(kube, context.name, context.namespace),
        job=job, job_started=started, remembered_report=context.previous.report,
        progress=observe_progress(storage, cache, now, started),
        stall_after_s=spec.runner.stall_seconds or settings.stall_after_s,
    )
    decision = decide(observed)
    if decision.write_report:
        observed = Observed(**{**observed.__dict__, "remembered_report": write_report_status(storage)})
        decision = decide(observed)
    _apply(kube, context, decision, plan, settings, job)
    return decision
