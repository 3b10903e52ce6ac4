"""One reconcile pass for one DatasetGeneration: read it afresh, gather facts, `decide`, apply, write its status.

Called for kopf's create/resume/update events and by a timer, one pass at a time per resource (`passes.py`). Every
step is idempotent: child names are deterministic, children are server-side applied (the runner Job and the API-key
Secret are create-only, the Job replaced when its hash changes), and progress is read from the commit markers in
storage, so an operator restarted anywhere picks up where it was. What cannot be read (storage, the API server) is
reported and retried, never taken for an answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from tokenmill_runner.facts.workload import Workload
from tokenmill_runner.spec.resource import API_VERSION, KIND, DatasetGenerationSpec
from tokenmill_runner.store.bounds import OverBound
from tokenmill_runner.store.capture_progress import read_capture_progress
from tokenmill_runner.store.lease import read_versioned
from tokenmill_runner.store.lease_rules import LeaseError
from tokenmill_runner.store.ledger import MarkerError
from tokenmill_runner.store.manifest import ManifestError, Owner, RunManifest, read_manifest
from tokenmill_runner.store.storage import Storage, StorageError

from .act import constants as constants_write
from .act.children import apply_decision, apply_queueing
from .act.report import write_report_status
from .act.status import write_status
from .decide import cache, constants, kueue, manifests, names, policy, trialling
from .decide.constants import plan_with_constants
from .decide.facts import Context, Decision, Event, Facts, Observed, Queueing, ServerState
from .decide.lifecycle import (
    blocked,
    cannot_observe,
    decide,
    identity_change,
    kept_trial,
    layout_token,
    plan_retry,
    reopen,
    retry_value,
    set_condition,
    trial_sample_token,
    verification_key,
    with_replan,
    with_retry_event,
    with_switch,
)
from .decide.planner import PlanError, ServerPlan, workload
from .decide.planner.verify import (
    CONFIGMAP_NAME,
    LayoutKey,
    layout_name,
    pinned_spec,
    replan_decision,
    running_layout,
    switch_mode,
    switched_plan,
)
from .decide.progress import foreign_run, would_generate
from .decide.server_metrics import WindowFacts
from .decide.settings import REQUIRE_QUEUE_ENV, OperatorSettings
from .decide.states_passes import current_pass, passes_of, run_key
from .decide.status import DatasetGenerationStatus, LayoutOverride, RunStatus, TrialCandidate
from .decide.trialling import replan_may_switch
from .faults import crash_point
from .kube import ChildRefused, Kube, KubeUnavailable
from .observe import constants as constants_read
from .observe import deadline
from .observe.access import OBSERVE_RETRY, storage_for, tenant_credentials
from .observe.gather import (
    KueueMissing,
    OutputIndex,
    PassCancelled,
    never,
    node_driver_major,
    observe_fill,
    observe_job,
    observe_progress,
    observe_queue,
    observe_server,
    observe_trial,
    observe_window,
    server_node_products,
    states_completion,
)
from .observe.model_files import make_plan, read_model_facts
from .observe.workload_sample import operator_reader, surveyed_workload

__all__ = ["OutputIndex", "OperatorSettings", "PassCancelled", "PassResult", "reconcile", "run_pass"]

logger = logging.getLogger(__name__)

# What a pass may meet while reading storage or the API server that says nothing about the run itself. (A
# programming error is not one of them: it fails the pass loudly instead of reading as ObservationFailed forever.)
# OverBound and MarkerError: a tenant's output past a reader's bounds, or a marker tokenmill never wrote: said in the
# status (ObservationFailed, naming the object and the bound), the pass ends, and every other resource's go on.
UNOBSERVABLE = (StorageError, KubeUnavailable, OSError, ManifestError, OverBound, MarkerError)


def now_utc() -> datetime:
    return datetime.now(UTC)


# -------------------------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Planning:
    plan: ServerPlan | None
    error: str | None = None  # the spec cannot be planned: reported until the spec changes
    transient: str | None = None  # the model files could not be read: retried on the next pass
    generation: int | None = None  # set when this pass made a new plan


def _current_plan(context: Context) -> ServerPlan | None:
    previous = context.previous
    planned = previous.planned_generation or previous.observed_generation  # statuses from before the field
    return previous.server_plan if planned == context.generation else None


def job_workload(context: Context, credentials: dict[str, str] | None, output: OutputIndex | None) -> Workload:
    """The job as its sources say it is: read once per planned generation within the operator's bounds
    (observe/workload_sample.operator_reader), then kept in the resource's index (`output`) for the trial's and
    the re-plan's plans."""
    generation = context.generation
    found = output.workloads.get(generation) if output is not None else None
    if found is None:
        spec = context.spec
        found = surveyed_workload(spec, workload(spec), None, operator_reader(spec, credentials, OBSERVE_RETRY))
        if output is not None:
            output.workloads = {generation: found}
    return found


