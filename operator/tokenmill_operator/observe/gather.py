"""Reading the facts of one reconcile pass: the server and the runner Job from the API server, run.json and the
commit markers from storage. Nothing here changes the cluster; in storage, only checkpoints are written (immutable
objects that let the next reader skip what they cover)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import secrets
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import orjson
from kubernetes.client.exceptions import ApiException

from tokenmill_runner.facts.hardware import PRODUCT_LABEL_KEY, find
from tokenmill_runner.facts.workload import Workload
from tokenmill_runner.spec.resource import ServerSpec
from tokenmill_runner.store.checkpoints import OPERATOR_WRITER, Signer
from tokenmill_runner.store.commit_index import DatasetIndex
from tokenmill_runner.store.completion import Completion
from tokenmill_runner.store.hidden_states import kinds_coverage
from tokenmill_runner.store.index_store import (
    CHECKPOINT_EVERY,
    load_index,
    refold,
    refresh,
    settle_horizon,
    sweep,
    write_checkpoint,
)
from tokenmill_runner.store.lease_rules import LeaseWatch
from tokenmill_runner.store.ledger import LedgerBudget
from tokenmill_runner.store.manifest import RunManifest, read_manifest
from tokenmill_runner.store.storage import Storage, StorageError

from ..decide import cache, kueue, names
from ..decide.facts import JobState, ProgressFacts, QueueState, ServerState
from ..decide.manifests import SERVER_CONTAINER
from ..decide.planner.serving import DRIVER_LABEL
from ..decide.planner.trial import MetricPoint
from ..decide.progress import parse_time, progress_facts
from ..decide.server_metrics import Scrape, TrialScrapes, VerificationWindow, WindowFacts, combine
from ..decide.status import RunStatus
from ..kube import ApiNotServed, Kube, KubeUnavailable
from . import deadline
from .sglang_metrics import read_metrics

# The init containers that copy the weights into a server pod (manifests.py, cache.py).
COPYING_CONTAINERS = ("sync-models", cache.NODE_FILL_CONTAINER)
SERVER_PROBLEMS = ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError",
                   "InvalidImageName", "RunContainerError")
# A server pod's node-local fill could not take its lock (cache.LOCK_FAILED_EXIT): the run ends with this reason.
LOCK_FAILED = "ModelCacheLockFailed"
# Incremental listings miss a marker whose PUT finished more than the overlap (marker_names.OVERLAP) after its name
# was chosen; a full listing of the names (no GETs but for such stragglers) catches it: one this often, in steps of
# SWEEP_NAMES names (a page of S3's listing), each a pass of its own between incremental ones, the passes following
# at once; and one whole before any decision that ends a run.
FULL_LISTING_EVERY = timedelta(minutes=10)
SWEEP_NAMES = 1000
# Markers one incremental pass reads at most (a GET each), over all of a resource's datasets; the rest are read by
# the passes that follow at once (`OutputIndex.behind`). A pass's time stays bounded however fast the runners commit
# or however long the operator was away, and a resource with a backlog waits its turn for a thread between passes
# (passes.FairSlots) instead of holding one. On the moto S3 server of the tests, with ten resources in the process,
# a pass of 256 GETs took 1.5-2.2 s, 135 GETs 1.1-1.8 s (docs/scale.md); at 256 samples a marker, 128 a pass still
# follows ~30,000 samples/s there.
MARKERS_PER_PASS = 128
CHECKPOINT_WRITER = OPERATOR_WRITER
# The secret the operator keys its checkpoints' digests with (the chart's `<release>-checkpoint-key` Secret): a
# tenant writes whatever it likes into its own output, checkpoints included, so the operator starts only from
# checkpoints it wrote itself (a forged one inflated to 2.1 GB: security-f9665d2.md B6).
CHECKPOINT_KEY_ENV = "TOKENMILL_CHECKPOINT_KEY"


@functools.cache
def checkpoint_signer() -> Signer:
    """The operator's checkpoints: named `operator`, keyed with $TOKENMILL_CHECKPOINT_KEY. Without it, a key of this
    process only: its checkpoints still skip what they cover while it runs, and a restart folds every marker once."""
    configured = os.environ.get(CHECKPOINT_KEY_ENV, "")
    if not configured:
        logger.warning("%s is not set: checkpoints are keyed for this process only, so after a restart each output's "
                       "markers are folded from the start once", CHECKPOINT_KEY_ENV)
    key = configured.encode() if configured else secrets.token_bytes(32)
    return Signer(hashlib.blake2b(key, digest_size=64).digest(), CHECKPOINT_WRITER)


logger = logging.getLogger(__name__)


def never() -> bool:
    return False


class PassCancelled(Exception):
    """The resource is being deleted (or the operator is stopping): the pass changes nothing more."""


@dataclass
class OutputIndex:
    """What the operator knows of one resource's output between passes: an index per dataset (a bit per slot, the
    hashes of the folded shards, a ring of recent commits; `commit_index.py`), never the markers themselves. A pass
    reads only the markers committed since the last one."""

    datasets: dict[str, DatasetIndex] = field(default_factory=dict)
    output: str | None = None  # the output the indexes describe
    last_full_listing: datetime | None = None
    # The output's lease as this operator has watched it (its version, since when on the operator's monotonic
    # clock): a lease held by another owner is judged gone only when it stayed unchanged for the stale period.
    lease_watch: LeaseWatch = field(default_factory=LeaseWatch)
    # The server's (batch, step) samples of the plan's verification window (server_metrics.py).
    window: VerificationWindow = field(default_factory=VerificationWindow)
    # The scrapes of the trial's candidate being measured (server_metrics.TrialScrapes).
    trial: TrialScrapes = field(default_factory=TrialScrapes)
    # The job as its sources say it is (observe/workload_sample.py), by planned generation: read once, so the plans
    # of a trial's candidates and of a re-plan are made on the job the first plan was (a restarted operator reads
    # it again, within the same bounds).
    workloads: dict[int, Workload] = field(default_factory=dict)
    # What the plan this operator last wrote to status grants (policy.plan_grants): a status edited since is refused.
    plan_grants: tuple[object, ...] | None = None
    # What the indexes' ledgers may hold together (store/bounds.LEDGER_BYTES), whatever the output's run.json and
    # markers say: one tenant's output never sizes the operator's memory past it.
    budget: LedgerBudget = field(default_factory=LedgerBudget)
    # The last pass stopped at MARKERS_PER_PASS with markers still to read, or in the middle of the periodic full
    # listing: the next pass should follow at once.
    behind: bool = False
    # The periodic full listing in progress: per dataset still to list, the last name listed (None: none yet) and
    # the newest time key listed so far; and when it began (what last_full_listing becomes once every dataset was
    # listed). Its steps take turns with the incremental passes (`sweep_turn`: the next pass is a step), so no pass
    # lists more than its own few pages.
    sweep: dict[str, tuple[str | None, str]] | None = None
    sweep_started: datetime | None = None
    sweep_turn: bool = True
    # The decision that ends a run waits for a full listing begun after the Job finished (a marker whose PUT landed
    # late must not make samples look missing): when this operator first saw it finished (None while it runs), when
    # the last full listing that reached every dataset's end began, and whether the last pass left that decision
    # waiting for one (`incomplete`). That listing runs in the same steps as the periodic one, a step a pass.
    finished_seen: datetime | None = None
    whole_since: datetime | None = None
    incomplete: bool = False
    # Datasets being counted: an index with no horizon (no checkpoint this operator trusts: a restart with another
    # key, an output it never followed) lists its markers from the first in the same bounded steps, one a pass,
    # instead of reading every one of them in one pass (39,000 GETs, minutes, at 10M samples); per dataset the last
    # name listed and the newest time key listed so far. Its figures are partial until the end (`counting`).
    counted: dict[str, tuple[str | None, str]] = field(default_factory=dict)

    @property
    def counting(self) -> bool:
        """Whether some dataset's markers are still being counted from the first: its figures are a part of the
        truth, and nothing should be decided or shown on them."""
        return bool(self.counted)

    def job_running(self) -> None:
        """The run's Job runs (or there is none): the next time it finishes needs a full listing of its own."""
        self.finished_seen = None

    def follow(self, storage: Storage, totals: dict[str, int], now: datetime, full: bool = False,
               stopped: Callable[[], bool] = never, samples: dict[str, int] | None = None) -> dict[str, DatasetIndex]:
        """Bring every dataset's index up to what is committed, reading at most MARKERS_PER_PASS markers. Every
        FULL_LISTING_EVERY, a full listing in steps of SWEEP_NAMES names, every other pass a step (`_sweep_step`).
        `full`: the Job finished and a decision that ends the run waits for a full listing begun after that; until
        one reached every dataset's end (`incomplete`), every pass is a step of it. An index without a horizon (no
        checkpoint this operator trusts) is counted from its first name in the same steps, a pass each, within the
        pass's markers (`counting` until each such index reached its end)."""
        if self.output != storage.root_uri:
            self.datasets, self.output, self.last_full_listing = {}, storage.root_uri, now
            self.budget, self.sweep, self.whole_since, self.counted = LedgerBudget(), None, None, {}
        if full and self.finished_seen is None:
            self.finished_seen = now
        wanted = self.finished_seen if full else None
        if wanted is not None and self.sweep is not None and self.sweep_started is not None \
                and self.sweep_started < wanted:
            self.sweep = None  # begun before the Job finished: its early steps may have missed a late marker
        waiting = self._lacks_whole_listing(wanted)
        last = self.last_full_listing
        sweeping = waiting or self.sweep is not None or last is None or now - last >= FULL_LISTING_EVERY
        step = sweeping and (waiting or self.sweep_turn)
        self.sweep_turn = not step

        def check() -> None:
            if stopped():  # thousands of markers after a restart: stop between reads, not after all of them
                raise PassCancelled

        left, self.behind = MARKERS_PER_PASS, False
        for name, rows in totals.items():
            check()
            per_prompt = (samples or {}).get(name, 1)  # spec.datasets[].samples: slots per source row
            index = self.datasets.get(name)
            if index is None:
                index = self.datasets[name] = load_index(storage, name, rows, per_prompt, checkpoint_signer(),
                                                               self.budget)
                if not index.horizon:  # counted from the first: by the steps below, or by a full listing's
                    self.counted[name] = (None, "")
            else:
                index.ledger.widen(per_prompt)
                index.ledger.reserve(rows * index.ledger.samples_per_prompt)
            if step:  # this pass is a step of the full listing: the next one lists what is new
                continue
            if name in self.counted or not index.horizon:
                index, cursor, read = _listing_step(storage, index, self.counted.get(name, (None, "")), rows, left,
                                                    now, check)
                self.datasets[name] = index
                self._count(name, cursor)
                left = max(0, left - read)
                # No checkpoint before a pass after the count's end: one written before has no horizon (a restart
                # from it would list every name again), and its PUT would lengthen a pass that read its share of
                # markers (2.2 s on moto at 10M).
                continue
            # A marker this index folded may since have been sealed away (a takeover's seal written after it
            # landed): refresh folds every marker again then, as the runner does, so nothing counts it.
            index, caught = refresh(storage, index, check=check, now=now, rows=rows, limit=left)
            left = max(0, left - caught.read)
            self.behind = self.behind or caught.more
            self.datasets[name] = index
            self._checkpoint(storage, index, now)
        self.datasets = {name: index for name, index in self.datasets.items() if name in totals}
        self.counted = {name: cursor for name, cursor in self.counted.items() if name in totals}
        if step:
            self._sweep_step(storage, totals, now, check)
        elif sweeping:
            self.behind = True  # the full listing's next step follows at once
        self.incomplete = self._lacks_whole_listing(wanted)
        return self.datasets

    def _lacks_whole_listing(self, since: datetime | None) -> bool:
        """Whether no full listing begun at or after `since` reached every dataset's end (False for None)."""
        return since is not None and (self.whole_since is None or self.whole_since < since)

    def _sweep_step(self, storage: Storage, totals: dict[str, int], now: datetime, check: Callable[[], None]) -> None:
        """The next SWEEP_NAMES names of the full listing (of the first dataset not listed yet in it), the markers
        among them not folded yet read (at most MARKERS_PER_PASS). Once every dataset was listed to its end, the
        listing is done as of when it began."""
        if self.sweep is None:
            self.sweep, self.sweep_started = dict.fromkeys(totals, (None, "")), now
        name = next((name for name in self.sweep if name in self.datasets), None)
        if name is not None:
            index, cursor, _ = _listing_step(storage, self.datasets[name], self.sweep[name], totals[name],
                                             MARKERS_PER_PASS, now, check)
            self.datasets[name] = index
            if cursor is not None:
                self.sweep[name] = cursor
                self.behind = True
                return
            self._count(name, None)  # listed to its end: a dataset being counted is counted
            self._checkpoint(storage, index, now)
            del self.sweep[name]
        if any(name in self.datasets for name in self.sweep):
            self.behind = True
            return
        self.last_full_listing = self.whole_since = self.sweep_started
        self.sweep = None

    def _count(self, name: str, cursor: tuple[str | None, str] | None) -> None:
        """Where the counting of a dataset's markers goes on (None: it reached the end, the index has a horizon)."""
        if cursor is None:
            self.counted.pop(name, None)
        else:
            self.counted[name] = cursor
            self.behind = True  # the next step follows at once

    @staticmethod
    def _checkpoint(storage: Storage, index: DatasetIndex, now: datetime) -> None:
        if index.since_checkpoint < CHECKPOINT_EVERY:
            return
        try:
            write_checkpoint(storage, index, CHECKPOINT_WRITER, now, checkpoint_signer().key)
        except StorageError as error:  # the next reader reads more markers; nothing is wrong
            logger.warning("%s: could not write a checkpoint: %s", index.name, error)


