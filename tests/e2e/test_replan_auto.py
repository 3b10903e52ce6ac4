"""spec.server.replan auto on the real control plane: the simulator stands in for SGLang with a hidden "true" step
model unlike the planner's (collectives 10x the published cost over the plan's NVLink), the operator reads its
/metrics through the verification window, refits, finds that eight TP 1 replicas finish the remaining work sooner
than the planned two TP 4 ones by more than the restart plus the margin, and switches: the server is rebuilt from
that layout, the runner Job replaced, and the run completes with every slot committed exactly once across the switch.
The switched layout is then checked in its own window (one TP 1 replica on the same truth): PlanVerified, its step
compared at the context the server reports.

Under kwok no container runs, so the test plays the runner pods (operator_kit.play_pod) and the server (the
simulator on one port that TOKENMILL_SERVER_METRICS_URL and every --server point at). At the switch the old
runner processes get the SIGTERM their deleted pods would, and the old server is replaced by a new one (a fast
simulator: what runs after the switch is not measured again)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from kubernetes import client as k8s

from tokenmill_runner.facts.refit import Refit
from tokenmill_runner.facts.throughput import CALIBRATION, StepModel
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.storage import open_storage, s3_client

from .conftest import HOLD_LABEL, REPO
from .operator_kit import (  # noqa: F401  (fixtures)
    NAME,
    PROMPTS,
    _b64,
    b5_resource,
    condition,
    crd,
    credentials,
    dsgen,
    expected_ids,
    free_port,
    operator,
    play_pod,
    release_pod,
    runner_pods,
    s3_world,
    wait_phase,
)

pytestmark = pytest.mark.e2e

QWEN_PREFIX = "Qwen/Qwen3-30B-A3B/"
# The hidden truth: collectives cost 10x the published fit on this cluster's links.
TRUTH = Refit(1.0, 10.0, 1.0, samples=0, error_before=0, error_after=0, fitted=())
ROWS = sum(1 for line in PROMPTS.read_bytes().splitlines() if line.strip())


@dataclass(frozen=True)
class TrueStep:
    """The simulator's step time (tokenmill_sim.capacity.StepTime) from the planner's step model of the running
    layout on the hidden truth's constants: what the GPUs would really do."""

    model: StepModel
    depends_on_kv: ClassVar[bool] = True

    def decode_seconds(self, running: int, kv_tokens: int) -> float:
        return self.model.step_seconds(max(running, 1), kv_tokens / max(running, 1))

    def prefill_seconds(self, tokens: int) -> float:
        return self.model.prefill_seconds(tokens, 300) if tokens else 0.0  # the ramp's and the demo's prompts


def _qwen_world(endpoint: str) -> dict[str, Any]:
    """Qwen3-30B-A3B's config.json and weight index under models/, with the demo tokenizer (what the runner reads)."""
    fixture = json.loads((REPO / "tests" / "fixtures" / "models" / "qwen3-30b-a3b.json").read_text())
    s3 = s3_client(endpoint)
    s3.put_object(Bucket="models", Key=QWEN_PREFIX + "config.json", Body=json.dumps(fixture["config"]).encode())
    s3.put_object(Bucket="models", Key=QWEN_PREFIX + "model.safetensors.index.json",
                  Body=json.dumps({"metadata": {"total_size": fixture["weight_bytes"]}}).encode())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        s3.put_object(Bucket="models", Key=QWEN_PREFIX + name,
                      Body=(REPO / "examples" / "demo-model" / name).read_bytes())
    return fixture


def _simulator(cluster, namespace: str, port: int, time_scale: float, step_time: Any = None,
               max_running_requests: int = 256):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    secret = cluster.core.read_namespaced_secret(f"{NAME}-server-key", namespace)
    config = SimConfig(model_path=str(REPO / "examples" / "demo-model"), api_key=_b64(secret.data["api-key"]),
                       context_length=262144, time_scale=time_scale, max_running_requests=max_running_requests)
    return SimServer(config, port=port, step_time=step_time)


