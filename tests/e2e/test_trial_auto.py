"""spec.server.trial auto on the real control plane: the plan's closest layouts (2 x TP 4, 4 x TP 2, 8 x TP 1 for
Qwen3-30B-A3B on eight H200s) are run one after another, each measured on the server's /metrics until the trial's
rules stop it; every step rolls the StatefulSet to that layout and replaces the runner Job, and the run continues
on the one measured fastest, completing with every slot committed exactly once across the switches.

Under kwok no container runs: the test plays the server as one simulator standing for the whole server of the
layout the StatefulSet has now (its step: a replica's true step at its share of the batch, TrueStep below),
restarted on the same port whenever the StatefulSet's layout changes, with a steady load beside the runner (more
requests than the simulator's slots, so the batch is full and requests queue, as the trial's warm-up rule wants).
Each candidate's Job carries its stratified sample (--trial-sample; the first Job, made before the trial began, is
replaced by the first candidate's). The first candidate's workers are played during its measurement and stopped at
its switch, as a deleted pod's would be; the Job the trial continues on is played to the end. The simulator's clock runs TIME_SCALE times the wall
clock, and so does the trial's (TOKENMILL_TRIAL_CLOCK_SCALE), so the rules' minutes pass in seconds."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from kubernetes import client as k8s

from tokenmill_runner.facts.throughput import CALIBRATION, StepModel
from tokenmill_runner.spec.config import TrialSample

from .operator_kit import (  # noqa: F401  (fixtures)
    NAME,
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
    s3_world,
    wait_phase,
)
from .test_replan_auto import (
    QWEN_PREFIX,
    ROWS,
    TRUTH,
    MetricsGate,
    _held_pods_of,
    _job,
    _load,
    _qwen_world,
    _simulator,
    _slots,
    _stop,
)

pytestmark = pytest.mark.e2e

TIME_SCALE = 10.0
SLOTS = 16  # the simulator's running requests; the load keeps more in flight, so some queue


@dataclass(frozen=True)
class WholeServer:
    """The simulator as the whole server of `replicas` replicas: `running` requests spread over them, each replica's
    decode step the planner's step model of that layout on the hidden truth's constants (collectives 10x)."""

    model: StepModel
    replicas: int
    depends_on_kv: ClassVar[bool] = True

    def decode_seconds(self, running: int, kv_tokens: int) -> float:
        share = max(1, round(running / self.replicas))
        return self.model.step_seconds(share, kv_tokens / max(running, 1))

    def prefill_seconds(self, tokens: int) -> float:
        return self.model.prefill_seconds(tokens, 300) / self.replicas if tokens else 0.0


def _layout(cluster, namespace: str) -> tuple[int, int] | None:
    """(replicas, tp) of the StatefulSet once it has rolled to its template (what the operator waits for too)."""
    found = cluster.api(k8s.AppsV1Api).read_namespaced_stateful_set(f"{NAME}-server", namespace)
    status = found.status
    if not found.spec.replicas or (status.observed_generation or 0) < found.metadata.generation:
        return None
    args = found.spec.template.spec.containers[0].args
    return found.spec.replicas, int(args[args.index("--tp-size") + 1])


def _sample(job: k8s.V1Job) -> TrialSample | None:
    """The stratified sample the Job's workers send first (--trial-sample), if any."""
    args = job.spec.template.spec.containers[0].args
    return TrialSample.parse(args[args.index("--trial-sample") + 1]) if "--trial-sample" in args else None