def _listing_step(storage: Storage, index: DatasetIndex, cursor: tuple[str | None, str], rows: int, limit: int,
                  now: datetime, check: Callable[[], None]) -> tuple[DatasetIndex, tuple[str | None, str] | None, int]:
    """One step of a listing of a dataset's markers from its first name, in steps of SWEEP_NAMES names: from
    `cursor` (the last name listed, None for none; the newest time key listed so far), the markers the index lacks
    folded, at most `limit` read. Returns the index (folded again from every marker when it counted a sealed-away
    one, as `refresh` does), the cursor of the next step (None: the listing reached the end, and an index without a
    horizon got one) and the markers read."""
    after, newest = cursor
    caught = sweep(storage, index, after, SWEEP_NAMES, check, now=now, limit=limit)
    newest = max(newest, caught.newest)
    if caught.tainted:
        index, _ = refold(storage, index, check, now, rows)
    elif caught.more:
        return index, (caught.after or after, newest), caught.read
    else:
        settle_horizon(index, newest)
    return index, None, caught.read


def node_driver_major(kube: Kube, server: ServerSpec) -> int | None:
    """The oldest NVIDIA driver branch among the nodes the server pods may land on (their GPU product and
    spec.server.nodeSelector), as GPU feature discovery labels it; None when no such node carries the label or the
    nodes cannot be read (the plan then says the driver is unknown)."""
    gpu = find(server.gpu_product) if server.gpu_product else None
    if gpu is not None and gpu.vendor != "nvidia":
        return None
    selector = {**({gpu.label_key: gpu.label} if gpu else {}), **server.node_selector}
    try:
        nodes = kube.list("v1", "Node", None, selector)
    except (KubeUnavailable, ApiException) as error:  # e.g. 403 where the chart's ClusterRole was trimmed
        logger.warning("cannot read the GPU nodes' %s label: %s", DRIVER_LABEL, error)
        return None
    branches = [int(value) for node in nodes
                if (value := ((node.get("metadata") or {}).get("labels") or {}).get(DRIVER_LABEL, "")).isdigit()]
    return min(branches, default=None)


