"""What the operator should do and report, decided from what it observed. Pure: no API calls, no clock.

`decide(observed)` maps the cluster and storage facts of one DatasetGeneration to the desired children (server
replicas, runner Job, report) and its new status. The kopf handlers only gather the facts and apply the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from tokenmill_runner.progress import format_duration

from .planner import ServerPlan
from .status import Condition, DatasetGenerationStatus, DatasetProgress, Progress, ReportStatus


@dataclass(frozen=True)
class ServerState:
    desired: int
    ready: int
    problem_reason: str | None = None  # Unschedulable, ImagePullBackOff, CrashLoopBackOff, ...
    problem_message: str | None = None

    @property
    def is_ready(self) -> bool:
        return self.desired > 0 and self.ready >= self.desired


@dataclass(frozen=True)
class JobState:
    active: int = 0
    succeeded: int = 0
    failed: int = 0
    complete: bool = False
    failed_message: str | None = None  # the Job's Failed condition, when it has one
    suspended: bool = False


@dataclass(frozen=True)
class ProgressFacts:
    overall: Progress
    datasets: list[DatasetProgress]
    last_commit_time: datetime | None

    @property
    def all_committed(self) -> bool:
        return self.overall.total > 0 and self.overall.completed + self.overall.failed >= self.overall.total


@dataclass(frozen=True)
class Observed:
    generation: int
    now: datetime
    suspended: bool
    previous: DatasetGenerationStatus
    plan: ServerPlan | None = None
    plan_error: str | None = None
    server: ServerState | None = None
    job: JobState | None = None
    job_started: datetime | None = None
    progress: ProgressFacts | None = None
    # The report's status from the previous status, or the one this pass just wrote: remembered, never read
    # from storage. Once there is one, the run is finished.
    remembered_report: ReportStatus | None = None
    stall_after_s: float = 900.0


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    status: DatasetGenerationStatus
    server_replicas: int | None  # 0 releases the GPUs; None leaves the server as it is
    delete_server: bool = False
    create_job: bool = False
    suspend_job: bool = False
    write_report: bool = False
    events: list[Event] = field(default_factory=list)


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def set_condition(conditions: list[Condition], type_: str, status: str, reason: str, message: str,
                  now: datetime, generation: int) -> list[Condition]:
    """Replace one condition; its lastTransitionTime moves only when its status changes."""
    previous = next((c for c in conditions if c.type == type_), None)
    changed = previous is None or previous.status != status
    condition = Condition(
        type=type_, status=status, reason=reason, message=message, observed_generation=generation,
        last_transition_time=_iso(now) if changed else previous.last_transition_time,
    )
    return [c for c in conditions if c.type != type_] + [condition]


def condition_status(conditions: list[Condition], type_: str) -> str | None:
    return next((c.status for c in conditions if c.type == type_), None)


class _Status:
    """Accumulates conditions for one decision."""

    def __init__(self, observed: Observed) -> None:
        self.observed = observed
        self.conditions = list(observed.previous.conditions)

    def set(self, type_: str, status: str, reason: str, message: str = "") -> None:
        self.conditions = set_condition(self.conditions, type_, status, reason, message, self.observed.now,
                                        self.observed.generation)


def _progress(observed: Observed) -> tuple[Progress, list[DatasetProgress]]:
    if observed.progress is None:
        return observed.previous.progress, observed.previous.datasets
    return observed.progress.overall, observed.progress.datasets


def _base_status(observed: Observed, status: _Status, phase: str, message: str) -> DatasetGenerationStatus:
    overall, datasets = _progress(observed)
    previous = observed.previous
    last_commit = observed.progress.last_commit_time if observed.progress else None
    terminal = phase in ("Succeeded", "Failed")
    return DatasetGenerationStatus(
        observed_generation=observed.generation, phase=phase, message=message, conditions=status.conditions,
        server_plan=observed.plan or previous.server_plan, progress=overall, datasets=datasets,
        report=observed.remembered_report or previous.report,
        start_time=previous.start_time or (_iso(observed.job_started) if observed.job_started else None),
        completion_time=previous.completion_time or (_iso(observed.now) if terminal else None),
        last_commit_time=_iso(last_commit) if last_commit else previous.last_commit_time,
    )


def _finished(observed: Observed, status: _Status) -> Decision:
    report = observed.remembered_report
    assert report is not None
    status.set("Succeeded", "True", "ReportWritten", f"report verdict {report.verdict}: {report.uri}")
    status.set("Failed", "False", "Succeeded")
    status.set("Progressing", "False", "Finished", "every sample is committed")
    status.set("Stalled", "False", "Finished")
    status.set("ServerReady", "False", "Released", "the server was removed to give the GPUs back")
    status.set("Ready", "True", "Succeeded", f"verdict {report.verdict}")
    events = [] if condition_status(observed.previous.conditions, "Succeeded") == "True" else [
        Event("Normal", "Succeeded", f"all samples committed; report verdict {report.verdict} at {report.uri}")]
    return Decision(_base_status(observed, status, "Succeeded", f"done: report verdict {report.verdict}"),
                    server_replicas=0, delete_server=True, events=events)


def _failed(observed: Observed, status: _Status, reason: str, message: str) -> Decision:
    status.set("Failed", "True", reason, message)
    status.set("Succeeded", "False", reason, message)
    status.set("Progressing", "False", reason, message)
    status.set("Ready", "False", reason, message)
    status.set("ServerReady", "False", "Released", "the server was removed to give the GPUs back")
    events = [] if condition_status(observed.previous.conditions, "Failed") == "True" else [
        Event("Warning", reason, message)]
    return Decision(_base_status(observed, status, "Failed", message), server_replicas=0, delete_server=True,
                    events=events)


def _suspended(observed: Observed, status: _Status) -> Decision:
    message = "suspended: server scaled to zero; resuming continues from what is committed"
    status.set("Progressing", "False", "Suspended", message)
    status.set("ServerReady", "False", "Suspended", "scaled to zero while suspended")
    status.set("Stalled", "False", "Suspended")
    status.set("Ready", "False", "Suspended", message)
    return Decision(_base_status(observed, status, "Suspended", message), server_replicas=0, suspend_job=True)


def _server_condition(observed: Observed, status: _Status) -> bool:
    server = observed.server
    if server is not None and server.is_ready:
        status.set("ServerReady", "True", "ServerReady", f"{server.ready}/{server.desired} server pods ready")
        return True
    if server is not None and server.problem_reason:
        status.set("ServerReady", "False", server.problem_reason, server.problem_message or "")
    else:
        ready = server.ready if server else 0
        desired = server.desired if server else 0
        status.set("ServerReady", "False", "Starting",
                   f"{ready}/{desired} server pods ready (loading weights can take many minutes)")
    return False


def _stalled(observed: Observed) -> tuple[bool, str]:
    started = observed.job_started
    last = observed.progress.last_commit_time if observed.progress else None
    reference = max((t for t in (started, last) if t is not None), default=None)
    if reference is None:
        return False, ""
    idle = (observed.now - reference).total_seconds()
    if idle < observed.stall_after_s:
        return False, ""
    since = "the last commit" if last is not None and reference == last else "the runner started"
    return True, (f"nothing committed for {format_duration(idle)} since {since} (window "
                  f"{format_duration(observed.stall_after_s)}): check the runner pods' logs and the server")


def _running(observed: Observed, status: _Status) -> Decision:
    plan = observed.plan or observed.previous.server_plan
    replicas = plan.replicas * plan.nodes_per_replica if plan else 0
    server_ready = _server_condition(observed, status)
    job = observed.job
    if job is None and not server_ready:
        status.set("Progressing", "True", "StartingServer", "waiting for the server before starting the runner")
        status.set("Stalled", "False", "StartingServer")
        status.set("Ready", "Unknown", "StartingServer", "")
        return Decision(_base_status(observed, status, "StartingServer", "starting the SGLang server"),
                        server_replicas=replicas)
    stalled, stall_message = _stalled(observed) if job is not None else (False, "")
    events: list[Event] = []
    if stalled:
        status.set("Stalled", "True", "NoCommits", stall_message)
        if condition_status(observed.previous.conditions, "Stalled") != "True":
            events.append(Event("Warning", "Stalled", stall_message))
    else:
        status.set("Stalled", "False", "Committing", "")
    overall, _ = _progress(observed)
    message = f"generating: {overall.display or 'starting'}, ETA {overall.eta or 'unknown'}"
    status.set("Progressing", "True", "Generating", message)
    status.set("Succeeded", "Unknown", "InProgress", "")
    status.set("Failed", "False", "InProgress", "")
    healthy = server_ready and not stalled
    status.set("Ready", "True" if healthy else "False", "Generating" if healthy else "Degraded",
               "" if healthy else (stall_message or "the server is not ready"))
    return Decision(_base_status(observed, status, "Generating", message), server_replicas=replicas,
                    create_job=job is None, events=events)


def blocked(observed: Observed, reason: str, message: str) -> Decision:
    """Something the user must fix before anything can be observed (e.g. the credentials Secret is missing).
    Nothing is changed in the cluster: a run in progress keeps its server and runners."""
    status = _Status(observed)
    status.set("Ready", "False", reason, message)
    previous = observed.previous
    already = any(c.type == "Ready" and c.reason == reason for c in previous.conditions)
    events = [] if already else [Event("Warning", reason, message)]
    return Decision(_base_status(observed, status, previous.phase, message), server_replicas=None, events=events)


def decide(observed: Observed) -> Decision:
    status = _Status(observed)
    if observed.remembered_report is not None:
        return _finished(observed, status)
    if observed.plan_error:
        return _failed(observed, status, "PlanFailed", observed.plan_error)
    if observed.job is not None and observed.job.failed_message:
        return _failed(observed, status, "RunnerFailed", observed.job.failed_message)
    if observed.suspended:
        return _suspended(observed, status)
    if observed.job is not None and observed.job.complete:
        if observed.progress is not None and observed.progress.all_committed:
            status.set("Progressing", "True", "Reporting", "writing the validation report")
            return Decision(_base_status(observed, status, "Reporting", "writing the validation report"),
                            server_replicas=0, write_report=True)
        overall = observed.progress.overall if observed.progress else Progress()
        missing = overall.total - overall.completed - overall.failed
        return _failed(observed, status, "SamplesMissing",
                       f"the runner Job completed but {missing} of {overall.total} samples are not committed; "
                       "check the runner logs, then delete the Job to run the missing samples again")
    return _running(observed, status)
