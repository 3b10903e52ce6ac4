"""Reading the facts of one reconcile pass: the server and the runner Job from the API server, run.json and the
commit markers from storage. Nothing here changes anything."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from tokenmill_runner.ledger import COMMITS
from tokenmill_runner.storage import Storage

from . import names
from .facts import JobState, ProgressFacts, ServerState
from .kube import Kube
from .observe import parse_time, progress_facts
from .status import RunStatus

SERVER_PROBLEMS = ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError",
                   "InvalidImageName", "RunContainerError")
RUN_METADATA = "run.json"


def never() -> bool:
    return False


class PassCancelled(Exception):
    """The resource is being deleted (or the operator is stopping): the pass changes nothing more."""


@dataclass
class MarkerCache:
    """Commit markers never change once written: fetch each once per operator lifetime."""

    by_key: dict[str, dict[str, Any]] = field(default_factory=dict)

    def markers(self, storage: Storage, dataset: str, stopped: Callable[[], bool] = never) -> list[dict[str, Any]]:
        keys = [k for k in storage.list(f"{dataset}/{COMMITS}/") if k.endswith(".json")]
        for key in keys:
            if key not in self.by_key:
                if stopped():  # thousands of markers after a restart: stop between reads, not after all of them
                    raise PassCancelled
                self.by_key[key] = orjson.loads(storage.get(key))
        return [self.by_key[key] for key in keys]


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


def _job_run(job: dict[str, Any]) -> RunStatus | None:
    annotations = job["metadata"].get("annotations") or {}
    recorded = annotations.get(names.RUN_ANNOTATION)
    if not recorded:
        return None
    return RunStatus.model_validate({**orjson.loads(recorded),
                                     "jobHash": annotations.get(names.JOB_HASH_ANNOTATION, "")})


def job_state(job: dict[str, Any]) -> JobState:
    status = job.get("status") or {}
    conditions = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
    failed = conditions.get("Failed")
    return JobState(
        active=status.get("active") or 0, succeeded=status.get("succeeded") or 0, failed=status.get("failed") or 0,
        complete="Complete" in conditions,
        failed_message=(f"runner Job failed ({failed.get('reason')}): {failed.get('message', '')}"
                        if failed else None),
        suspended=bool(job["spec"].get("suspend")),
        hash=(job["metadata"].get("annotations") or {}).get(names.JOB_HASH_ANNOTATION),
        run=_job_run(job),
        deleting=bool(job["metadata"].get("deletionTimestamp")),
    )


def observe_job(kube: Kube, name: str, namespace: str) -> tuple[JobState | None, datetime | None]:
    job = kube.get("batch/v1", "Job", names.runner_name(name), namespace)
    if job is None:
        return None, None
    started = (job.get("status") or {}).get("startTime")
    return job_state(job), parse_time(started) if started else None


def observe_progress(storage: Storage, cache: MarkerCache, now: datetime, started: datetime | None,
                     stopped: Callable[[], bool] = never) -> tuple[ProgressFacts | None, dict[str, Any] | None]:
    """Progress from the markers, and run.json (None, None before the first runner wrote it)."""
    if not storage.exists(RUN_METADATA):
        return None, None
    run = orjson.loads(storage.get(RUN_METADATA))
    totals = {name: info["rows"] for name, info in run["datasets"].items()}
    markers = {name: cache.markers(storage, name, stopped) for name in totals}
    return progress_facts(markers, totals, now, started), run