def observe_server(kube: Kube, name: str, namespace: str) -> ServerState | None:
    statefulset = kube.get("apps/v1", "StatefulSet", names.server_name(name), namespace)
    if statefulset is None:
        return None
    desired = statefulset["spec"].get("replicas") or 0
    status = statefulset.get("status") or {}
    ready = status.get("readyReplicas") or 0
    pods = kube.list("v1", "Pod", namespace, names.selector_labels(name, names.SERVER_COMPONENT))
    copy, load = startup_times(pods)
    rolling = statefulset_rolling(statefulset)
    for pod in pods:
        problem = pod_problem(pod)
        if problem:
            return ServerState(desired, ready, *problem, copy_seconds=copy, load_seconds=load, rolling=rolling)
    return ServerState(desired, ready, copy_seconds=copy, load_seconds=load, rolling=rolling)


def server_node_products(kube: Kube, name: str, namespace: str, vendor: str) -> tuple[str | None, ...]:
    """The GPU product label of the node each server pod runs on, as the node says (not as the spec claims): what a
    cluster-wide measured constant is keyed by (decide/constants.promotion_refusal)."""
    label = PRODUCT_LABEL_KEY.get(vendor, PRODUCT_LABEL_KEY["nvidia"])  # type: ignore[call-overload]
    products: list[str | None] = []
    for pod in kube.list("v1", "Pod", namespace, names.selector_labels(name, names.SERVER_COMPONENT)):
        node_name = (pod.get("spec") or {}).get("nodeName")
        node = kube.get("v1", "Node", node_name, None) if node_name else None
        products.append(((node or {}).get("metadata") or {}).get("labels", {}).get(label) if node else None)
    return tuple(products)