def plan_for(context: Context, credentials: dict[str, str] | None,
             node_driver: Callable[[], int | None] = lambda: None,
             measured: Callable[[], dict[str, str]] = dict,
             work: Callable[[], Workload | None] = lambda: None) -> Planning:
    """The plan of this generation: kept from the status, or made now (node_driver reads the GPU nodes' NVIDIA
    driver branch then, `measured` the cluster's measured constants: the operator's ConfigMap). A spec edit that
    cannot be planned because the model files cannot be read keeps the server on its previous plan until they can."""
    current = _current_plan(context)
    if current is not None:
        return Planning(current)
    try:
        driver = None if context.spec.server.cuda_driver_major else node_driver()
        # The model files first: a store that does not answer is said at once, not after the sources' reads too.
        facts = read_model_facts(context.spec, credentials, retry=OBSERVE_RETRY, local=False)
        plan = plan_with_constants(context.spec, facts, work(), driver,
                                   lambda key: constants.stored(measured(), context.namespace, key))
    except (PlanError, LookupError, ValueError) as error:
        return Planning(None, error=str(error))
    except Exception as error:  # storage: unreachable, slow, denied or missing; say where and retry
        previous = context.previous
        kept = (f"; the server keeps the plan of generation {previous.planned_generation or 'before'}"
                if previous.server_plan else "")
        return Planning(None, transient=f"cannot read the model files to plan the server for generation "
                                        f"{context.generation}: {error}{kept}")
    crash_point("planned")
    return Planning(plan, generation=context.generation)


# ------------------------------------------------------------------------------------------------- deciding


class QueueRequired(Exception):
    """The operator requires a Kueue queue label (TOKENMILL_REQUIRE_QUEUE) and the run has none."""


def queue_required_message(name: str) -> str:
    return (f"this operator runs only resources queued through Kueue ({REQUIRE_QUEUE_ENV}, chart value "
            f"operator.kueue.requireQueue): add the label {kueue.QUEUE_LABEL}=<LocalQueue> to DatasetGeneration "
            f"{name}")


def _queueing(kube: Kube, context: Context, plan: ServerPlan | None, settings: OperatorSettings) -> Queueing | None:
    queue = kueue.queue_name(context.body["metadata"].get("labels"))
    spec, previous = context.spec, context.previous.queue
    in_queue = queue or (previous.name if previous else None)
    if plan is None or in_queue is None:
        return None
    # A removed label: the run's Workload, in the queue it was in, is given back like an evicted one, never while
    # the pods hold what it counted (security-a87e82b.md B5: deleting it at once left the GPUs held, uncounted).
    desired = kueue.run_workload(context.name, context.namespace, manifests.owner_reference(context.body),
                                 in_queue, spec, plan, spec.runner.image or settings.runner_image,
                                 settings.node_cache_root)
    state, current = observe_queue(kube, context.name, context.namespace, in_queue, desired)
    if queue is None:
        if not state.exists:
            # Given back. A run that was queued stays stopped rather than start again outside Kueue, whatever
            # requireQueue says (security-f9665d2.md W2: removing the label ran it again uncounted).
            raise QueueRequired(queue_required_message(context.name) if settings.require_queue else
                                f"DatasetGeneration {context.name} was queued through Kueue (LocalQueue {in_queue}) "
                                f"and its label was removed: it stays stopped, never runs outside its queue; add "
                                f"the label {kueue.QUEUE_LABEL}=<LocalQueue> back, or create the run anew to run it "
                                "without Kueue")
        state = kueue.left(state)
    return Queueing(desired, current, state)


def _shared_cache_digest(spec: DatasetGenerationSpec, plan: ServerPlan | None) -> str | None:
    if plan is None or spec.model.cache is None or spec.model.cache.mode != "sharedVolume":
        return None
    return cache.model_digest(spec, plan.weight_bytes)