def _ramp(url: str, api_key: str, stop: threading.Event, levels: tuple[int, ...], hold_s: float,
          max_new_tokens: int = 64) -> None:
    """Requests in flight rising 1, 2, 4, 8 (hold_s each): the distinct batches the refit needs to tell the
    collectives (linear in the batch) from the expert reads (saturating), as the unit tests' ramp."""
    body = {"input_ids": list(range(100, 400)),
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}

    def one() -> None:
        with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {api_key}"}) as client:
            while not stop.is_set():
                try:
                    client.post("/generate", json=body)
                except httpx.HTTPError:  # the simulator is being replaced for the next layout
                    stop.wait(0.05)

    threads: list[threading.Thread] = []
    for level in levels:
        while len(threads) < level:
            threads.append(threading.Thread(target=one, daemon=True))
            threads[-1].start()
        if stop.wait(hold_s):
            break
    stop.wait()  # the threads end at their next request once stopped


def _load(url: str, api_key: str, stop: threading.Event, in_flight: int) -> None:
    """`in_flight` requests at all times, each long (4,096 tokens: seconds of wall time even on the fastest layout),
    so the client's own overhead never empties the simulator's queue and every candidate's batch stays full."""
    _ramp(url, api_key, stop, (in_flight,), 0.0, max_new_tokens=4096)


class MetricsGate:
    """The server's /metrics as the operator reaches it (TOKENMILL_SERVER_METRICS_URL): unreachable (503) until
    opened, then the simulator's. The window opens with the first scrape that shows running requests, so the test
    decides when it starts: after the old layout's workers committed a first part."""

    def __init__(self, port: int, target: str) -> None:
        self.port, self.target, self.opened = port, target, threading.Event()

    def open(self) -> None:
        self.opened.set()

    def __enter__(self) -> MetricsGate:
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body, code = b"", 503
                if gate.opened.is_set():
                    answer = httpx.get(gate.target + self.path, timeout=5)
                    body, code = answer.content, answer.status_code
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _job(cluster, namespace: str) -> k8s.V1Job | None:
    try:
        return cluster.api(k8s.BatchV1Api).read_namespaced_job(f"{NAME}-runner", namespace)
    except k8s.ApiException as error:
        if error.status == 404:
            return None
        raise


def _held_pods_of(cluster, namespace: str, job_uid: str, count: int) -> list[k8s.V1Pod] | None:
    pods = [p for p in runner_pods(cluster, namespace) if p.status.phase == "Running"
            and (p.metadata.labels or {}).get(HOLD_LABEL) == "true" and p.metadata.deletion_timestamp is None
            and (p.metadata.labels or {}).get("batch.kubernetes.io/controller-uid") == job_uid]
    return pods if len(pods) >= count else None


def _slots(endpoint: str, namespace: str) -> Counter[tuple[int, int]]:
    """Every (line, sample index) the commit markers name, done or failed (test_lease_races.slots)."""
    storage = open_storage(f"s3://tokenmill-data/runs/{namespace}/", endpoint)
    counted: Counter[tuple[int, int]] = Counter()
    for marker in read_markers(storage, "B5_openthoughts"):
        for part in (marker["samples"], marker["failed"]):
            counted.update(zip(part["line"], part.get("sample_index") or [0] * len(part["line"]), strict=True))
    return counted