def statefulset_rolling(statefulset: dict[str, Any]) -> bool:
    """Whether a template change has not reached every pod yet: the controller has not seen the newest spec
    (status.observedGeneration), or some pods are still of the previous revision (currentRevision !=
    updateRevision, or fewer updatedReplicas than wanted; apps/v1 StatefulSetStatus)."""
    status = statefulset.get("status") or {}
    generation = statefulset["metadata"].get("generation")
    if generation is not None and (status.get("observedGeneration") or 0) < generation:
        return True
    update, current = status.get("updateRevision"), status.get("currentRevision")
    desired = statefulset["spec"].get("replicas") or 0
    return bool(update and current and update != current) or (
        update is not None and (status.get("updatedReplicas") or 0) < desired)


def _seconds(start: str | None, end: str | None) -> int | None:
    if not start or not end:
        return None
    return max(0, round((parse_time(end) - parse_time(start)).total_seconds()))


def startup_times(pods: list[dict[str, Any]]) -> tuple[int | None, int | None]:
    """The newest start of a server pod: its weights' copy (the copying init container, when it succeeded) and its
    load (SGLang's container start until the pod became Ready)."""
    copy = load = None
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
        status = pod.get("status") or {}
        for init in status.get("initContainerStatuses") or []:
            done = (init.get("state") or {}).get("terminated") or {}
            if init.get("name") in COPYING_CONTAINERS and done.get("exitCode") == 0:
                copy = _seconds(done.get("startedAt"), done.get("finishedAt")) or copy
        running = next(((c.get("state") or {}).get("running") or {} for c in status.get("containerStatuses") or []
                        if c.get("name") == SERVER_CONTAINER), {})
        became_ready = next((c.get("lastTransitionTime") for c in status.get("conditions") or []
                             if c.get("type") == "Ready" and c.get("status") == "True"), None)
        load = _seconds(running.get("startedAt"), became_ready) if became_ready else load
    return copy, load


