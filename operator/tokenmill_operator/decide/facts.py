"""What one reconcile pass observed and what it decided: plain data, no logic. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tokenmill_runner.facts.hidden_states import ServedKind
from tokenmill_runner.spec.resource import DatasetGenerationSpec
from tokenmill_runner.store.completion import Completion
from tokenmill_runner.store.manifest import Owner

from . import names
from .planner import ServerPlan
from .server_metrics import WindowFacts
from .status import (
    DatasetGenerationStatus,
    DatasetProgress,
    Progress,
    ReportStatus,
    RetryStatus,
    RunStatus,
    StatesPass,
)

if TYPE_CHECKING:  # a type only: the module that reads it does I/O, and this one is pure
    from tokenmill_runner.store.capture_progress import CaptureProgress


@dataclass(frozen=True)
class ServerState:
    desired: int
    ready: int
    problem_reason: str | None = None  # Unschedulable, ImagePullBackOff, CrashLoopBackOff, ...
    problem_message: str | None = None
    copy_seconds: int | None = None  # observed: the weights' copy into a server pod (or the shared cache)
    load_seconds: int | None = None  # observed: SGLang's start until the pod was Ready
    # The StatefulSet's controller has not caught up with its template, or still replaces pods of the old one: the
    # pods that are ready may be the previous flags' (a layout switch, the next hidden-state pass).
    rolling: bool = False

    @property
    def is_ready(self) -> bool:
        return self.desired > 0 and self.ready >= self.desired and not self.rolling


@dataclass(frozen=True)
class JobState:
    active: int = 0
    succeeded: int = 0
    failed: int = 0
    complete: bool = False
    failed_message: str | None = None  # the Job's Failed condition, when it has one
    suspended: bool = False
    hash: str | None = None  # what it was built from (None: made by an operator that did not record it)
    run: RunStatus | None = None  # what the run was started with, from the Job's annotation
    deleting: bool = False  # being deleted (replaced): its pods may still be stopping
    pod_problem: tuple[str, str] | None = None  # (reason, message) of a runner pod that cannot start

    @property
    def finished(self) -> bool:
        return self.complete or self.failed_message is not None


@dataclass(frozen=True)
class QueueState:
    """The run's Kueue Workload as this pass read it (kueue.queue_state)."""

    queue: str  # the LocalQueue
    workload: str
    exists: bool = False
    admitted: bool = False
    evicted: bool = False  # Kueue evicted it and it still holds quota until the run's pods are stopped
    finished: bool = False
    reshaped: bool = False  # its pod sets are not what the spec now needs
    # The run's queue label was changed or removed: its Workload is in a queue the run no longer names. Like an
    # eviction, the pods stop before the Workload goes, so Kueue never counts as free what the pods still hold.
    leaving: bool = False
    position: int | None = None  # place among the LocalQueue's waiting workloads
    cluster_queue: str | None = None
    message: str = ""
    pods_left: int = 0  # the run's pods that have not ended: they hold what Kueue counted


@dataclass(frozen=True)
class ProgressFacts:
    overall: Progress
    datasets: list[DatasetProgress]
    last_commit_time: datetime | None
    settled: bool = False  # every slot of the manifest's layout has a final outcome (ledger.completeness)
    missing: dict[str, str] = field(default_factory=dict)  # per unsettled dataset: which slots lack an outcome
    spec_hash: str | None = None  # the hash the manifest's writer recorded (its runner Job's)
    # The Job finished and the full listing of the markers begun since is still under way (a step a pass): no
    # decision that ends the run is made on these figures yet.
    listing_incomplete: bool = False

    def settled_by(self, job_hash: str | None) -> bool:
        """Settled, by the Job that ended: a manifest written for another Job (the ended one failed before its
        runner recorded its layout) describes earlier work, not this Job's."""
        return self.settled and job_hash is not None and self.spec_hash == job_hash