def _observe_cluster(kube: Kube, context: Context, plan: ServerPlan | None, settings: OperatorSettings) -> Facts:
    job, started = observe_job(kube, context.name, context.namespace)
    server = observe_server(kube, context.name, context.namespace)
    digest = _shared_cache_digest(context.spec, plan)
    fill = observe_fill(kube, context.namespace, digest) if digest else None
    if fill is not None and fill.problem is not None:  # no server pod mounts the volume before it is filled
        server = ServerState(server.desired if server else 0, 0, *fill.problem)
    elif fill is not None and server is not None:
        server = replace(server, copy_seconds=fill.copy_seconds)
    return Facts(job, started, server, _queueing(kube, context, plan, settings),
                 cache_ready=fill is None or fill.problem is None)


def _server_urls(context: Context, plan: ServerPlan | None) -> list[str] | None:
    if plan is None:
        return None
    return names.server_urls(context.name, context.namespace, context.spec.server.port, plan.replicas,
                             plan.nodes_per_replica)


def _metrics_urls(context: Context, plan: ServerPlan) -> list[list[str]]:
    """Per replica, the pods whose /metrics hold its DP attention groups (names.metrics_urls)."""
    return names.metrics_urls(context.name, context.namespace, context.spec.server.port, plan.replicas,
                              plan.nodes_per_replica, plan.tensor_parallel, plan.attention_data_parallel)


def _observed(context: Context, output: OutputIndex, storage: Storage, planning: Planning, facts: Facts,
              now: datetime, settings: OperatorSettings, stopped: Callable[[], bool]) -> Observed:
    spec, previous, job = context.spec, context.previous, facts.job
    plan = planning.plan
    ended = previous.report is not None
    # Before a decision that ends the run (the Job finished), every marker name is listed: a late PUT must not make
    # committed samples look missing. A run that already failed is listed fully only when it now looks settled
    # (a missed marker can only make it look less done, never done).
    full = job is not None and job.finished and previous.phase != "Failed"
    if job is None or not job.finished:
        output.job_running()
    planned = plan or previous.server_plan
    expected = ({d.name: float(d.mean_output_tokens) for d in planned.prediction.datasets}
                if planned is not None and planned.prediction is not None else {})
    progress, run = (None, None) if ended else observe_progress(storage, output, now, facts.job_started, stopped,
                                                                full, expected)
    if progress is not None and progress.settled and job is not None and job.finished and not full:
        progress, run = observe_progress(storage, output, now, facts.job_started, stopped, True, expected)
    given_up = (progress.overall if progress else previous.progress).given_up
    # An ended run's report says what a retry runs again: given-up samples, failed and missing captures.
    retryable = max(given_up, previous.report.retryable) if ended and previous.report is not None else given_up
    retry = plan_retry(context.retry_request, previous.retry, retryable, now)
    urls = _server_urls(context, plan)
    layout = layout_token(previous, planning.generation)
    passes = passes_of(spec)
    states = current_pass(previous, passes, run_key(planning.generation or previous.planned_generation, retry.token),
                          now)
    desired_hash = (manifests.runner_job_hash(spec, urls, retry.token, layout, states.kind if states else "",
                                              trial_sample_token(previous, planning.generation))
                    if urls is not None else None)
    ended_hash = job.hash if job is not None else (previous.run.job_hash if previous.run else None)
    # run.json is read only when an ended run's Job would change: what reopening then depends on.
    changed = ended and desired_hash is not None and ended_hash not in (None, desired_hash)
    growing = changed and would_generate(spec, read_manifest(storage))
    reopened = reopen(previous, retry, desired_hash, ended_hash, growing)
    if reopened:
        progress, run = observe_progress(storage, output, now, facts.job_started, stopped, full, expected)
    window = _window(context, output, planning, facts, urls, now, settings, desired_hash) if not ended else None
    capture = None
    if spec.hidden_states is not None and progress is not None and progress.settled and job is not None \
            and not job.finished:
        # Every sample settled and the Job still runs: it is capturing states, which commits no shard.
        capture = read_capture_progress(storage, states.kind if states else "aux", facts.job_started)
    completion = None
    if spec.hidden_states is not None and progress is not None and job is not None and job.finished \
            and progress.settled_by(job.hash) and run is not None:
        # The Job ended with every sample settled: whether its pass's states are all there decides the next pass.
        completion = states_completion(storage, run.dataset_names, list(spec.hidden_states.layouts),
                                       progress.overall.given_up)
    return Observed(
        generation=context.generation, now=now, suspended=spec.suspend, previous=previous, name=context.name,
        plan=plan, plan_error=planning.error, planned_generation=planning.generation, server=facts.server, job=job,
        job_started=facts.job_started, progress=progress,
        counting=progress is None and run is not None and output.counting,
        remembered_report=None if reopened else previous.report,
        stall_after_s=spec.runner.stall_seconds or settings.stall_after_s,
        start_deadline_s=spec.runner.start_deadline_seconds,
        server_start_deadline_s=spec.server.start_deadline_seconds,
        desired_job_hash=desired_hash,
        wanted_run=RunStatus.model_validate({**manifests.run_identity(spec), "jobHash": desired_hash or ""}),
        retry=retry, reopened=reopened,
        foreign_output=_foreign_output(storage, output, run, spec, context.owner),
        queue=facts.queueing.state if facts.queueing else None,
        window=window, verify_window_s=float(spec.server.verify_window_seconds),
        states_passes=passes, states_pass=states, capture=capture, completion=completion,
    )