def pod_problem(pod: dict[str, Any]) -> tuple[str, str] | None:
    """The scheduler's or the kubelet's reason a server pod cannot run, in its own words."""
    status = pod.get("status") or {}
    pod_name = pod["metadata"]["name"]
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return (condition.get("reason") or "Unschedulable",
                    f"pod {pod_name}: {condition.get('message') or 'cannot be scheduled'}")
    for init in status.get("initContainerStatuses") or []:
        if init.get("name") != cache.NODE_FILL_CONTAINER:
            continue
        for state in (init.get("state") or {}, init.get("lastState") or {}):
            ended = state.get("terminated") or {}
            if ended.get("exitCode") == cache.LOCK_FAILED_EXIT:  # the fill's own verdict: waiting more never helps
                why = (ended.get("message") or "").strip() or "the fill could not take the node-local lock"
                return LOCK_FAILED, f"pod {pod_name} on node {(pod.get('spec') or {}).get('nodeName')}: {why}"
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
    state = job_state(job)
    if state.active:  # a runner pod that cannot start (the image, CPU or memory quota) holds the server for nothing
        for pod in kube.list("v1", "Pod", namespace, names.selector_labels(name, names.RUNNER_COMPONENT)):
            if problem := pod_problem(pod):
                state = replace(state, pod_problem=problem)
                break
    return state, parse_time(started) if started else None