def _stop(processes: list[subprocess.Popen]) -> None:
    """What the kubelet does to a deleted pod: SIGTERM, then SIGKILL after the grace period."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_auto_replan_switches_the_layout_on_the_measured_truth_and_every_slot_is_committed_once(
        cluster, namespace, operator, credentials, s3_world, tmp_path: Path):
    from tokenmill_operator.decide.planner import model_facts, plan_step_model
    from tokenmill_operator.decide.planner.verify import pinned_spec
    from tokenmill_operator.decide.status import LayoutOverride
    from tokenmill_runner.spec.resource import parse_document

    fixture = _qwen_world(s3_world)
    port, gate = free_port(), free_port()
    operator.stop()
    operator.env["TOKENMILL_SERVER_METRICS_URL"] = f"http://127.0.0.1:{gate}"
    operator.env["TOKENMILL_OPERATOR_NAMESPACE"] = namespace
    operator.start()
    # The plan's job is 100,000 samples (the limit; the source has 75 rows), so its remaining ETA is hours and a
    # faster layout pays the restart: the switch is decided on the plan's figures, the run is the 75 rows.
    resource = b5_resource(namespace, s3_world, **{
        "model.path": f"s3://models/{QWEN_PREFIX}", "server.replan": "auto", "server.verifyWindowSeconds": 8,
        "datasets.0.limit": 100_000, "runner.parallelism": 2, "runner.shardMaxSamples": 4,
        "runner.shardMaxSeconds": 1})
    spec = parse_document(resource).spec
    cluster.apply(resource)
    generating = wait_phase(cluster, namespace, "Generating", timeout=120)
    plan = generating["status"]["serverPlan"]
    assert (plan["replicas"], plan["tensorParallel"]) == (2, 4), plan["reasoning"][:3]
    first_job = cluster.wait_for(lambda: _job(cluster, namespace), "the first runner Job", timeout=60)

    from tokenmill_operator.decide.planner import ServerPlan

    running = ServerPlan.model_validate(plan)
    facts = model_facts(fixture["config"], fixture["weight_bytes"])
    step = plan_step_model(spec, facts, running.cuda_driver_major, CALIBRATION)
    assert step is not None
    truth = TrueStep(replace(step, calibration=TRUTH.calibration(CALIBRATION)))

    work = tmp_path / "pods"
    work.mkdir()
    stop = threading.Event()
    # Simulated time runs 10x the wall clock: the old layout's runners commit some of the 75 samples before and
    # inside the window, not all of them.
    slow = _simulator(cluster, namespace, port, time_scale=10.0, step_time=truth)
    with slow, MetricsGate(gate, slow.url) as metrics:
        pods = cluster.wait_for(lambda: _held_pods_of(cluster, namespace, first_job.metadata.uid, 2),
                                "the first Job's two held runner pods", timeout=90)
        old = [play_pod(cluster, namespace, pod, slow.url, work) for pod in pods]
        try:
            # The old layout's workers commit a first part; then the window opens (the server's /metrics becomes
            # reachable) on the ramp's batches with the workers still running.
            cluster.wait_for(lambda: len(_slots(s3_world, namespace)) >= 8 or None, "8 committed slots",
                             timeout=120)
            metrics.open()
            ramp = threading.Thread(target=_ramp, args=(slow.url, slow.config.api_key, stop, (1, 2, 4, 8), 1.5),
                                    daemon=True)
            ramp.start()

            def switched() -> dict[str, Any] | None:
                obj = dsgen(cluster, namespace)
                found = condition(obj, "Replanned")
                return obj if found is not None else None

            obj = cluster.wait_for(switched, "the Replanned condition", timeout=120)
        finally:
            # The operator suspends and deletes the old Job: its pods are stopped, and finished samples committed.
            _stop(old)
            stop.set()
    before = _slots(s3_world, namespace)
    assert before and all(n == 1 for n in before.values())

    replanned = condition(obj, "Replanned")
    assert (replanned["status"], replanned["reason"]) == ("True", "FasterLayoutMeasured"), replanned["message"]
    override = obj["status"]["layoutOverride"]
    assert (override["fromLayout"], override["toLayout"]) == ("2 x TP 4", "8 x TP 1")
    assert override["generation"] == obj["metadata"]["generation"]
    assert override["gainSeconds"] > override["restartSeconds"] + override["marginSeconds"]
    assert replanned["message"].startswith("switched from 2 x TP 4 to 8 x TP 1: remaining ETA")
    new_plan = obj["status"]["serverPlan"]
    assert (new_plan["replicas"], new_plan["tensorParallel"], new_plan["gpusPerNode"]) == (8, 1, 1)
    assert new_plan["reasoning"][0].startswith("switched by the operator (spec.server.replan auto)")
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                             f"involvedObject.name={NAME}").stdout
    assert "Replanned" in events and "ConstantsMeasured" in events

    # The server is rebuilt from the switched plan: eight pods of one GPU, --tp-size 1.
    def rolled() -> k8s.V1StatefulSet | None:
        found = cluster.api(k8s.AppsV1Api).read_namespaced_stateful_set(f"{NAME}-server", namespace)
        return found if found.spec.replicas == 8 else None

    statefulset = cluster.wait_for(rolled, "the server StatefulSet at 8 replicas", timeout=60)
    container = statefulset.spec.template.spec.containers[0]
    args = container.args
    assert args[args.index("--tp-size") + 1] == "1"
    assert container.resources.limits["nvidia.com/gpu"] == "1"

    # The runner Job is replaced (its hash carries the switch); the new one's workers resume from the ledger.
    def replaced() -> k8s.V1Job | None:
        job = _job(cluster, namespace)
        return job if job is not None and job.metadata.uid != first_job.metadata.uid else None

    second_job = cluster.wait_for(replaced, "the runner Job built for the new layout", timeout=180)
    runner_args = second_job.spec.template.spec.containers[0].args
    servers = [a for i, a in enumerate(runner_args) if i > 0 and runner_args[i - 1] == "--server"]
    assert len(servers) == 8
    pods = cluster.wait_for(lambda: _held_pods_of(cluster, namespace, second_job.metadata.uid, 2),
                            "the new Job's two held runner pods", timeout=120)

    # The switched layout is a plan of its own: checked again in its own window. The simulator now stands for one
    # of the eight TP 1 replicas on the same hidden truth, its slots the switched plan's batch, kept full by a load
    # of twice that (the runner pods stay held meanwhile, so the Job runs and nothing of the 75 rows is measured).
    switched = ServerPlan.model_validate(new_plan)
    assert switched.prediction is not None
    batch = switched.prediction.batch_per_replica
    model = plan_step_model(pinned_spec(spec, (8, 1, 1, "auto")), facts, running.cuda_driver_major, CALIBRATION)
    assert model is not None
    one_replica = TrueStep(replace(model, calibration=TRUTH.calibration(CALIBRATION)))
    load = threading.Event()
    with _simulator(cluster, namespace, port, 10.0, one_replica, batch) as measured, \
            MetricsGate(gate, measured.url) as metrics:
        filler = threading.Thread(target=_load, args=(measured.url, measured.config.api_key, load, 2 * batch),
                                  daemon=True)
        filler.start()
        metrics.open()
        token = LayoutOverride.model_validate(override).token

        def rechecked() -> dict[str, Any] | None:
            obj = dsgen(cluster, namespace)
            return obj if (obj["status"].get("verification") or {}).get("layout") == token else None

        try:
            checked = cluster.wait_for(rechecked, "the switched layout's verification", timeout=180)
        finally:
            load.set()
            filler.join(timeout=60)
    # The first window found the spec's plan off (collectives 10x); the switched plan, made with the constants that
    # window measured, is verified on the same truth: batch and step within 15 %.
    verification = checked["status"]["verification"]
    assert verification["plannedGeneration"] == override["generation"]
    verified = condition(checked, "PlanVerified")
    assert verified is not None and (verified["status"], verified["reason"]) == ("True", "PlanVerified"), \
        (verified, verification)
    assert verification["verified"] and verification["predictedBatch"] == batch, verification
    assert f"batch predicted {batch:,.0f}" in verified["message"], verified["message"]
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                             f"involvedObject.name={NAME}", "-o", "json").stdout
    reasons = Counter(item["reason"] for item in json.loads(events)["items"])
    assert reasons["PlanOff"] == 1 and reasons["PlanVerified"] == 1, reasons
    # Switched once per generation: the second check does not switch again.
    assert checked["status"]["layoutOverride"] == override

    with _simulator(cluster, namespace, port, time_scale=5000.0) as fast:
        new = [(pod, play_pod(cluster, namespace, pod, fast.url, work)) for pod in pods]
        for pod, process in new:
            code = process.wait(timeout=300)
            assert code == 0, (work / f"{pod.metadata.name}.log").read_text()[-3000:]
            release_pod(cluster, namespace, pod)
        done = wait_phase(cluster, namespace, "Succeeded", timeout=180)

    # Exactly once across the switch: every slot of the 75 rows in one marker, none twice, and each sample id once.
    counted = _slots(s3_world, namespace)
    assert [slot for slot, n in counted.items() if n > 1] == [], "slots committed twice"
    assert set(counted) == {(line, 0) for line in range(1, ROWS + 1)}
    assert len(before) < ROWS  # some of the work was left for the new layout
    assert done["status"]["progress"]["completed"] + done["status"]["progress"]["failed"] == ROWS
    from .operator_kit import committed_ids

    ids = committed_ids(s3_world, namespace)
    assert set(ids) == expected_ids() and set(ids.values()) == {1}
    # Switched once: the override still names the generation and the layout, and no second Replanned event.
    assert done["status"]["layoutOverride"]["toLayout"] == "8 x TP 1"
    replanned_events = [line for line in cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={NAME},reason=Replanned",
        "-o", "name").stdout.splitlines() if line.strip()]
    assert len(replanned_events) == 1
