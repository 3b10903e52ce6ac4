"""What the operator should do and report, decided from what it observed. Pure: no API calls, no clock.

`decide(observed)` maps the cluster and storage facts of one DatasetGeneration to the desired children (server
replicas, runner Job, report) and its new status. The kopf handlers only gather the facts and apply the result.
Everything is level-based: a failure that the user repairs (the Job deleted, the spec fixed) is left on the next
pass, because the facts that caused it are gone.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from datetime import datetime

from tokenmill_runner.facts.hidden_states import ServedKind
from tokenmill_runner.progress import format_duration

from . import names
from .facts import Decision, Event, JobState, Observed, ProgressFacts, QueueState, RetryDecision, ServerState
from .planner import ServerPlan
from .planner.verify import TOLERANCE, PredictedStep, Verification, layout_name, running_layout, verify
from .planner.verify import Decision as Replan
from .states_passes import next_pass
from .status import (
    Condition,
    DatasetGenerationStatus,
    DatasetProgress,
    LayoutOverride,
    Progress,
    QueueStatus,
    ReportStatus,
    RetryStatus,
    RunStatus,
    StartupStatus,
    TrialStatus,
    VerificationStatus,
)
from .trialling import sample_token

__all__ = ["Decision", "Event", "JobState", "Observed", "ProgressFacts", "RetryDecision", "ServerState", "blocked",
           "cannot_observe", "decide", "identity_change", "plan_retry", "reopen", "set_condition"]


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def set_condition(conditions: list[Condition], type_: str, status: str, reason: str, message: str,
                  now: datetime, generation: int) -> list[Condition]:
    """Replace one condition; its lastTransitionTime moves only when its status changes."""
    previous = next((c for c in conditions if c.type == type_), None)
    changed = previous is None or previous.status != status
    condition = Condition(
        type=type_, status=status, reason=reason, message=message, observed_generation=generation,
        last_transition_time=_iso(now) if previous is None or changed else previous.last_transition_time,
    )
    return [c for c in conditions if c.type != type_] + [condition]


def condition_status(conditions: list[Condition], type_: str) -> str | None:
    return next((c.status for c in conditions if c.type == type_), None)


def condition_reason(conditions: list[Condition], type_: str) -> str | None:
    return next((c.reason for c in conditions if c.type == type_ and c.status == "True"), None)


# ------------------------------------------------------------------------------------- retries and reopening


MAX_RETRY_VALUE = 253


def retry_value(request: str) -> str:
    """The annotation value as status keeps it: long values (annotations allow far more) by their hash."""
    if len(request) <= MAX_RETRY_VALUE:
        return request
    return "sha256:" + hashlib.sha256(request.encode()).hexdigest()


def plan_retry(request: str | None, previous: RetryStatus | None, given_up: int, now: datetime) -> RetryDecision:
    """A tokenmill.io/retry-failed value not handled before asks for one retry of what was given up: `given_up`
    counts what a retry runs again (store/completion.Completion.retryable: given-up samples, and hidden-state
    captures that failed or are missing)."""
    token = previous.token if previous else ""
    if not request:
        return RetryDecision(token=token, status=previous)
    request = retry_value(request)
    if previous is not None and previous.handled == request:
        return RetryDecision(token=token, status=previous)
    if given_up == 0:
        outcome = "nothing was given up: nothing to retry"
        return RetryDecision(token=token, status=RetryStatus(handled=request, at=_iso(now), outcome=outcome,
                                                             token=token),
                             event=Event("Normal", "RetryNotNeeded", f"{names.RETRY_ANNOTATION}={request}: {outcome}"))
    outcome = (f"restarted the runner with --retry-failed for {given_up} given-up samples (or their missing or "
               "failed hidden-state captures)")
    return RetryDecision(token=request, status=RetryStatus(handled=request, at=_iso(now), outcome=outcome,
                                                           token=request),
                         event=Event("Normal", "RetryRequested", f"{names.RETRY_ANNOTATION}={request}: {outcome}"),
                         accepted=True)


def reopen(previous: DatasetGenerationStatus, retry: RetryDecision, desired_job_hash: str | None,
           ended_job_hash: str | None, would_generate: bool = True) -> bool:
    """Whether a run that ended with a report (Succeeded, or SamplesGivenUp) starts again: a retry was accepted, or
    the spec changed what its runner Job would be and that Job would generate something (runner.retryFailed set
    after giving up, more samples, a higher limit, a new dataset). Succeeded means every slot of the spec is
    settled, so a spec that asks for more is not Succeeded any more. An edit that changes nothing to generate (a
    validation threshold, a sampling setting) does not bring the server back for a Job that would skip every slot."""
    if previous.report is None:
        return False
    if retry.accepted:
        return True
    changed = desired_job_hash is not None and ended_job_hash not in (None, desired_job_hash)
    return changed and would_generate


def identity_change(started: RunStatus | None, wanted: RunStatus) -> str | None:
    """Why this spec may not drive the run that was started, or None. The CRD refuses these edits; this catches an
    edit made where its rules did not run (an older CRD, a webhook-less apply)."""
    if started is None:
        return None
    fields = (("spec.model.path", started.model_path, wanted.model_path),
              ("the tokenizer (spec.model.tokenizer)", started.tokenizer, wanted.tokenizer),
              ("spec.output.uri", started.output_uri, wanted.output_uri))
    changed = [f"{what} changed from {old!r} to {new!r}" for what, old, new in fields if old != new]
    if not changed:
        return None
    return ("; ".join(changed) + " after the run started: the runner would mix two runs' outputs. Change it back, "
            "or create a new DatasetGeneration (with its own output.uri) for the new run; nothing was changed")


# --------------------------------------------------------------------------------------------------- status


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


def _run_status(observed: Observed) -> RunStatus | None:
    job = observed.job
    if job is None:
        return observed.previous.run
    if job.run is not None:
        return job.run
    # A Job made by an operator that did not annotate it: the run has started all the same, with this spec.
    if observed.previous.run is None and observed.wanted_run is not None:
        return observed.wanted_run.model_copy(update={"job_hash": job.hash or ""})
    return observed.previous.run


def _queue_status(queue: QueueState | None) -> QueueStatus | None:
    if queue is None:
        return None
    return QueueStatus(name=queue.queue, workload=queue.workload, admitted=queue.admitted, position=queue.position,
                       cluster_queue=queue.cluster_queue, message=queue.message)


def _startup_status(observed: Observed) -> StartupStatus | None:
    plan = observed.plan or observed.previous.server_plan
    before = observed.previous.startup or StartupStatus()
    server = observed.server
    copy = server.copy_seconds if server and server.copy_seconds is not None else before.observed_copy_seconds
    load = server.load_seconds if server and server.load_seconds is not None else before.observed_load_seconds
    predicted = plan.startup if plan else None
    if predicted is None and copy is None and load is None:
        return None
    return StartupStatus(predicted_copy_seconds=predicted.copy_seconds if predicted else None,
                         predicted_load_seconds=predicted.load_seconds if predicted else None,
                         observed_copy_seconds=copy, observed_load_seconds=load)


def _base_status(observed: Observed, status: _Status, phase: str, message: str) -> DatasetGenerationStatus:
    overall, datasets = _progress(observed)
    previous = observed.previous
    last_commit = observed.progress.last_commit_time if observed.progress else None
    terminal = phase in ("Succeeded", "Failed")
    return DatasetGenerationStatus(
        observed_generation=observed.generation, phase=phase, message=message, conditions=status.conditions,
        server_plan=observed.plan or previous.server_plan, progress=overall, datasets=datasets,
        report=observed.remembered_report or (None if observed.reopened else previous.report),
        start_time=previous.start_time or (_iso(observed.job_started) if observed.job_started else None),
        completion_time=(previous.completion_time or _iso(observed.now)) if terminal else None,
        last_commit_time=_iso(last_commit) if last_commit else previous.last_commit_time,
        run=_run_status(observed),
        retry=observed.retry.status if observed.retry else previous.retry,
        # A run that ended or was suspended gives its Workload up once its pods are gone; until then it is shown.
        queue=_queue_status(observed.queue) if observed.queue and (
            observed.queue.exists or not (terminal or phase == "Suspended")) else None,
        startup=_startup_status(observed),
        planned_generation=observed.planned_generation or previous.planned_generation,
        verification=previous.verification,
        layout_override=_kept_override(observed),
        trial=_kept_trial(observed),
        states_pass=observed.states_pass,
    )


def kept_override(previous: DatasetGenerationStatus, planned_generation: int | None) -> LayoutOverride | None:
    """The operator's layout stays while serverPlan is the plan it was made for (its planned generation; None: the
    previous plan is kept): a new generation's plan is made from the spec again, which is how a user's edit takes
    the layout back."""
    override = previous.layout_override
    planned = planned_generation or previous.planned_generation
    return override if override is not None and override.generation == planned else None


def layout_token(previous: DatasetGenerationStatus, planned_generation: int | None) -> str:
    """The runner Job's share of the operator's layout switch (manifests.runner_job_hash): the kept override's
    token, else empty."""
    override = kept_override(previous, planned_generation)
    return override.token if override is not None else ""


def trial_sample_token(previous: DatasetGenerationStatus, planned_generation: int | None) -> str:
    """The runner Job's share of the measured trial: the --trial-sample of the kept trial's candidate (its JSON),
    else empty."""
    return sample_token(kept_trial(previous, planned_generation))


def verification_key(previous: DatasetGenerationStatus, planned_generation: int | None) -> tuple[int, str]:
    """What a verification checks: the planned generation, and the layout the operator switched it to (its token;
    empty for the spec's plan). A switch is a plan of its own, checked in its own window."""
    return planned_generation or previous.planned_generation, layout_token(previous, planned_generation)


def kept_trial(previous: DatasetGenerationStatus, planned_generation: int | None) -> TrialStatus | None:
    """The trial stays with the plan it was made for, like the layout it switched to."""
    trial = previous.trial
    planned = planned_generation or previous.planned_generation
    return trial if trial is not None and trial.generation == planned else None


def _kept_trial(observed: Observed) -> TrialStatus | None:
    return kept_trial(observed.previous, observed.planned_generation)


def _kept_override(observed: Observed) -> LayoutOverride | None:
    return kept_override(observed.previous, observed.planned_generation)


def _retry_hint(observed: Observed) -> str:
    return (f"kubectl annotate dsgen {observed.name or 'NAME'} {names.RETRY_ANNOTATION}=\"$(date +%s)\" --overwrite "
            "(or set spec.runner.retryFailed: true)")


def _given_up_message(observed: Observed, overall: Progress, report: ReportStatus) -> str:
    reasons = ", ".join(f"{reason} {count}" for reason, count in overall.failed_by_reason.items())
    slots = (f"{overall.given_up} of {overall.total} samples were given up for a server-side reason (failures by "
             f"reason: {reasons}); the servers failed them, not their input. " if overall.given_up else "")
    states = ("" if overall.given_up else "hidden-state captures failed (the report names how many). ")
    return (f"{slots}{states}Run them again: {_retry_hint(observed)}. Report ({report.verdict}): {report.uri}")


def _ended(observed: Observed, status: _Status) -> Decision:
    """The report is written: Succeeded only when the run is complete (store/completion.py, as the report judged
    it: every sample settled and every artifact the spec asks for present); a report of an older operator, without
    its completion, is judged by its samples alone."""
    report = observed.remembered_report
    assert report is not None
    overall, _ = _progress(observed)
    if report.completion == "pending":
        return _failed(observed, status, "StatesMissing",
                       f"every sample is settled but some have no hidden states ({_findings(report)}): a runner "
                       f"worker ended before its share was captured; capture them: {_retry_hint(observed)}. Report "
                       f"({report.verdict}): {report.uri}")
    if overall.given_up > 0 or report.completion == "given_up":
        return _failed(observed, status, "SamplesGivenUp", _given_up_message(observed, overall, report))
    return _finished(observed, status, report)


def _findings(report: ReportStatus) -> str:
    states = [finding for finding in report.findings if "hidden states" in finding]
    return "; ".join(states[:3]) or "see the report"


def _finished(observed: Observed, status: _Status, report: ReportStatus) -> Decision:
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
    """Terminal until its cause goes away. The server is removed and a runner still running is suspended with it:
    a runner without servers would only burn its samples' attempts."""
    status.set("Failed", "True", reason, message)
    status.set("Succeeded", "False", reason, message)
    status.set("Progressing", "False", reason, message)
    status.set("Ready", "False", reason, message)
    status.set("ServerReady", "False", "Released", "the server was removed to give the GPUs back")
    previous_reason = condition_reason(observed.previous.conditions, "Failed")
    events = [] if previous_reason == reason else [Event("Warning", reason, message)]
    return Decision(_base_status(observed, status, "Failed", message), server_replicas=0, delete_server=True,
                    suspend_job=True, events=events)


def _suspended(observed: Observed, status: _Status, replace_job: bool) -> Decision:
    message = "suspended: server scaled to zero; resuming continues from what is committed"
    status.set("Progressing", "False", "Suspended", message)
    status.set("ServerReady", "False", "Suspended", "scaled to zero while suspended")
    status.set("Stalled", "False", "Suspended")
    status.set("Ready", "False", "Suspended", message)
    return Decision(_base_status(observed, status, "Suspended", message), server_replicas=0, suspend_job=True,
                    replace_job=replace_job)


def _queued(observed: Observed, status: _Status, replace_job: bool) -> Decision:
    """Not admitted by Kueue (yet, or no longer): like a suspended run, nothing holds a GPU, and once admitted it
    continues from what is committed."""
    queue = observed.queue
    assert queue is not None
    message = queue.message
    reason = "Evicted" if queue.evicted else "LeavingQueue" if queue.leaving else "Queued"
    status.set("Progressing", "False", reason, message)
    status.set("ServerReady", "False", "Queued", "no server pods until Kueue admits the run")
    status.set("Stalled", "False", "Queued")
    status.set("Ready", "False", "Queued", message)
    events = [] if observed.previous.phase == "Queued" else [
        Event("Warning" if queue.evicted or queue.leaving else "Normal", reason, message)]
    return Decision(_base_status(observed, status, "Queued", message), server_replicas=0, suspend_job=True,
                    replace_job=replace_job, events=events)


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
    if observed.counting:  # the newest commits are the last ones a count from the first reaches
        return False, ""
    started = observed.job_started
    last = observed.progress.last_commit_time if observed.progress else None
    # The capture pass commits no shard; its workers' progress objects are its commits (store/capture_progress.py).
    captured = observed.capture.last_progress if observed.capture else None
    reference = max((t for t in (started, last, captured) if t is not None), default=None)
    if reference is None:
        return False, ""
    idle = (observed.now - reference).total_seconds()
    if idle < observed.stall_after_s:
        return False, ""
    since = ("the last commit" if reference in (last, captured) else "the runner started")
    return True, (f"nothing committed for {format_duration(idle)} since {since} (window "
                  f"{format_duration(observed.stall_after_s)}): check the runner pods' logs and the server")


def _capturing(observed: Observed) -> str | None:
    """What the runner's hidden-state capture pass has done, while it runs (observed.capture), for the message."""
    capture = observed.capture
    if capture is None:
        return None
    kind = observed.states_pass.kind if observed.states_pass else "aux"
    counts = capture.counts
    committed = observed.progress.overall.completed if observed.progress else 0
    eta = capture.eta_seconds(committed)
    return (f"capturing the {kind} hidden states: {counts.captured + counts.skipped:,}/{committed:,} samples, "
            f"{counts.failed + counts.failed_before:,} failed, {counts.state_bytes / 1e9:,.2f} GB this pass "
            f"({capture.workers} workers), "
            f"ETA {format_duration(eta) if eta is not None else 'unknown'}")


# The server's start deadline when spec.server.startDeadlineSeconds is unset: this many times the plan's predicted
# start-up (copy + load, CUDA graphs and warmup included; planner/startup.py), and never under the floor. The
# prediction is a planning rate, often off by a factor of two either way (a slower bucket, a busier node); three
# times it still ends a server that will never be ready (a crash loop, an image that cannot be pulled) hours
# before anyone would notice the idle GPUs. The floor covers what the plan does not model: pulling a 10+ GB SGLang
# image onto a new node, a cluster autoscaler adding one. The startup probe's budget is included so the deadline
# never ends a pod that the probe is still waiting for.
SERVER_START_FACTOR = 3
MIN_SERVER_START_S = 1800.0


def server_start_deadline(observed: Observed) -> float:
    """How long a server may take to become ready for a run that has no runner yet."""
    if observed.server_start_deadline_s is not None:
        return observed.server_start_deadline_s
    plan = observed.plan or observed.previous.server_plan
    startup = plan.startup if plan else None
    if startup is None:
        return MIN_SERVER_START_S
    return max(SERVER_START_FACTOR * startup.seconds, startup.copy_seconds + startup.probe_seconds,
               MIN_SERVER_START_S)


# A layout the operator switched to (replan auto, a trial step) gets its own start budget: 3x the start-up its plan
# predicts for a restart, at least 10 minutes. Past it the run leaves that layout (a trial drops the candidate, a
# replan goes back where it came from) instead of failing whole; the run's own deadline applies only if leaving it
# cannot be done either (SWITCH_GRACE budgets later).
MIN_SWITCH_START_S = 600.0
SWITCH_GRACE = 2


def switch_start_budget(restart_s: float) -> float:
    return max(SERVER_START_FACTOR * restart_s, MIN_SWITCH_START_S)


def _switch_starting(observed: Observed) -> tuple[LayoutOverride, float] | None:
    """The switch being started (not a return from one), and the seconds its server has been starting."""
    override = _kept_override(observed)
    server = observed.server
    since = observed.previous.server_starting_since
    if override is None or override.reverted or not since or (server is not None and server.is_ready):
        return None
    if observed.job is not None and not observed.job.deleting:
        return None  # a Job runs: the server was ready since the switch
    return override, (observed.now - _parse_iso(since)).total_seconds()


def switch_not_started(observed: Observed) -> str | None:
    """Why the run leaves the layout it was switched to: it did not start within its budget (with the figures),
    or None."""
    found = _switch_starting(observed)
    if found is None:
        return None
    override, waited = found
    budget = switch_start_budget(override.restart_seconds)
    if waited < budget:
        return None
    return (f"{override.to_layout} did not start in {format_duration(waited)} (its budget "
            f"{format_duration(budget)}: {SERVER_START_FACTOR}x its predicted start-up "
            f"{format_duration(override.restart_seconds)}, at least {format_duration(MIN_SWITCH_START_S)}): "
            f"{_server_not_ready(observed)}")


def _starting_since(observed: Observed) -> datetime:
    since = observed.previous.server_starting_since
    return _parse_iso(since) if since else observed.now


def _parse_iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _server_not_ready(observed: Observed) -> str:
    server = observed.server
    if server is not None and server.problem_reason:
        return f"{server.problem_reason}: {server.problem_message or server.problem_reason}"
    ready, desired = (server.ready, server.desired) if server else (0, 0)
    return f"{ready}/{desired} server pods ready"


def _starting_server(observed: Observed, status: _Status, replicas: int) -> Decision:
    """No runner yet and the server not ready: wait, saying Stalled once the stall window has passed (the
    deadline that ends the run is `_server_cannot_start`)."""
    since = _starting_since(observed)
    waited = (observed.now - since).total_seconds()
    events: list[Event] = []
    status.set("Progressing", "True", "StartingServer", "waiting for the server before starting the runner")
    if waited >= observed.stall_after_s:
        message = (f"the server is not ready after {format_duration(waited)} (stall window "
                   f"{format_duration(observed.stall_after_s)}; the run fails at "
                   f"{format_duration(server_start_deadline(observed))}): {_server_not_ready(observed)}")
        status.set("Stalled", "True", "ServerNotReady", message)
        if condition_status(observed.previous.conditions, "Stalled") != "True":
            events.append(Event("Warning", "Stalled", message))
    else:
        status.set("Stalled", "False", "StartingServer")
    status.set("Ready", "Unknown", "StartingServer", "")
    decision = Decision(_base_status(observed, status, "StartingServer", "starting the SGLang server"),
                        server_replicas=replicas, events=events)
    decision.status.server_starting_since = _iso(since)
    return decision


def _server_cannot_start(observed: Observed) -> str | None:
    """Why the run ends because its server never became ready (past the start deadline), or None. Only before the
    first runner Job: a Job exists once the server was ready. Once it ended so, it stays ended until the spec is
    edited (a new generation starts the server again, its clock from zero)."""
    if observed.job is not None:
        return None
    failed = next((c for c in observed.previous.conditions
                   if c.type == "Failed" and c.status == "True" and c.reason == "ServerCannotStart"), None)
    if failed is not None and failed.observed_generation == observed.generation:
        return failed.message
    server = observed.server
    since = observed.previous.server_starting_since
    if (server is not None and server.is_ready) or not since:
        return None
    switching = _switch_starting(observed)
    if switching is not None and switching[1] < SWITCH_GRACE * switch_start_budget(switching[0].restart_seconds):
        return None  # a switched layout that does not start is left (switch_not_started), not the whole run failed
    waited = (observed.now - _parse_iso(since)).total_seconds()
    deadline = server_start_deadline(observed)
    if waited < deadline:
        return None
    rule = ("spec.server.startDeadlineSeconds" if observed.server_start_deadline_s is not None else
            f"{SERVER_START_FACTOR}x the plan's predicted start-up, at least {format_duration(MIN_SERVER_START_S)}; "
            "spec.server.startDeadlineSeconds sets it")
    return (f"the server is not ready after {format_duration(waited)} (deadline {format_duration(deadline)}: "
            f"{rule}): {_server_not_ready(observed)}. The server was scaled to zero to give the GPUs back; fix the "
            "cause (spec.server.image, the model, its arguments, the pull secret, the node's GPUs), then edit the "
            "spec: a new generation starts the server again")


def _running(observed: Observed, status: _Status, replace_job: bool) -> Decision:
    plan = observed.plan or observed.previous.server_plan
    replicas = plan.replicas * plan.nodes_per_replica if plan else 0
    server_ready = _server_condition(observed, status)
    job = observed.job
    if job is None and not server_ready:
        return _starting_server(observed, status, replicas)
    replacing = replace_job or (job is not None and job.deleting)
    stalled, stall_message = _stalled(observed) if job is not None and not replacing else (False, "")
    events: list[Event] = []
    if stalled:
        status.set("Stalled", "True", "NoCommits", stall_message)
        if condition_status(observed.previous.conditions, "Stalled") != "True":
            events.append(Event("Warning", "Stalled", stall_message))
    else:
        status.set("Stalled", "False", "Committing", "")
    overall, _ = _progress(observed)
    message = _capturing(observed) or f"generating: {overall.display or 'starting'}, ETA {overall.eta or 'unknown'}"
    if observed.counting:
        message = (f"generating: {overall.display or 'starting'} when last counted; counting the output's commit "
                   "markers from the first (no checkpoint this operator trusts), a step a pass")
    if replacing:
        message = ("replacing the runner Job (what it depends on changed); the new one resumes from what is "
                   f"committed: {overall.display or 'nothing yet'}")
    status.set("Progressing", "True", "ReplacingRunner" if replacing else "Generating", message)
    status.set("Succeeded", "Unknown", "InProgress", "")
    status.set("Failed", "False", "InProgress", "")
    healthy = server_ready and not stalled
    status.set("Ready", "True" if healthy else "False", "Generating" if healthy else "Degraded",
               "" if healthy else (stall_message or "the server is not ready"))
    verification = _verification(observed, status, events) if server_ready and not replacing else None
    decision = Decision(_base_status(observed, status, "Generating", message), server_replicas=replicas,
                        create_job=job is None, replace_job=replace_job, events=events)
    if verification is not None:
        decision.status.verification = verification
    if decision.create_job and observed.wanted_run is not None:
        decision.status.run = observed.wanted_run
    return decision


# ------------------------------------------------------------------------------------ the plan on the GPUs


def predicted_step(plan: ServerPlan) -> PredictedStep | None:
    """The plan's decode step at its batch (a replica's batch over its share of the decode tokens/s), with the
    context it is at and its slope in it (plans made before they were recorded: the step alone)."""
    prediction = plan.prediction
    if prediction is None or prediction.decode_tokens_per_second <= 0 or prediction.batch_per_replica <= 0:
        return None
    return PredictedStep(prediction.batch_per_replica * plan.replicas / prediction.decode_tokens_per_second,
                         float(prediction.held_kv_tokens or 0), prediction.step_seconds_per_kv_token or 0.0)


def _verification_status(result: Verification, samples: int, seconds: float, observed: Observed,
                         planned: int, layout: str) -> VerificationStatus:
    return VerificationStatus(
        verified=result.verified, predicted_batch=round(result.predicted_batch),
        observed_batch=round(result.observed_batch),
        predicted_step_milliseconds=f"{result.predicted_step_s * 1e3:.1f}",
        observed_step_milliseconds=f"{result.observed_step_s * 1e3:.1f}", samples=samples,
        retractions=result.retractions, queued=round(result.queued), window_seconds=round(seconds),
        at=_iso(observed.now), planned_generation=planned, layout=layout)


def _verification(observed: Observed, status: _Status, events: list[Event]) -> VerificationStatus | None:
    """PlanVerified: Unknown while the window is open, then True (both the batch and the step within TOLERANCE of
    the plan's) or False with reason PlanOff, predicted and observed side by side, with one Event. Made once per
    plan (its planned generation) and again for a layout the operator switched it to; not while a trial measures
    (its candidates are measured by the trial, and the layout it continues on is checked after); the new status, or
    None to keep the previous one."""
    plan = observed.plan or observed.previous.server_plan
    step = predicted_step(plan) if plan is not None else None
    if plan is None or plan.prediction is None or step is None:
        return None
    planned, layout = verification_key(observed.previous, observed.planned_generation)
    done = observed.previous.verification
    if done is not None and done.covers(planned, layout):
        return None
    trial = _kept_trial(observed)
    if trial is not None and trial.phase == "Measuring":
        status.set("PlanVerified", "Unknown", "Verifying", "the trial measures its candidates first (status.trial); "
                   "the layout it continues on is checked after")
        return None
    window = observed.window
    if window is None:
        status.set("PlanVerified", "Unknown", "Verifying", "waiting for the server's first running requests "
                   f"(window {format_duration(observed.verify_window_s)})")
        return None
    seconds = window.seconds(observed.now)
    if seconds < observed.verify_window_s:
        status.set("PlanVerified", "Unknown", "Verifying",
                   f"{len(window.samples)} samples of the server's batch and step over {format_duration(seconds)} of "
                   f"the {format_duration(observed.verify_window_s)} window (spec.server.verifyWindowSeconds)")
        return None
    result = verify(window.samples, plan.prediction.batch_per_replica, step, window.retractions, window.queued)
    message = result.condition()["message"]
    if result.verified:
        status.set("PlanVerified", "True", "PlanVerified", message)
        events.append(Event("Normal", "PlanVerified", message))
    else:
        status.set("PlanVerified", "False", "PlanOff", f"{message}: the plan is off by more than "
                   f"{TOLERANCE:.0%} on this cluster")
        events.append(Event("Warning", "PlanOff", message))
    return _verification_status(result, len(window.samples), seconds, observed, planned, layout)


def with_replan(decision: Decision, replan: Replan, now: datetime, generation: int,
                kind: str = "ReplanSuggested") -> Decision:
    """ReplanSuggested from the re-plan on the measured constants (verify.decide): True with an Event when another
    layout wins by more than the restart and the margin, else False with the figures. Under replan auto a run that
    stays says so in `kind` Replanned (False, CurrentLayoutFastest): the condition a switch would set."""
    suggested = replan.condition()
    if suggested is not None:
        status, reason = "True", "FasterLayoutMeasured"
        message = (f"{suggested['message']}: set spec.server.tensorParallel (and the fields of that layout) to "
                   "switch; the run resumes from what is committed")
    else:
        status, reason = "False", "CurrentLayoutFastest"
        message = (f"the running layout stays: remaining ETA {replan.current_eta_s / 3600:,.2f} h"
                   + (f"; the best other, {replan.best}, {replan.best_eta_s / 3600:,.2f} h, does not gain the restart "
                      f"{replan.restart_s / 60:,.0f} min + margin {replan.margin_s / 60:,.0f} min" if replan.best
                      else ""))
    conditions = set_condition(decision.status.conditions, kind, status, reason, message, now, generation)
    events = [*decision.events, Event("Normal", kind, message)] if status == "True" else decision.events
    return replace(decision, status=decision.status.model_copy(update={"conditions": conditions}), events=events)


def with_switch(decision: Decision, replan: Replan, running: ServerPlan, switched: ServerPlan, now: datetime,
                generation: int) -> Decision:
    """The operator switches layouts (spec.server.replan auto, verify.decide said switch): serverPlan becomes the
    chosen layout's plan and status.layoutOverride says which, why and for which generation, with the Replanned
    condition and an Event. Nothing is applied here: the next pass builds the server from the new plan (a rolling
    restart) and, the runner Job's hash including the override, replaces the Job; its workers resume from the
    ledger, so nothing committed is generated again and nothing is lost (only in-flight requests are redone)."""
    found = replan.condition()
    assert found is not None and replan.action == "switch"
    before = layout_name(*running_layout(running))
    message = (f"switched from {before} to {found['message']}; the server restarts as {replan.best} and the runner "
               "Job is replaced: it resumes from what is committed (once per spec generation; edit the spec to plan "
               "from it again)")
    replicas, tp, dp, kv = running_layout(switched)
    from_replicas, from_tp, from_dp, from_kv = running_layout(running)
    override = LayoutOverride(
        generation=generation, replicas=replicas, tensor_parallel=tp, attention_data_parallel=dp, kv_cache_dtype=kv,
        from_layout=before, to_layout=replan.best, reason=message, current_eta_seconds=round(replan.current_eta_s),
        new_eta_seconds=round(replan.best_eta_s), gain_seconds=round(replan.gain_s),
        restart_seconds=round(replan.restart_s), margin_seconds=round(replan.margin_s), at=_iso(now),
        from_replicas=from_replicas, from_tensor_parallel=from_tp, from_attention_data_parallel=from_dp,
        from_kv_cache_dtype=from_kv)
    conditions = set_condition(decision.status.conditions, "Replanned", "True", "FasterLayoutMeasured", message,
                               now, generation)
    status = decision.status.model_copy(update={"conditions": conditions, "server_plan": switched,
                                                "layout_override": override})
    return replace(decision, status=status, events=[*decision.events, Event("Normal", "Replanned", message)])


def _job_finished(observed: Observed, status: _Status, job: JobState) -> Decision:
    """The Job ended (every index done, or it failed). The ledger and the states, not the Job, say whether the run
    is complete (store/completion.py): workers that gave samples up exit 3, which fails their index, yet every
    sample has its final outcome. The next hidden-state pass starts only once this pass's kind is captured for every
    committed sample; otherwise the report says what is missing or failed, and the run ends short of Succeeded.
    Nothing is decided before the full listing of the markers begun since the Job finished has reached the end: a
    marker whose PUT landed late would make its samples look missing."""
    if observed.counting or (observed.progress is not None and observed.progress.listing_incomplete):
        message = (f"the runner Job ended ({_progress(observed)[0].display or 'no sample yet'}); listing every "
                   "commit marker, a step a pass, before deciding whether the run is complete")
        status.set("Progressing", "True", "ListingMarkers", message)
        return Decision(_base_status(observed, status, observed.previous.phase or "Generating", message),
                        server_replicas=None)
    if observed.progress is not None and observed.progress.settled_by(job.hash):
        following = next_pass(observed.states_passes, observed.states_pass)
        current = observed.states_pass
        done = observed.completion
        if following is not None and current is not None and (done is None or done.kind_done(current.kind)):
            return _next_states_pass(observed, status, following)
        status.set("Progressing", "True", "Reporting", "writing the validation report")
        return Decision(_base_status(observed, status, "Reporting", "writing the validation report"),
                        server_replicas=0, write_report=True)
    delete_job = _delete_job(observed)
    if job.failed_message:
        return _failed(observed, status, "RunnerFailed",
                       f"{job.failed_message}; check the runner pods' logs, then run the rest again: {delete_job}")
    if observed.progress is None:
        return _failed(observed, status, "SamplesMissing",
                       "the runner Job completed but the output has no run.json (no runner ever started "
                       f"generating); check the runner logs, then start it again: {delete_job}")
    progress = observed.progress
    if progress.spec_hash != job.hash:
        return _failed(observed, status, "SamplesMissing",
                       f"the runner Job ended before its runner recorded the run's layout (run.json is from Job "
                       f"{progress.spec_hash or 'of an earlier run'}, this Job is {job.hash}): its work is not known "
                       f"to be done; check the runner logs, then start it again: {delete_job}")
    overall = progress.overall
    count = overall.total - overall.completed - overall.failed
    where = "; ".join(f"{name}: {what}" for name, what in progress.missing.items())
    return _failed(observed, status, "SamplesMissing",
                   f"the runner Job completed but {count} of {overall.total} samples have no outcome ({where}); "
                   f"check the runner logs, then run the missing samples again: {delete_job}")


def _next_states_pass(observed: Observed, status: _Status, following: ServedKind) -> Decision:
    """Every sample settled and its states of this pass captured: the server restarts for the next kind (its flags
    follow status.statesPass) and the finished Job is replaced by one for that pass, which starts once the server
    has rolled. Nothing is generated again: the new Job resumes from the ledger and captures only that kind."""
    current = observed.states_pass
    assert current is not None
    plan = observed.plan or observed.previous.server_plan
    replicas = plan.replicas * plan.nodes_per_replica if plan else 0
    overall, _ = _progress(observed)
    message = (f"{overall.display or 'every sample settled'}; the {current.kind} hidden states are captured: the "
               f"server restarts for the {following} states and a new runner Job captures them")
    status.set("Progressing", "True", "NextStatesPass", message)
    status.set("Stalled", "False", "NextStatesPass", "")
    decision = Decision(_base_status(observed, status, "Generating", message), server_replicas=replicas,
                        replace_job=True, events=[Event("Normal", "StatesPass", message)])
    decision.status.states_pass = current.model_copy(update={"kind": following, "since": _iso(observed.now)})
    return decision


def _delete_job(observed: Observed) -> str:
    return f"kubectl delete job {names.runner_name(observed.name)}" if observed.name else "delete the Job"


def blocked(observed: Observed, reason: str, message: str) -> Decision:
    """Something must change before the operator can act (a missing Secret, storage or the API server that cannot
    be read, a forbidden edit). Nothing is changed in the cluster: a run in progress keeps its server and runners,
    and its phase."""
    status = _Status(observed)
    status.set("Ready", "False", reason, message)
    previous = observed.previous
    already = any(c.type == "Ready" and c.reason == reason for c in previous.conditions)
    events = [] if already else [Event("Warning", reason, message)]
    new = _base_status(observed, status, previous.phase, message).model_copy(
        update={"completion_time": previous.completion_time, "report": previous.report, "run": previous.run,
                "queue": previous.queue, "server_starting_since": previous.server_starting_since})
    return Decision(new, server_replicas=None, events=events)


def cannot_observe(observed: Observed, error: str) -> Decision:
    """Storage or the API server could not be read: not a failure of the run. Said once with an Event, retried on
    every pass; the time it started is kept until a pass succeeds."""
    since = observed.previous.observation_failed_since or _iso(observed.now)
    message = (f"cannot observe the run: {error} (failing since {since}; retried every pass; the server and the "
               "runners are left as they are)")
    decision = blocked(observed, "ObservationFailed", message)
    decision.status.observation_failed_since = since
    return decision


def _outdated(observed: Observed) -> bool:
    job = observed.job
    return (job is not None and not job.deleting and job.hash is not None and observed.desired_job_hash is not None
            and job.hash != observed.desired_job_hash)


def decide(observed: Observed) -> Decision:
    status = _Status(observed)
    dropped = observed.previous.layout_override
    if dropped is not None and _kept_override(observed) is None:
        status.set("Replanned", "False", "SpecChanged",
                   f"the spec's generation {observed.planned_generation or observed.generation} is planned from the "
                   f"spec again; the operator's switch to {dropped.to_layout} was for generation {dropped.generation}")
    if observed.foreign_output:
        return _failed(observed, status, "OutputInUse", observed.foreign_output)
    if observed.plan_error:
        return _failed(observed, status, "PlanFailed", observed.plan_error)
    if observed.remembered_report is not None:
        return _ended(observed, status)
    job, replace_job = observed.job, _outdated(observed)
    if observed.suspended:
        return _suspended(observed, status, replace_job)
    if observed.queue is not None and not observed.queue.admitted:
        return _queued(observed, status, replace_job)
    if job is not None and job.finished and not replace_job and not job.deleting:
        return _job_finished(observed, status, job)
    if lock_failed := _cache_lock_failed(observed):
        return _failed(observed, status, "ModelCacheLockFailed", lock_failed)
    cannot_start = _runner_cannot_start(observed, replace_job)
    if cannot_start:
        return _failed(observed, status, "RunnerCannotStart", cannot_start)
    server_cannot_start = _server_cannot_start(observed)
    if server_cannot_start:
        return _failed(observed, status, "ServerCannotStart", server_cannot_start)
    running = _running(observed, status, replace_job)
    if (leave := switch_not_started(observed)) is not None:
        return replace(running, switch_not_started=leave)
    return running


def _cache_lock_failed(observed: Observed) -> str | None:
    """Why the run ends because a server pod's node-local fill could not take its lock (gather.LOCK_FAILED), or
    None. It stays ended while the spec is unchanged: the removed server has no pod left to say so, and a new one
    would only fail again on the same node."""
    previous = observed.previous
    if (condition_reason(previous.conditions, "Failed") == "ModelCacheLockFailed"
            and previous.observed_generation == observed.generation):
        return next(c.message for c in previous.conditions if c.type == "Failed")
    server = observed.server
    if server is None or server.problem_reason != "ModelCacheLockFailed":
        return None
    return (f"{server.problem_message}. The server was scaled to zero to give the GPUs back. The node-local cache "
            "folder is the operator's setting (docs/cluster.md): its administrator makes it with mode 1777 on "
            "every GPU node; then change this resource's spec, or re-create it, to start again")


def _runner_cannot_start(observed: Observed, replace_job: bool) -> str | None:
    """Why the run ends because its runner pods cannot start (past spec.runner.startDeadlineSeconds), or None. Once
    it ended so, it stays ended for this Job: a new Job (the spec fixed) starts it again."""
    job = observed.job
    if job is None or replace_job or job.deleting:
        return None
    previous = observed.previous
    if condition_reason(previous.conditions, "Failed") == "RunnerCannotStart":
        return next(c.message for c in previous.conditions if c.type == "Failed")
    started = observed.job_started
    if job.pod_problem is None or started is None:
        return None
    waited = (observed.now - started).total_seconds()
    if waited < observed.start_deadline_s:
        return None
    reason, message = job.pod_problem
    return (f"runner pods cannot start ({reason}) after {format_duration(waited)} (spec.runner."
            f"startDeadlineSeconds {format_duration(observed.start_deadline_s)}): {message}. The server was scaled "
            "to zero to give the GPUs back; fix spec.runner.image (a new runner Job starts the run again) or the "
            f"namespace's CPU/memory quota, then {_delete_job(observed)} to start it again")


def with_retry_event(decision: Decision, retry: RetryDecision | None) -> Decision:
    if retry is None or retry.event is None:
        return decision
    return replace(decision, events=[*decision.events, retry.event])