def _window(context: Context, output: OutputIndex, planning: Planning, facts: Facts, urls: list[str] | None,
            now: datetime, settings: OperatorSettings, desired_hash: str | None = None) -> WindowFacts | None:
    """The plan's verification window, scraped while the server is ready and the runner Job runs, until the plan
    is checked (status.verification for its planned generation and switched layout), and not while a trial
    measures (lifecycle._verification). Only this layout's own pods and Job feed it: right after a switch (replan
    auto, a trial's conclusion) the StatefulSet and the Job are still the old layout's for a pass, and their
    figures would decide the new plan's check (review-f9665d2.md bug 5); so the Job must be the desired one and the
    server as many pods as the plan runs."""
    previous, job, server = context.previous, facts.job, facts.server
    plan, key = planning.plan, verification_key(previous, planning.generation)
    done = previous.verification is not None and previous.verification.covers(*key)
    trial = kept_trial(previous, planning.generation)
    if (plan is None or urls is None or done or job is None or job.finished or job.deleting or job.suspended
            or server is None or not server.is_ready or (trial is not None and trial.phase == "Measuring")):
        return None
    if job.hash not in (None, desired_hash) or server.desired != plan.replicas * plan.nodes_per_replica:
        return None  # a Job without a recorded hash predates layout switches: it is the only layout there was
    targets = ([[settings.metrics_url_of(context.namespace, context.name)]] * plan.replicas
               if settings.server_metrics_url else _metrics_urls(context, plan))
    return observe_window(output.window, targets, key, now)


def _foreign_output(storage: Storage, output: OutputIndex, run: RunManifest | None, spec: DatasetGenerationSpec,
                    owner: Owner) -> str | None:
    """`observe.foreign_run` with the lease as this operator has watched it (a bounded read of lease.json)."""
    try:
        found = read_versioned(storage)
    except LeaseError as error:
        return f"{spec.output.uri}: {error}"
    lease = found[0] if found is not None else None
    unchanged = output.lease_watch.see(found[1] if found is not None else None, time.monotonic())
    return foreign_run(run, None if lease is not None and lease.released else lease, spec, owner, unchanged)