@dataclass(frozen=True)
class Observed:
    generation: int
    now: datetime
    suspended: bool
    previous: DatasetGenerationStatus
    name: str = ""
    plan: ServerPlan | None = None
    plan_error: str | None = None
    server: ServerState | None = None
    job: JobState | None = None
    job_started: datetime | None = None
    progress: ProgressFacts | None = None
    # The operator is counting the output's markers from the first (no checkpoint it trusts: gather.OutputIndex
    # .counting): there is no progress to go by yet, and the previous status's figures stand.
    counting: bool = False
    # The report's status from the previous status, or the one this pass just wrote: remembered, never read
    # from storage. Once there is one, the run has ended (unless it is reopened, see `reopen`).
    remembered_report: ReportStatus | None = None
    stall_after_s: float = 900.0
    start_deadline_s: float = 1800.0  # runner pods that cannot start for this long end the run
    server_start_deadline_s: float | None = None  # spec.server.startDeadlineSeconds (None: from the plan)
    desired_job_hash: str | None = None  # the hash a runner Job built from this spec would have
    wanted_run: RunStatus | None = None  # what a runner Job created now would start the run with
    retry: RetryDecision | None = None
    reopened: bool = False  # the ended run starts again (a retry, or a spec edit after samples were given up)
    planned_generation: int | None = None  # the generation `plan` was computed for (None: kept from before)
    foreign_output: str | None = None  # the output holds another model's run: why
    queue: QueueState | None = None  # set when the run waits behind a Kueue LocalQueue
    window: WindowFacts | None = None  # the plan's verification window so far (server_metrics.py)
    verify_window_s: float = 600.0  # spec.server.verifyWindowSeconds
    states_passes: tuple[ServedKind, ...] = ()  # the hidden-state passes the layouts need, when two (states_passes.py)
    states_pass: StatesPass | None = None  # the one in progress
    capture: CaptureProgress | None = None  # the runner's capture pass, while every sample is settled and it runs
    # What the run lacks (store/completion.py), read once its Job ended with every sample settled and the spec asks
    # for hidden states (None otherwise): whether the next pass may start.
    completion: Completion | None = None


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class RetryDecision:
    """What to do with the tokenmill.io/retry-failed annotation on this pass."""

    token: str  # the retry generation runner Jobs are built for ("" when none was ever accepted)
    status: RetryStatus | None  # the status to record (the previous one when nothing new was asked)
    event: Event | None = None
    accepted: bool = False  # a new request with something to retry: the run restarts with --retry-failed


@dataclass(frozen=True)
class Decision:
    status: DatasetGenerationStatus
    server_replicas: int | None  # 0 releases the GPUs; None leaves the server as it is
    delete_server: bool = False
    create_job: bool = False
    suspend_job: bool = False
    replace_job: bool = False  # delete the runner Job (its pods first); the next pass creates the new one
    write_report: bool = False
    events: list[Event] = field(default_factory=list)
    # The layout the operator switched to (replan auto, a trial) did not start within its budget: why, with the
    # figures. The pass leaves it (a trial drops the candidate; a replan goes back to the layout it came from).
    switch_not_started: str | None = None


@dataclass
class Context:
    """One DatasetGeneration as read at the start of the pass."""

    body: dict[str, Any]
    name: str
    namespace: str
    generation: int
    spec: DatasetGenerationSpec
    previous: DatasetGenerationStatus

    @property
    def owner(self) -> Owner:
        """Who owns the output: this resource, across its Jobs (a re-created one of the same name is another)."""
        return Owner(kind="DatasetGeneration", name=self.name, namespace=self.namespace,
                     uid=self.body["metadata"].get("uid"))

    @property
    def retry_request(self) -> str | None:
        return (self.body["metadata"].get("annotations") or {}).get(names.RETRY_ANNOTATION)


@dataclass(frozen=True)
class Queueing:
    """The run's Kueue Workload: as it should be, as it is, and what it says."""

    desired: dict[str, Any]
    current: dict[str, Any] | None
    state: QueueState


@dataclass(frozen=True)
class Facts:
    """What a pass read of the cluster: the runner Job, the server, the Kueue Workload, the shared cache."""

    job: JobState | None
    job_started: datetime | None
    server: ServerState | None
    queueing: Queueing | None = None
    cache_ready: bool = True  # the shared model cache is filled (or none is used)