class KueueMissing(LookupError):
    """A resource asks for a Kueue LocalQueue on a cluster without Kueue."""


@dataclass(frozen=True)
class FillState:
    """The shared model cache's fill Job: why the volume cannot be mounted yet (None once it succeeded), and how
    long the copy took."""

    problem: tuple[str, str] | None
    copy_seconds: int | None = None


def observe_fill(kube: Kube, namespace: str, digest: str) -> FillState:
    name, claim = cache.fill_job_name(digest), cache.claim_name(digest)
    job = kube.get("batch/v1", "Job", name, namespace)
    if job is None:
        return FillState(("FillingModelCache", f"creating PVC {claim} and its fill Job {name}"))
    state, status = job_state(job), job.get("status") or {}
    if state.complete:
        return FillState(None, _seconds(status.get("startTime"), status.get("completionTime")))
    if state.failed_message:
        return FillState(("ModelCacheFillFailed", f"{state.failed_message}; see the logs of Job {name}, fix the "
                          "cause, then delete the Job to copy again (what was copied is kept)"))
    return FillState(("FillingModelCache", f"copying the weights once into PVC {claim} (Job {name}, "
                                           f"{state.failed} failed attempts); the server starts when it completes"))


def _pods_left(kube: Kube, name: str, namespace: str) -> int:
    """The run's server and runner pods that have not ended (they may still hold what Kueue counted)."""
    pods = [pod for component in (names.SERVER_COMPONENT, names.RUNNER_COMPONENT)
            for pod in kube.list("v1", "Pod", namespace, names.selector_labels(name, component))]
    return sum(1 for pod in pods if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))