def reconcile(kube: Kube, context: Context, output: OutputIndex, settings: OperatorSettings,
              stopped: Callable[[], bool] = never) -> Decision:
    spec, now = context.spec, now_utc()
    base = Observed(generation=context.generation, now=now, suspended=spec.suspend, previous=context.previous,
                    name=context.name)
    refused = policy.refusal(spec, settings.tenant_policy) or cache.host_path_refusal(spec.model.cache,
                                                                                       settings.node_cache_root)
    if refused:  # before the Secret, the model files or the output are touched
        return blocked(base, "NotAllowed", refused)
    if (settings.require_queue and context.previous.queue is None
            and kueue.queue_name(context.body["metadata"].get("labels")) is None):
        return blocked(base, "QueueRequired", queue_required_message(context.name))
    try:
        credentials = tenant_credentials(kube, spec, context.namespace)
    except LookupError as error:
        return blocked(base, "MissingSecret",
                       f"{error}: create it with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (spec.output."
                       "credentialsSecret names it)")
    except KubeUnavailable as error:
        return cannot_observe(base, str(error))
    if credentials is not None and (refused := policy.credentials_refusal(spec, credentials)):
        return blocked(base, "NotAllowed", refused)
    planning = plan_for(context, credentials, lambda: node_driver_major(kube, spec.server),
                        lambda: constants_read.read_data(kube, settings.operator_namespace),
                        lambda: job_workload(context, credentials, output))
    if planning.transient:
        return cannot_observe(base, planning.transient)
    try:
        storage = storage_for(spec.output.uri, spec, credentials)
        facts = _observe_cluster(kube, context, planning.plan or context.previous.server_plan, settings)
        started_run = (facts.job.run if facts.job else None) or context.previous.run
        wanted = RunStatus.model_validate(manifests.run_identity(spec))
        change = identity_change(started_run, wanted)
        if change:
            return blocked(base, "ImmutableFieldChanged", change)
        observed = _observed(context, output, storage, planning, facts, now, settings, stopped)
    except KueueMissing as error:
        return blocked(base, "KueueNotInstalled", str(error))
    except QueueRequired as error:
        return blocked(base, "QueueRequired", str(error))
    except UNOBSERVABLE as error:
        return cannot_observe(base, str(error))
    decision = decide(observed)
    if decision.write_report:
        if stopped():
            raise PassCancelled
        try:
            report = write_report_status(storage)
        except UNOBSERVABLE as error:
            return cannot_observe(base, f"cannot write the report: {error}")
        crash_point("report-written")
        decision = decide(replace(observed, remembered_report=report))
    if stopped():
        raise PassCancelled
    try:
        apply_decision(kube, context, decision, planning.plan or context.previous.server_plan, settings, facts,
               observed.retry.token if observed.retry else "")
        apply_queueing(kube, context, decision, facts.queueing, now)
    except ChildRefused as error:  # said in the status (and an Event), retried every pass
        return blocked(base, "ChildRefused", f"{error}; the operator retries on every pass")
    if _newly_verified(context.previous, decision.status) and observed.window is not None:
        decision = _record_constants(kube, context, credentials, decision, observed.window, settings, output)
    if decision.switch_not_started:
        decision = _leave_switch(context, credentials, decision, observed, output)
    elif context.spec.server.trial == "auto":
        decision = _trial(context, credentials, decision, observed, output, settings)
    return with_retry_event(decision, observed.retry)


def _newly_verified(previous: DatasetGenerationStatus, status: DatasetGenerationStatus) -> bool:
    now, before = status.verification, previous.verification
    return now is not None and (before is None or not before.covers(now.planned_generation, now.layout))


def _record_constants(kube: Kube, context: Context, credentials: dict[str, str] | None, decision: Decision,
                      window: WindowFacts, settings: OperatorSettings, output: OutputIndex | None = None) -> Decision:
    """Refit the plan's constants on the window's samples and keep them for the cluster's later plans (once per
    checked plan; a failure is logged and changes nothing else)."""
    namespace, plan = settings.operator_namespace, decision.status.server_plan
    if not namespace or plan is None:
        return decision
    try:
        stored = constants_read.read_data(kube, namespace)
        measured = constants_read.measure(context.spec, credentials, plan, window.samples, stored, OBSERVE_RETRY,
                                          namespace=context.namespace)
        if measured is None:
            return decision
        evidence = constants.Evidence(
            image=plan.image or context.spec.server.image, planned_product=plan.gpu_product,
            node_products=server_node_products(kube, context.name, context.namespace, plan.gpu_vendor),
            window_s=window.seconds(now_utc()), samples=len(window.samples))
        refused = constants.promotion_refusal(measured, evidence, settings.trusted_images)
        keys = constants_write.write_entry(kube, namespace, measured, context.namespace, cluster=refused is None)
    except (*UNOBSERVABLE, PlanError, LookupError, ValueError, ApiException) as error:
        logger.warning("%s/%s: the measured constants were not recorded: %s", context.namespace, context.name, error)
        return decision
    message = (f"{measured.describe()}: kept in ConfigMap {namespace}/{CONFIGMAP_NAME} as {' and '.join(keys)}"
               + (f" (for this namespace only: {refused})" if refused else ""))
    decision = replace(decision, events=[*decision.events, Event("Normal", "ConstantsMeasured", message)])
    if context.spec.server.replan == "off":
        return decision
    try:
        replanned = constants.replan(context.spec, plan, measured, job_workload(context, credentials, output))
    except (PlanError, LookupError, ValueError) as error:
        logger.warning("%s/%s: cannot re-plan with the measured constants: %s", context.namespace, context.name,
                       error)
        return decision
    progress = decision.status.progress
    remaining = 1 - (progress.completed + progress.failed) / progress.total if progress.total else 1.0
    generation = decision.status.planned_generation or context.generation
    switched_in = context.previous.layout_override.generation if context.previous.layout_override else None
    mode = switch_mode(context.spec.server.replan, switched_in, generation)
    if mode == "auto" and not replan_may_switch(decision.status.trial):
        mode = "suggest"
    found = replan_decision(plan, replanned, remaining, mode) if replanned is not None else None
    if found is None:
        return decision
    if found.action == "switch" and found.layout is not None:
        try:
            pinned = constants.plan_layout(context.spec, plan, measured, found.layout,
                                           job_workload(context, credentials, output))
        except (PlanError, LookupError, ValueError) as error:
            logger.warning("%s/%s: cannot plan the layout %s: %s", context.namespace, context.name, found.best, error)
            pinned = None
        switched = switched_plan(plan, pinned, found, replanned) if pinned is not None else None
        if switched is not None:
            return with_switch(decision, found, plan, switched, now_utc(), generation)
        # A layout the pinned spec does not plan as compared is not run: said as a suggestion instead.
        found = replace(found, action="suggest")
    kind = "Replanned" if mode == "auto" and found.action != "suggest" else "ReplanSuggested"
    return with_replan(decision, found, now_utc(), generation, kind)