class PlayedServer:
    """Keeps one simulator on `port` for the StatefulSet's current layout, replacing it when the layout changes;
    `finish` swaps in a fast one for the rest of the run (what runs after the trial is not measured)."""

    def __init__(self, cluster, namespace: str, port: int, steps: dict[tuple[int, int], WholeServer]) -> None:
        self.cluster, self.namespace, self.port, self.steps = cluster, namespace, port, steps
        self.layouts: list[tuple[int, int]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.server: Any = None

    def _replace(self, server: Any) -> None:
        with self.lock:
            if self.server is not None:
                self.server.__exit__(None, None, None)
            self.server = server
            server.__enter__()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                layout = _layout(self.cluster, self.namespace)
            except k8s.ApiException:
                layout = None
            if layout is not None and layout in self.steps and (not self.layouts or self.layouts[-1] != layout):
                self._replace(_simulator(self.cluster, self.namespace, self.port, TIME_SCALE, self.steps[layout],
                                         SLOTS))
                self.layouts.append(layout)
            self.stop.wait(0.5)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self._replace(_simulator(self.cluster, self.namespace, self.port, 5000.0, None, SLOTS))

    def __enter__(self) -> PlayedServer:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        with self.lock:
            if self.server is not None:
                self.server.__exit__(None, None, None)


def test_the_trial_measures_each_close_layout_and_continues_on_the_fastest_with_every_slot_once(
        cluster, namespace, operator, credentials, s3_world, tmp_path: Path):
    from tokenmill_operator.decide.planner import ServerPlan, model_facts, plan_step_model
    from tokenmill_operator.decide.planner.verify import pinned_spec
    from tokenmill_runner.spec.resource import parse_document

    fixture = _qwen_world(s3_world)
    port, gate = free_port(), free_port()
    operator.stop()
    operator.env["TOKENMILL_SERVER_METRICS_URL"] = f"http://127.0.0.1:{gate}"
    operator.env["TOKENMILL_TRIAL_CLOCK_SCALE"] = str(TIME_SCALE)
    operator.start()
    # A job of 1,000,000 samples (the limit; the source has 75 rows) is planned at 41,507 s, so 5 % of it pays for
    # two alternatives; the run itself is the 75 rows.
    resource = b5_resource(namespace, s3_world, **{
        "model.path": f"s3://models/{QWEN_PREFIX}", "server.trial": "auto", "server.replan": "off",
        "datasets.0.limit": 1_000_000, "runner.parallelism": 2, "runner.shardMaxSamples": 4,
        "runner.shardMaxSeconds": 1})
    spec = parse_document(resource).spec
    cluster.apply(resource)
    generating = wait_phase(cluster, namespace, "Generating", timeout=120)
    trial = cluster.wait_for(lambda: (dsgen(cluster, namespace).get("status") or {}).get("trial"), "status.trial",
                             timeout=60)
    assert trial["phase"] == "Measuring", trial.get("reason")
    layouts = [(c["replicas"], c["tensorParallel"]) for c in trial["candidates"]]
    assert layouts == [(2, 4), (4, 2), (8, 1)], trial["candidates"]

    facts = model_facts(fixture["config"], fixture["weight_bytes"])
    driver = ServerPlan.model_validate(generating["status"]["serverPlan"]).cuda_driver_major
    steps = {}
    for replicas, tp in layouts:
        model = plan_step_model(pinned_spec(spec, (replicas, tp, 1, "auto")), facts, driver, CALIBRATION)
        assert model is not None
        steps[(replicas, tp)] = WholeServer(replace(model, calibration=TRUTH.calibration(CALIBRATION)), replicas)

    # The first candidate's Job sends its stratified sample first: a Job made before the trial began is replaced.
    first_job = cluster.wait_for(lambda: job if (job := _job(cluster, namespace)) is not None and
                                 _sample(job) is not None else None, "the first candidate's runner Job", timeout=90)
    sample = _sample(first_job)
    assert sample is not None and (sample.candidate, sample.candidates, sample.seed) == (0, 3, str(trial["generation"]))
    assert sample.prompts == trial["samplePrompts"] > 0
    work = tmp_path / "pods"
    work.mkdir()
    load = threading.Event()
    with PlayedServer(cluster, namespace, port, steps) as played, MetricsGate(gate, f"http://127.0.0.1:{port}") as metrics:
        cluster.wait_for(lambda: played.server if played.layouts else None, "the simulator of the first layout",
                         timeout=60)
        api_key = played.server.config.api_key
        pods = cluster.wait_for(lambda: _held_pods_of(cluster, namespace, first_job.metadata.uid, 2),
                                "the first Job's two held runner pods", timeout=90)
        old = [play_pod(cluster, namespace, pod, played.server.url, work) for pod in pods]
        ramp = threading.Thread(target=_load, args=(f"http://127.0.0.1:{port}", api_key, load, 2 * SLOTS),
                                daemon=True)
        try:
            cluster.wait_for(lambda: len(_slots(s3_world, namespace)) >= 4 or None, "4 committed slots", timeout=120)
            metrics.open()
            ramp.start()

            def switched_away() -> bool | None:
                candidates = (dsgen(cluster, namespace).get("status") or {}).get("trial", {}).get("candidates", [])
                return True if candidates and candidates[0]["state"] == "Measured" else None

            cluster.wait_for(switched_away, "the first candidate measured", timeout=240)
        finally:
            _stop(old)  # the switch deletes the first Job: its pods are stopped, their finished samples committed
        before = _slots(s3_world, namespace)

        def concluded() -> dict[str, Any] | None:
            obj = dsgen(cluster, namespace)
            return obj if (obj.get("status") or {}).get("trial", {}).get("phase") != "Measuring" else None

        obj = cluster.wait_for(concluded, "the trial's conclusion", timeout=480)
        load.set()
        ramp.join(timeout=60)
        trial = obj["status"]["trial"]
        assert trial["phase"] == "Done", trial["reason"]
        assert all(c["state"] == "Measured" and (c.get("tokensPerSecond") or 0) > 0 for c in trial["candidates"]), \
            json.dumps(trial)
        measured = {c["layout"]: c["tokensPerSecond"] for c in trial["candidates"]}
        assert trial["winner"] == max(measured, key=lambda layout: measured[layout]), measured
        trialled = condition(obj, "Trialled")
        assert trialled is not None and trialled["status"] == "True", trialled
        # Every candidate ran on its own layout, in order: the StatefulSet rolled to each.
        assert played.layouts[:3] == layouts, played.layouts
        winner = next(c for c in trial["candidates"] if c["layout"] == trial["continuedOn"])

        # The run continues on it: its Job's workers resume from the ledger and finish the 75 rows.
        def continued_job() -> k8s.V1Job | None:
            job = _job(cluster, namespace)
            state = _layout(cluster, namespace)
            if job is None or job.metadata.uid == first_job.metadata.uid or state is None:
                return None
            return job if state == (winner["replicas"], winner["tensorParallel"]) and \
                dsgen(cluster, namespace)["status"].get("trial", {}).get("phase") == "Done" else None

        last_job = cluster.wait_for(continued_job, "the runner Job on the layout the trial continued on", timeout=180)
        # The run continues on the last candidate measured: its Job goes on, sample and all; on another it sends none.
        last_sample = _sample(last_job)
        if trial["continuedOn"] == trial["candidates"][-1]["layout"]:
            assert last_sample is not None and last_sample.candidate == 2 and last_sample.seed == sample.seed
        else:
            assert last_sample is None
        pods = cluster.wait_for(lambda: _held_pods_of(cluster, namespace, last_job.metadata.uid, 2),
                                "the last Job's two held runner pods", timeout=120)
        played.finish()
        new = [(pod, play_pod(cluster, namespace, pod, played.server.url, work)) for pod in pods]
        for pod, process in new:
            code = process.wait(timeout=300)
            assert code == 0, (work / f"{pod.metadata.name}.log").read_text()[-3000:]
            release_pod(cluster, namespace, pod)
        done = wait_phase(cluster, namespace, "Succeeded", timeout=180)

    counted = _slots(s3_world, namespace)
    assert [slot for slot, n in counted.items() if n > 1] == [], "slots committed twice"
    assert set(counted) == {(line, 0) for line in range(1, ROWS + 1)}
    assert before and len(before) < ROWS  # the first layout's workers committed a part, the rest came after
    from .operator_kit import committed_ids

    ids = committed_ids(s3_world, namespace)
    assert set(ids) == expected_ids() and set(ids.values()) == {1}
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                             f"involvedObject.name={NAME},reason=Trialled", "-o", "name").stdout.split()
    assert len(events) == 1
    assert done["status"]["trial"]["continuedOn"] == trial["continuedOn"]
