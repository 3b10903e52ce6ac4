"""A run behind a Kueue LocalQueue: the one Workload of the run, what its status means, and the decisions."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tokenmill_operator.decide import kueue
from tokenmill_operator.decide.facts import QueueState
from tokenmill_operator.decide.lifecycle import JobState, Observed, ServerState, decide
from tokenmill_operator.decide.status import DatasetGenerationStatus
from tokenmill_runner import cli
from tokenmill_runner.spec.resource import DatasetGenerationSpec

from .test_lifecycle import PLAN, T0, observed
from .test_plan_cli import kimi_files  # noqa: F401  (fixture)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "b5-openthoughts.yaml"
OWNER = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "name": "b5", "uid": "u-1",
         "controller": True, "blockOwnerDeletion": True}


def spec(**runner) -> DatasetGenerationSpec:
    document = yaml.safe_load(EXAMPLE.read_text())["spec"]
    document["runner"] = {**document.get("runner", {}), **runner}
    return DatasetGenerationSpec.model_validate(document)


def run_workload(**runner) -> dict:
    return kueue.run_workload("b5", "team-a", OWNER, "gpu-queue", spec(**runner), PLAN, "runner:1")


def waiting(name: str, created: str, priority: int = 0, queue: str = "gpu-queue", **status) -> dict:
    return {"metadata": {"name": name, "creationTimestamp": created},
            "spec": {"queueName": queue, "priority": priority}, "status": status}


def cond(type_: str, status: str = "True", reason: str = "R", message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message}


def test_the_queue_is_kueues_own_label():
    assert kueue.queue_name({"kueue.x-k8s.io/queue-name": "gpu-queue"}) == "gpu-queue"
    assert kueue.queue_name({"app": "x"}) is None and kueue.queue_name(None) is None


def test_one_workload_holds_the_server_and_the_runner_pods_together():
    workload = run_workload(parallelism=4)
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta2" and workload["spec"]["queueName"] == "gpu-queue"
    assert workload["metadata"]["ownerReferences"] == [OWNER]
    server, runner = workload["spec"]["podSets"]
    assert (server["name"], server["count"], runner["name"], runner["count"]) == ("server", 1, "runner", 4)
    gpu = server["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]
    assert gpu == "8"
    assert runner["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "1"
    # Kueue picks a flavor from the pods' node selector and tolerations: they come along.
    assert server["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_a_spec_change_in_what_the_run_needs_makes_the_workload_outdated():
    current = run_workload(parallelism=4)
    current["status"] = {"conditions": [cond("QuotaReserved"), cond("Admitted")]}
    same = kueue.queue_state("gpu-queue", run_workload(parallelism=4), current, [])
    assert same.admitted and not same.reshaped
    upgraded = kueue.run_workload("b5", "team-a", OWNER, "gpu-queue", spec(parallelism=4), PLAN, "runner:2")
    assert not kueue.queue_state("gpu-queue", upgraded, current, []).reshaped  # a new image needs no new quota
    wider = kueue.queue_state("gpu-queue", run_workload(parallelism=8), current, [])
    assert wider.reshaped and not wider.admitted and "queues again" in wider.message


def test_position_follows_kueues_order_priority_then_creation_time():
    mine = waiting("mine", "2026-11-29T12:05:00Z")
    queue = [waiting("older", "2026-11-29T12:00:00Z"), waiting("urgent", "2026-11-29T12:10:00Z", priority=100),
             mine, waiting("newer", "2026-11-29T12:20:00Z"),
             waiting("running", "2026-11-29T11:00:00Z", conditions=[cond("QuotaReserved")]),
             waiting("elsewhere", "2026-11-29T11:00:00Z", queue="cpu-queue")]
    assert kueue.position(mine, queue, "gpu-queue") == 3
    admitted = waiting("mine", "2026-11-29T12:05:00Z", conditions=[cond("QuotaReserved")])
    assert kueue.position(admitted, queue, "gpu-queue") is None


def test_waiting_says_where_and_why():
    desired = run_workload()
    current = {**desired, "metadata": {**desired["metadata"], "creationTimestamp": "2026-11-29T12:05:00Z"},
               "status": {"conditions": [cond("QuotaReserved", "False", "Pending",
                                              "couldn't assign flavors to pod set server: insufficient quota")]}}
    other = waiting("first", "2026-11-29T12:00:00Z")
    state = kueue.queue_state("gpu-queue", desired, current, [other, current])
    assert not state.admitted and state.position == 2
    assert "LocalQueue gpu-queue at position 2: couldn't assign flavors" in state.message


def test_eviction_keeps_the_quota_until_the_pods_are_gone_then_hands_it_back():
    desired = run_workload()
    current = {**desired, "status": {
        "admission": {"clusterQueue": "gpus"},
        "conditions": [cond("QuotaReserved"), cond("Admitted"), cond("Evicted", reason="Preempted",
                                                                     message="Preempted to accommodate a workload")]}}
    state = kueue.queue_state("gpu-queue", desired, current, [])
    assert state.evicted and not state.admitted and "Preempted" in state.message
    patch = kueue.release_patch(current, "2026-11-29T12:00:00Z")
    assert patch["admission"] is None
    by_type = {c["type"]: c for c in patch["conditions"]}
    assert by_type["QuotaReserved"]["status"] == "False" and by_type["QuotaReserved"]["reason"] == "Pending"
    assert by_type["Admitted"]["status"] == "False" and by_type["Evicted"]["status"] == "True"


def queued(**changes) -> QueueState:
    base = dict(queue="gpu-queue", workload="b5-run", exists=True, position=2, message="queued at position 2")
    return QueueState(**{**base, **changes})


def test_a_queued_run_holds_no_gpu_and_says_where_it_waits():
    decision = decide(observed(queue=queued(), server=None))
    assert decision.status.phase == "Queued" and decision.server_replicas == 0 and not decision.create_job
    assert decision.status.queue.position == 2 and not decision.status.queue.admitted
    progressing = next(c for c in decision.status.conditions if c.type == "Progressing")
    assert (progressing.status, progressing.reason) == ("False", "Queued")
    assert [e.reason for e in decision.events] == ["Queued"]


def test_admission_starts_the_server_and_an_eviction_stops_the_run_without_ending_it():
    admitted = queued(admitted=True, position=None, cluster_queue="gpus", message="admitted")
    running = decide(observed(queue=admitted, job=JobState(active=4)))
    assert running.status.phase == "Generating" and running.server_replicas == 1 and not running.suspend_job
    assert running.status.queue.admitted and running.status.queue.cluster_queue == "gpus"
    evicted = decide(observed(queue=queued(evicted=True, position=None, message="evicted by Kueue (Preempted)"),
                              job=JobState(active=4), previous=running.status))
    assert evicted.status.phase == "Queued" and evicted.server_replicas == 0 and evicted.suspend_job
    assert not evicted.delete_server and evicted.status.report is None
    assert [(e.type, e.reason) for e in evicted.events] == [("Warning", "Evicted")]
    again = decide(observed(queue=admitted, job=JobState(suspended=True), previous=evicted.status))
    assert again.status.phase == "Generating" and not again.suspend_job


def test_a_suspended_run_shows_its_workload_until_it_is_given_up():
    stopping = decide(observed(queue=queued(admitted=True, pods_left=1), suspended=True))
    assert stopping.status.phase == "Suspended" and stopping.status.queue.workload == "b5-run"
    gone = decide(observed(queue=QueueState(queue="gpu-queue", workload="b5-run"), suspended=True))
    assert gone.status.queue is None


def test_a_succeeded_run_is_settled_only_once_its_workload_is_gone():
    from tokenmill_operator.decide.status import QueueStatus
    from tokenmill_operator.reconcile import settled

    body = {"metadata": {"generation": 3}}
    done = DatasetGenerationStatus(phase="Succeeded", observed_generation=3)
    assert settled(body, done)
    holding = done.model_copy(update={"queue": QueueStatus(name="gpu-queue", workload="b5-run")})
    assert not settled(body, holding)


def test_status_without_the_queue_label_is_unchanged():
    decision = decide(Observed(generation=1, now=T0, suspended=False, previous=DatasetGenerationStatus(),
                               plan=PLAN, server=ServerState(1, 1)))
    assert decision.status.queue is None and decision.status.phase == "Generating"


def test_tokenmill_plan_lists_the_workload_and_the_cache_objects(tmp_path, capsys, kimi_files):
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "gpu-queue"}
    document["spec"]["model"]["cache"] = {"mode": "sharedVolume", "storageClass": "nfs"}
    path = tmp_path / "queued.yaml"
    path.write_text(yaml.safe_dump(document))
    assert cli.main(["plan", str(path), "--model-files", str(kimi_files), "--json"]) == 0
    kinds = [o["kind"] for o in json.loads(capsys.readouterr().out)["objects"]]
    assert kinds[:3] == ["Workload", "PersistentVolumeClaim", "Job"] and kinds.count("Job") == 2


def test_a_workload_in_another_queue_than_the_label_is_left_like_an_eviction():
    # On a87e82b the label moved to another LocalQueue kept the run admitted by the first, and its status named a
    # queue it was never admitted by.
    current = run_workload()
    current["status"] = {"admission": {"clusterQueue": "gpus"}, "conditions": [cond("QuotaReserved"),
                                                                                cond("Admitted")]}
    moved = kueue.run_workload("b5", "team-a", OWNER, "cheap-queue", spec(), PLAN, "runner:1")
    state = kueue.queue_state("cheap-queue", moved, current, [])
    assert state.leaving and not state.admitted and state.exists
    assert "from LocalQueue gpu-queue to cheap-queue" in state.message
    removed = kueue.left(kueue.queue_state("gpu-queue", run_workload(), current, []))
    assert removed.leaving and not removed.admitted and "label was removed" in removed.message


def test_a_run_leaving_its_queue_stops_its_pods_first():
    running = decide(observed(queue=queued(admitted=True, position=None, message="admitted"), job=JobState(active=4)))
    leaving = decide(observed(queue=queued(leaving=True, position=None, pods_left=5, message="label was removed"),
                              job=JobState(active=4), previous=running.status))
    assert leaving.status.phase == "Queued" and leaving.server_replicas == 0 and leaving.suspend_job
    assert not leaving.delete_server and leaving.status.report is None
    assert [(e.type, e.reason) for e in leaving.events] == [("Warning", "LeavingQueue")]


class Recorder:
    """A Kube that answers from a dict and records every write (the reconcile pass's queue steps)."""

    def __init__(self, objects: dict[tuple[str, str], dict]) -> None:
        self.objects, self.writes = objects, []

    def get(self, api_version, kind, name, namespace):
        return self.objects.get((kind, name))

    def list(self, api_version, kind, namespace, labels):
        return [o for (k, _), o in self.objects.items() if k == kind
                and labels.items() <= ((o.get("metadata") or {}).get("labels") or {}).items()]

    def delete(self, api_version, kind, name, namespace, propagation="Background"):
        self.writes.append(("delete", kind, name))
        return self.objects.pop((kind, name), None) is not None

    def create_if_absent(self, manifest):
        self.writes.append(("create", manifest["kind"], manifest["metadata"]["name"]))

    def patch_status(self, *args):
        self.writes.append(("patch_status",) + args[:3])


def _removed_label_context(queue_status):
    from tokenmill_operator.decide.facts import Context
    from tokenmill_operator.decide.status import QueueStatus

    body = {"metadata": {"name": "b5", "namespace": "team-a", "uid": "u-1", "labels": {}}, "spec": {}}
    previous = DatasetGenerationStatus(phase="Generating", queue=QueueStatus(**queue_status))
    return Context(body=body, name="b5", namespace="team-a", generation=1, spec=spec(), previous=previous)


def test_removing_the_label_keeps_the_workload_until_the_pods_are_gone():
    # security-a87e82b.md B5: on a87e82b the Workload was deleted in the same pass (reconcile.py:399) while the
    # server kept its GPUs, so Kueue counted them free.
    from tokenmill_operator.act.children import apply_queueing
    from tokenmill_operator.decide.settings import OperatorSettings
    from tokenmill_operator.reconcile import _queueing

    admitted = run_workload()
    admitted["status"] = {"conditions": [cond("QuotaReserved"), cond("Admitted")]}
    from tokenmill_operator.decide import names

    pod = {"metadata": {"labels": names.selector_labels("b5", names.SERVER_COMPONENT)}, "status": {"phase": "Running"}}
    kube = Recorder({("Workload", "b5-run"): admitted, ("Pod", "b5-server-0"): pod})
    context = _removed_label_context({"name": "gpu-queue", "workload": "b5-run", "admitted": True})
    queueing = _queueing(kube, context, PLAN, OperatorSettings())
    assert queueing is not None and queueing.state.leaving and queueing.state.pods_left == 1
    decision = decide(observed(queue=queueing.state, job=JobState(active=4)))
    assert decision.server_replicas == 0 and decision.suspend_job
    apply_queueing(kube, context, decision, queueing, T0)
    assert kube.writes == [], "the Workload stays while a pod holds what it counted"
    del kube.objects[("Pod", "b5-server-0")]
    apply_queueing(kube, context, decision, _queueing(kube, context, PLAN, OperatorSettings()), T0)
    assert kube.writes == [("delete", "Workload", "b5-run")]
    assert _queueing(kube, context, PLAN, OperatorSettings()) is None, "then the run is outside Kueue"


def test_an_operator_that_requires_a_queue_refuses_a_run_without_one():
    import pytest

    from tokenmill_operator.decide.settings import OperatorSettings
    from tokenmill_operator.reconcile import QueueRequired, _queueing

    required = OperatorSettings(require_queue=True)
    context = _removed_label_context({"name": "gpu-queue", "workload": "b5-run"})
    with pytest.raises(QueueRequired, match="kueue.x-k8s.io/queue-name=<LocalQueue>"):
        _queueing(Recorder({}), context, PLAN, required)  # its Workload given back: refused from now on
    assert OperatorSettings.__dataclass_fields__["require_queue"].default is False


def test_a_layout_switch_queues_the_run_again_for_its_new_pods_and_a_states_pass_does_not():
    """replan auto or a trial switches 1 x TP 8 to 8 x TP 1: other pods, other quota, so the admitted Workload is
    outdated and the run queues again for the new layout (stopped first: Kueue's quota is given back only once the
    pods are gone). The next hidden-state pass changes only SGLang's flags, which Kueue does not count."""
    current = run_workload(parallelism=4)
    current["status"] = {"conditions": [cond("QuotaReserved"), cond("Admitted")]}
    switched = PLAN.model_copy(update={"replicas": 8, "tensor_parallel": 1, "gpus_per_node": 1})
    desired = kueue.run_workload("b5", "team-a", OWNER, "gpu-queue", spec(parallelism=4), switched, "runner:1")
    server = desired["spec"]["podSets"][0]
    assert server["count"] == 8
    assert server["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "1"
    state = kueue.queue_state("gpu-queue", desired, current, [])
    assert state.reshaped and not state.admitted and "switch to another layout" in state.message
    decision = decide(observed(job=JobState(active=4), queue=state))
    assert decision.server_replicas == 0 and decision.suspend_job, "stopped before the Workload is replaced"

    from tokenmill_operator.decide import manifests

    document = yaml.safe_load(EXAMPLE.read_text())["spec"]
    two_passes = DatasetGenerationSpec.model_validate({**document, "hiddenStates": {"layouts": ["specforge"]}})
    aux, final = (manifests.server_statefulset("b5", "team-a", OWNER, two_passes, PLAN, states_kind=kind)["spec"]
                  ["template"] for kind in ("aux", "final"))
    assert aux["spec"]["containers"][0]["args"] != final["spec"]["containers"][0]["args"]
    assert kueue.pod_set("server", 1, aux) == kueue.pod_set("server", 1, final)