def _trial_measuring(context: Context, decision: Decision, observed: Observed, candidate: TrialCandidate) -> bool:
    """The candidate runs: the previous pass's status already had its layout (so the runner Job's desired hash,
    made from that status, is this layout's), that Job runs unchanged and the server is ready."""
    job, server, before = observed.job, observed.server, context.previous.server_plan
    return (before is not None and running_layout(before) == candidate.key and job is not None
            and not (job.finished or job.deleting or job.suspended) and not decision.replace_job
            and job.hash == observed.desired_job_hash and server is not None and server.is_ready)


def _trial(context: Context, credentials: dict[str, str] | None, decision: Decision, observed: Observed,
           output: OutputIndex, settings: OperatorSettings) -> Decision:
    """spec.server.trial auto, one pass: begin the trial on the generation's plan, measure the candidate that runs,
    and when trialling.advance says so switch the server to the next candidate (or to the winner) the way replan
    auto switches: serverPlan pinned to that layout and status.layoutOverride, applied by the next passes."""
    status = decision.status
    plan = status.server_plan
    generation = status.planned_generation or context.generation
    if plan is None or status.phase != "Generating":
        return decision
    trial = status.trial
    if trial is None or trial.generation != generation:
        step = trialling.begin(plan, generation)
    elif trial.phase != "Measuring":
        return decision
    else:
        candidate = trial.candidates[trial.current]
        if not _trial_measuring(context, decision, observed, candidate):
            return decision
        # One whole-server series: TOKENMILL_SERVER_METRICS_URL, when set, is read once, not once per replica.
        targets = ([[settings.metrics_url_of(context.namespace, context.name)]] if settings.server_metrics_url
                   else _metrics_urls(context, plan))
        points = observe_trial(output.trial, targets, (generation, trial.current), observed.now,
                               settings.trial_clock_scale)
        step = trialling.advance(trial, running_layout(plan), points, _remaining(plan, status))
    return _apply_trial_step(context, credentials, decision, observed, output, step)


def _remaining(plan: ServerPlan, status: DatasetGenerationStatus) -> float:
    progress = status.progress
    share = 1 - (progress.completed + progress.failed) / progress.total if progress.total else 1.0
    return trialling.remaining_tokens(plan, share)


def _pinned(context: Context, credentials: dict[str, str] | None, output: OutputIndex, plan: ServerPlan,
            key: LayoutKey, what: str) -> ServerPlan | None:
    """The plan of one layout (the spec pinned to it, the job as read for this generation), or None when it cannot
    be made now (the model files: asked again on the next pass) or does not plan as that layout."""
    try:
        pinned = make_plan(pinned_spec(context.spec, key), credentials, job_workload(context, credentials, output),
                           retry=OBSERVE_RETRY, node_driver_major=plan.cuda_driver_major, local=False)
    except Exception as error:  # the model files: the switch is asked again on the next pass
        logger.warning("%s/%s: cannot plan %s %s: %s", context.namespace, context.name, what, layout_name(*key),
                       error)
        return None
    if running_layout(pinned) != key:
        logger.warning("%s/%s: %s %s plans as %s: not run", context.namespace, context.name, what, layout_name(*key),
                       running_layout(pinned))
        return None
    return pinned