def observe_queue(kube: Kube, name: str, namespace: str, queue: str,
                  desired: dict[str, Any]) -> tuple[QueueState, dict[str, Any] | None]:
    """The run's Workload as Kueue left it (and the Workload itself, for the patch that hands its quota back)."""
    try:
        current = kube.get(kueue.WORKLOAD_API, kueue.WORKLOAD_KIND, desired["metadata"]["name"], namespace)
    except ApiNotServed as error:
        raise KueueMissing(f"the {kueue.QUEUE_LABEL} label asks for Kueue, but the API server does not serve "
                           f"{error}: install Kueue (docs/cluster.md) or remove the label") from error
    state = kueue.queue_state(queue, desired, current, [])
    if not state.exists:
        return state, current
    if not state.admitted:  # the queue's other workloads matter only for one that waits
        state = kueue.queue_state(queue, desired, current, kueue_workloads(kube, namespace))
    return replace(state, pods_left=_pods_left(kube, name, namespace)), current


def kueue_workloads(kube: Kube, namespace: str) -> list[dict[str, Any]]:
    return kube.list(kueue.WORKLOAD_API, kueue.WORKLOAD_KIND, namespace, {})


def observe_progress(storage: Storage, output: OutputIndex, now: datetime, started: datetime | None,
                     stopped: Callable[[], bool] = never, full: bool = False,
                     expected_output: Mapping[str, float] | None = None,
                     ) -> tuple[ProgressFacts | None, RunManifest | None]:
    """Progress from the markers against the run manifest's layout (None, None before a runner wrote one; no
    progress while `output.counting`: the markers of an index without a checkpoint are counted from the first in
    steps, a pass each, and partial figures are not progress). `full` before a decision that ends the run: every
    marker name is listed (in steps, a pass each: `listing_incomplete` until the last), so a late PUT cannot make
    samples look missing. `expected_output`: the plan's mean output tokens per dataset, for the ETA of one not yet
    begun."""
    manifest = read_manifest(storage)
    if manifest is None:
        return None, None
    lines = {name: layout.last_line for name, layout in manifest.datasets.items()}
    samples = {name: layout.samples for name, layout in manifest.datasets.items()}
    indexes = output.follow(storage, lines, now, full, stopped, samples)
    if output.counting:
        return None, manifest
    facts = progress_facts(indexes, manifest, now, started, expected_output)
    return (replace(facts, listing_incomplete=True) if output.incomplete else facts), manifest


def states_completion(storage: Storage, datasets: list[str], layouts: list[str], given_up: int) -> Completion:
    """What a settled run lacks (store/completion.py): each kind of hidden states the layouts need over every
    committed sample, the state markers listed (not read: the report reads them), with the given-up samples."""
    return Completion(0, given_up, kinds_coverage(storage, datasets, layouts))


def scrape_replicas(urls: list[list[str]], read: Callable[[str], Scrape | None] = read_metrics) -> list[Scrape | None]:
    """Per replica, its figures from the /metrics of its pods that host DP attention groups (names.metrics_urls: the
    rank-0 pod, plus the other nodes of a multi-node DP attention replica), all read at once so pods that do not
    answer cost one timeout, not one each; None for a replica any of whose pods could not be read."""
    flat = [url for replica in urls for url in replica]
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(flat))), thread_name_prefix="scrape") as pool:
        found = iter(list(pool.map(deadline.carry(read), flat)))  # each read within the pass's deadline
    return [combine([next(found) for _ in replica]) for replica in urls]


def observe_window(window: VerificationWindow, urls: list[list[str]], plan_key: Hashable, now: datetime,
                   read: Callable[[str], Scrape | None] = read_metrics) -> WindowFacts | None:
    """Scrape each replica (`scrape_replicas`) into the plan's verification window; what it saw so far."""
    window.add(plan_key, now, dict(enumerate(scrape_replicas(urls, read))))
    return window.facts()


def observe_trial(scrapes: TrialScrapes, urls: list[list[str]], key: tuple[int, int], now: datetime,
                  clock_scale: float, read: Callable[[str], Scrape | None] = read_metrics) -> list[MetricPoint]:
    """Scrape every replica (`scrape_replicas`) into the trial candidate's series; the series so far."""
    found = scrape_replicas(urls, read)
    return scrapes.add(key, now, found, clock_scale)