def _apply_trial_step(context: Context, credentials: dict[str, str] | None, decision: Decision,
                      observed: Observed, output: OutputIndex, step: trialling.TrialStep) -> Decision:
    """A trial step in status: its trial, its Trialled condition and Event, and when it switches, serverPlan pinned
    to the layout and status.layoutOverride (applied by the next passes)."""
    status = decision.status
    plan = status.server_plan
    assert plan is not None
    update: dict[str, Any] = {"trial": step.trial}
    conditions = status.conditions
    if step.condition is not None:
        conditions = set_condition(conditions, trialling.CONDITION, *step.condition, observed.now, context.generation)
    events = [*decision.events, *([step.event] if step.event else [])]
    if step.switch_to is not None:
        target = step.switch_to
        why = (step.condition[2] if step.condition else f"trial: switching to {target.layout}")
        pinned = _pinned(context, credentials, output, plan, target.key, "the trial's layout")
        if pinned is None:
            return decision
        update["server_plan"] = trialling.trial_plan(pinned, plan, target, why)
        update["layout_override"] = trialling.trial_override(step.trial, plan, target, why,
                                                             observed.now.isoformat().replace("+00:00", "Z"))
    update["conditions"] = conditions
    return replace(decision, status=status.model_copy(update=update), events=events)


def _leave_switch(context: Context, credentials: dict[str, str] | None, decision: Decision, observed: Observed,
                  output: OutputIndex) -> Decision:
    """The layout the operator switched to did not start within its budget (decision.switch_not_started): a trial
    drops that candidate and moves on (trialling.drop_unstarted); a replan (or a trial's last switch) goes back to
    the layout it came from, once, with the figures in the Replanned condition and a Warning Event."""
    status, why = decision.status, decision.switch_not_started
    plan, override, trial = status.server_plan, status.layout_override, status.trial
    if plan is None or override is None or why is None:
        return decision
    if trial is not None and trial.phase == "Measuring" and trial.candidates[trial.current].key == running_layout(
            plan):
        return _apply_trial_step(context, credentials, decision, observed, output,
                                 trialling.drop_unstarted(trial, why, _remaining(plan, status)))
    back = override.from_key
    if back is None:  # a status from before the field: the run's own start deadline decides
        return decision
    pinned = _pinned(context, credentials, output, plan, back, "the layout switched from,")
    if pinned is None:
        return decision
    message = (f"{why}: back to {override.from_layout}, the layout it was switched from (the server restarts as "
               f"{override.from_layout} and the runner Job resumes from what is committed; no other switch in this "
               "generation)")
    replicas, tp, dp, kv = back
    revert = LayoutOverride(
        generation=override.generation, replicas=replicas, tensor_parallel=tp, attention_data_parallel=dp,
        kv_cache_dtype=kv, from_layout=override.to_layout, to_layout=override.from_layout, reason=message,
        current_eta_seconds=override.new_eta_seconds, new_eta_seconds=override.current_eta_seconds, gain_seconds=0,
        restart_seconds=override.restart_seconds, margin_seconds=0, at=observed.now.isoformat().replace("+00:00", "Z"),
        from_replicas=override.replicas, from_tensor_parallel=override.tensor_parallel,
        from_attention_data_parallel=override.attention_data_parallel, from_kv_cache_dtype=override.kv_cache_dtype,
        reverted=True)
    lead = f"returned by the operator to the layout it switched from: {message}"
    conditions = set_condition(status.conditions, "Replanned", "False", "SwitchNotStarted", message, observed.now,
                               context.generation)
    updated = status.model_copy(update={
        "server_plan": pinned.model_copy(update={"reasoning": [lead, *pinned.reasoning]}),
        "layout_override": revert, "conditions": conditions})
    return replace(decision, status=updated, events=[*decision.events, Event("Warning", "Replanned", message)])


# ---------------------------------------------------------------------------------------------- one whole pass


def _previous(status: dict[str, Any]) -> DatasetGenerationStatus:
    try:
        return DatasetGenerationStatus.model_validate(status or {})
    except ValidationError:
        logger.warning("status does not match this operator's schema; starting from an empty one")
        return DatasetGenerationStatus()


def _invalid_spec(body: dict[str, Any], previous: DatasetGenerationStatus, error: ValidationError) -> Decision:
    message = "; ".join(f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
    observed = Observed(generation=body["metadata"].get("generation", 0), now=now_utc(), suspended=False,
                        previous=previous, name=body["metadata"]["name"])
    return blocked(observed, "InvalidSpec", message)


@dataclass(frozen=True)
class PassResult:
    body: dict[str, Any]  # the resource as this pass read it (for Events)
    decision: Decision
    spec: DatasetGenerationSpec | None
    behind: bool = False  # markers are still to read (gather.MARKERS_PER_PASS): another pass should follow at once


def settled(body: dict[str, Any], previous: DatasetGenerationStatus) -> bool:
    """A run that succeeded and has nothing new to act on (no spec change, no new retry request): the pass only
    republishes its status. (Failed runs get full passes: deleting their Job must start them again.)"""
    meta = body["metadata"]
    request = (meta.get("annotations") or {}).get(names.RETRY_ANNOTATION)
    handled = previous.retry.handled if previous.retry else None
    return (previous.phase == "Succeeded" and previous.observed_generation == meta.get("generation", 0)
            and previous.queue is None  # a Kueue Workload still to delete once the pods are gone
            and (not request or retry_value(request) == handled))


def run_pass(kube: Kube, name: str, namespace: str, uid: str, output: OutputIndex, settings: OperatorSettings,
             stopped: Callable[[], bool] = never) -> PassResult | None:
    """Read the resource afresh (a queued pass never acts on an old copy), reconcile it and write its status.
    None when it is gone or being deleted. Its reads of the tenant's store and pods end by the pass's deadline and
    budget (settings.pass_deadline_s, pass_read_bytes); its own calls to the API server are not cut."""
    with deadline.pass_scope(settings.pass_deadline_s, f"the pass of {namespace}/{name}", settings.pass_read_bytes):
        return _run_pass(kube, name, namespace, uid, output, settings, stopped)


def _run_pass(kube: Kube, name: str, namespace: str, uid: str, output: OutputIndex, settings: OperatorSettings,
              stopped: Callable[[], bool]) -> PassResult | None:
    output.behind = False  # set again only by this pass's reads of the markers
    body = kube.get(API_VERSION, KIND, name, namespace)
    if body is None or body["metadata"].get("uid") != uid or body["metadata"].get("deletionTimestamp"):
        return None
    previous = _previous(body.get("status") or {})
    spec: DatasetGenerationSpec | None = None
    try:
        valid = DatasetGenerationSpec.model_validate(body["spec"])
    except ValidationError as error:
        decision = _invalid_spec(body, previous, error)
    else:
        spec = valid
        if settled(body, previous):
            return PassResult(body, Decision(previous, server_replicas=None), spec)
        refused = kept_plan_refusal(previous, valid, settings, output)
        if refused:  # planned anew, as for a new generation; the edited plan is never applied
            logger.warning("%s/%s: %s; planning anew", namespace, name, refused)
            previous = previous.model_copy(update={"server_plan": None, "planned_generation": None,
                                                   "layout_override": None})
        context = Context(body=body, name=name, namespace=namespace,
                          generation=body["metadata"].get("generation", 0), spec=valid, previous=previous)
        decision = reconcile(kube, context, output, settings, stopped)
        if refused:
            decision = replace(decision, events=[*decision.events, Event("Warning", "StatusPlanRefused",
                                                                          f"{refused}: planned anew")])
    if stopped():
        raise PassCancelled
    write_status(kube, body, decision.status)
    plan = decision.status.server_plan
    output.plan_grants = policy.plan_grants(plan) if plan is not None else None
    return PassResult(body, decision, spec, behind=output.behind)


def kept_plan_refusal(previous: DatasetGenerationStatus, spec: DatasetGenerationSpec, settings: OperatorSettings,
                      output: OutputIndex) -> str | None:
    """Why status.serverPlan may not be kept, or None. It grants an image and GPUs, and status is open to whoever
    may patch datasetgenerations/status (security-f9665d2.md W1): it must be what this operator last wrote there
    (once it wrote one since it started) and what the planner could have chosen for the spec under the policy."""
    plan = previous.server_plan
    if plan is None:
        return None
    if output.plan_grants is not None and policy.plan_grants(plan) != output.plan_grants:
        return ("status.serverPlan grants another image, GPU or pod layout than this operator last wrote there: the "
                "status was edited")
    return policy.plan_refusal(plan, spec, settings.tenant_policy)
