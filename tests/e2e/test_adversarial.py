"""One operator, two tenants, on the real control plane: an attacker namespace runs each break of the audit of f9665d2
(security-f9665d2.md) against a victim namespace, all at once, and the victim does not notice.

One module, one operator, shared namespaces; each test brings its attack's resources and takes them away after. The
victim's resource is suspended (its plan is made, nothing runs); it is asked for a pass by a spec edit, and each
pass must follow within 10 s of being asked (on f9665d2, four resources of the attacker's held all four reconcile
threads: the victim's pass was not run 151 s later). Its plan, remade for every edit, must stay what it was (B2 moved
it to a 32 % slower layout). The operator's peak RSS must stay under 512 MiB (B5-B7 took it past 2 GB), and no
request may leave for an address the victim's spec did not name (B4).

Under kwok no server container runs: every server's /metrics is this test's HTTP server, one path per resource
(TOKENMILL_SERVER_METRICS_URL with {namespace} and {name}), where the attacker's pods answer as it likes. The
attacker's own S3 endpoint is a socket that answers one byte at a time.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import pytest
from kubernetes import client as k8s

from tokenmill_operator.decide import cache
from tokenmill_operator.decide.planner import ServerPlan, model_facts, plan_step_model
from tokenmill_operator.decide.planner.verify import CONFIGMAP_NAME, pinned_spec, running_layout
from tokenmill_runner.facts.refit import Refit
from tokenmill_runner.facts.throughput import CALIBRATION
from tokenmill_runner.spec.resource import parse_document
from tokenmill_runner.store.storage import s3_client

from ..hostile_endpoint import Endpoint, trickle
from .conftest import Cluster, _release_finalizers
from .operator_kit import (  # noqa: F401  (fixtures)
    GROUP_VERSION,
    Operator,
    _env_of,
    b5_resource,
    condition,
    crd,
    dsgen,
    s3_world,
)
from .test_replan_auto import QWEN_PREFIX, _qwen_world

pytestmark = pytest.mark.e2e

PACE_S = 10.0  # a pass of the victim follows its request within this
RSS_LIMIT = 512 * 1024 * 1024
# What the attacker's fake SGLang reports: the planner's step on expert reads 5x slower than any H200's.
POISON = Refit(0.2, 1.0, 1.0, samples=0, error_before=0, error_after=0, fitted=())
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class Metrics:
    """Every server pod's /metrics: `answers[(namespace, name)]` says how that pod answers; `seen` counts paths."""

    answers: dict[tuple[str, str], str] = field(default_factory=dict)
    seen: Counter[str] = field(default_factory=Counter)
    poison_step: Any = None
    scrapes: int = 0
    url: str = ""

    def start(self) -> ThreadingHTTPServer:
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                metrics.seen[self.path] += 1
                parts = self.path.strip("/").split("/")
                how = metrics.answers.get((parts[0], parts[1])) if len(parts) == 3 else None
                if how == "trickle":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000000")
                    self.end_headers()
                    try:
                        for _ in range(120):
                            self.wfile.write(b"#")
                            self.wfile.flush()
                            time.sleep(0.5)
                    except OSError:
                        return
                    return
                if how and how.startswith("redirect "):
                    self.send_response(302)
                    self.send_header("Location", how.split(" ", 1)[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if how == "poison" and metrics.poison_step is not None:
                    batch = BATCHES[metrics.scrapes % len(BATCHES)]
                    metrics.scrapes += 1
                    step = metrics.poison_step.step_seconds(batch, 3000)
                    body = (f"sglang:num_running_reqs {batch}\nsglang:gen_throughput {batch / step}\n"
                            f"sglang:num_used_tokens {3000 * batch}\nsglang:num_queue_reqs 0\n").encode()
                else:  # an honest, idle server
                    body = b"sglang:num_running_reqs 0\nsglang:gen_throughput 0\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@dataclass
class World:
    cluster: Cluster
    attacker: str
    victim: str
    ops: str
    operator: Operator
    metrics: Metrics
    trickle: Endpoint  # the attacker's S3 endpoint: each request answered a byte a second
    s3: str
    victim_plan: dict[str, Any]

    def resource(self, namespace: str, name: str, **changes: Any) -> dict[str, Any]:
        """A one-GPU Qwen3-30B-A3B run (so many fit the kwok nodes), one runner, its own output."""
        return b5_resource(namespace, self.s3, name, **{
            "model.path": f"s3://models/{QWEN_PREFIX}", "server.gpusPerNode": 1, "runner.parallelism": 1,
            "output.uri": f"s3://tokenmill-data/runs/{namespace}/{name}/", **changes})

    def ask_victim(self) -> float:
        """Edit the victim's spec (a new generation) and return how long its pass took to follow."""
        body = dsgen(self.cluster, self.victim, "victim")
        generation = body["metadata"]["generation"]
        stall = (body["spec"].get("runner") or {}).get("stallSeconds") or 900
        custom = self.cluster.api(k8s.CustomObjectsApi)
        asked = time.monotonic()
        custom.patch_namespaced_custom_object(*GROUP_VERSION[:2], self.victim, GROUP_VERSION[2], "victim",
                                              {"spec": {"runner": {"stallSeconds": stall + 1}}})
        self.cluster.wait_for(lambda: (dsgen(self.cluster, self.victim, "victim").get("status") or {}).get(
            "observedGeneration") == generation + 1, "the victim's pass", timeout=120, interval=0.1)
        return time.monotonic() - asked

    def victim_unchanged(self) -> None:
        status = dsgen(self.cluster, self.victim, "victim")["status"]
        assert plan_digest(status["serverPlan"]) == plan_digest(self.victim_plan), "the victim's plan moved"
        assert status["phase"] == "Suspended" and (condition({"status": status}, "Ready") or {}).get(
            "reason") not in ("ObservationFailed", "NotAllowed")

    def status(self, name: str) -> dict[str, Any]:
        return dsgen(self.cluster, self.attacker, name).get("status") or {}

    def attack(self, *names: str) -> None:
        for name in names:
            changes = {k: (self.trickle.url if v == "TRICKLE" else v) for k, v in ATTACKS[name].items()}
            self.cluster.apply(self.resource(self.attacker, name, **changes))

    def retreat(self, *names: str) -> None:
        """The attack's resources deleted, so the next attack's passes are not queued behind them."""
        self.cluster.kubectl("delete", "datasetgenerations.tokenmill.io", "-n", self.attacker, "--wait=false",
                             *names)


def plan_digest(plan: dict[str, Any]) -> tuple[Any, ...]:
    return (plan["replicas"], plan["tensorParallel"], plan.get("attentionDataParallel"), plan["gpusPerNode"],
            plan.get("image"), plan.get("measuredConstants"), plan["prediction"]["decodeTokensPerSecond"])


def _namespace(cluster: Cluster, role: str) -> str:
    name = f"e2e-adversarial-{role}-{secrets.token_hex(4)}"
    cluster.core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(
        name=name, labels={"tokenmill.io/e2e": "true"})))
    cluster.wait_for(lambda: cluster.core.read_namespaced_service_account("default", name),
                     f"the default ServiceAccount of {name}")
    return name


def _secret(cluster: Cluster, namespace: str, name: str = "s3-creds", **extra: str) -> None:
    cluster.core.create_namespaced_secret(namespace, k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name=name),
        string_data={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", **extra}))


def _forged_outputs(endpoint: str, attacker: str) -> None:
    """B5: a 105-byte run.json that says 500,000,000 rows. B6: a valid small run.json beside a checkpoint in the
    operator's name whose 1 MiB inflates to 1 GiB."""
    s3 = s3_client(endpoint)
    s3.put_object(Bucket="tokenmill-data", Key=f"runs/{attacker}/huge-rows/run.json",
                  Body=b'{"datasets": {"B5_openthoughts": {"rows": 500000000}}}')
    s3.put_object(Bucket="tokenmill-data", Key=f"runs/{attacker}/forged/run.json",
                  Body=b'{"datasets": {"B5_openthoughts": {"rows": 10}}}')
    squeeze, payload = zlib.compressobj(1), []
    zeros = bytes(1 << 20)
    for _ in range(1024):
        payload.append(squeeze.compress(zeros))
    payload.append(squeeze.flush())
    header = orjson.dumps({"arrays": [{"name": "bits", "dtype": "|u1", "count": 1 << 30}], "raw_bytes": 1 << 30,
                           "digest": "0" * 64, "dataset": "B5_openthoughts"})
    body = b"tokenmill-checkpoint\n" + len(header).to_bytes(8, "little") + header + b"".join(payload)
    s3.put_object(Bucket="tokenmill-data",
                  Key=f"runs/{attacker}/forged/B5_openthoughts/index/zzzz-9999999999-operator-ffffffff.ckpt", Body=body)


ATTACKS = {
    # B3: a store that trickles, four resources of it (the planner's config.json read never ends)
    **{f"slow-s3-{i}": {"output.endpoint": "TRICKLE"} for i in range(4)},
    # B3 and B4: server pods whose /metrics trickle, or redirect to the victim's server or an internal address
    "slow-metrics-0": {}, "slow-metrics-1": {}, "redirect-victim": {}, "redirect-internal": {},
    # B2: a GPU claimed by gpuProduct that the nodeSelector contradicts; a fake /metrics over a short window
    "lying": {"server.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}},
    "poison": {"server.verifyWindowSeconds": 8},
    # W1: its status will be patched
    "patched": {},
    # B1: the node-local fill, with a Secret that names an aws-cli config file and a Python path
    "filler": {"model.cache": {"mode": "nodeLocal"}, "output.credentialsSecret": "s3-evil"},
    # B5, B6: outputs that describe a huge run
    "huge-rows": {}, "forged": {},
}


@pytest.fixture(scope="module")
def world(cluster: Cluster, crd: None, s3_world: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    ops, attacker, victim = (_namespace(cluster, role) for role in ("ops", "attacker", "victim"))
    _secret(cluster, victim)
    _secret(cluster, attacker)
    _secret(cluster, attacker, "s3-evil", AWS_CONFIG_FILE="/models/team-a/evil.cfg", PYTHONPATH="/models/team-a")
    _qwen_world(s3_world)
    _forged_outputs(s3_world, attacker)
    metrics, slow_store = Metrics(), Endpoint(lambda conn, _: trickle(conn, seconds=600, every=1.0))
    server = metrics.start()
    log = tmp_path_factory.mktemp("adversarial") / "operator.log"
    operator = Operator(cluster, f"{attacker},{victim}", log)
    operator.env.update({"TOKENMILL_OPERATOR_NAMESPACE": ops, "TOKENMILL_PASS_DEADLINE_SECONDS": "8",
                         "TOKENMILL_SERVER_METRICS_URL": f"{metrics.url}/{{namespace}}/{{name}}"})
    operator.start()
    try:
        victim_resource = b5_resource(victim, s3_world, "victim", **{
            "model.path": f"s3://models/{QWEN_PREFIX}", "server.gpusPerNode": 1, "suspend": True,
            "output.uri": f"s3://tokenmill-data/runs/{victim}/victim/"})
        cluster.apply(victim_resource)
        planned = cluster.wait_for(lambda: (dsgen(cluster, victim, "victim").get("status") or {}).get("serverPlan"),
                                   "the victim's plan", timeout=120)
        made = World(cluster, attacker, victim, ops, operator, metrics, slow_store, s3_world, planned)
        assert made.ask_victim() < PACE_S, "the victim's pace before any attack"
        metrics.answers.update({
            (attacker, "slow-metrics-0"): "trickle", (attacker, "slow-metrics-1"): "trickle",
            (attacker, "redirect-victim"): f"redirect {metrics.url}/{victim}/victim/metrics",
            (attacker, "redirect-internal"): f"redirect {metrics.url}/capture/latest/meta-data/iam/",
            (attacker, "poison"): "poison"})
        yield made
    finally:
        operator.stop()
        print(operator.tail(12000), file=sys.stderr)
        server.shutdown()
        slow_store.close()
        for namespace in (attacker, victim, ops):
            _release_finalizers(cluster, namespace)
            cluster.core.delete_namespace(namespace, propagation_policy="Background")


def wait_attacker(world: World, name: str, what: str, test: Any, timeout: float = 120) -> dict[str, Any]:
    return world.cluster.wait_for(lambda: (lambda s: s if test(s) else None)(world.status(name)), what,
                                  timeout=timeout)


def test_a_trickling_store_stalls_only_its_own_namespace(world: World):
    slow = [f"slow-s3-{i}" for i in range(4)]
    world.attack(*slow)
    world.cluster.wait_for(lambda: len(world.trickle.requests) >= 2, "the attacker's reads of its trickling store")
    assert world.ask_victim() < PACE_S
    # The attacker's own passes end at their deadline, their connections closed: said in its status.
    refused = wait_attacker(world, "slow-s3-0", "slow-s3-0 ObservationFailed past its deadline", lambda s: "past its "
                            "deadline" in ((condition({"status": s}, "Ready") or {}).get("message") or ""))
    assert (condition({"status": refused}, "Ready") or {}).get("reason") == "ObservationFailed"
    assert world.trickle.closed.wait(60), "the trickled connection closed by the operator"
    world.victim_unchanged()
    world.retreat(*slow)


def test_slow_and_redirecting_metrics_stall_and_read_nothing_of_the_victim(world: World):
    names = ("slow-metrics-0", "slow-metrics-1", "redirect-victim", "redirect-internal")
    world.attack(*names)
    for name in names:
        wait_attacker(world, name, f"{name} Generating", lambda s: s.get("phase") == "Generating")
    paths = [f"/{world.attacker}/{name}/metrics" for name in names]
    world.cluster.wait_for(lambda: all(world.metrics.seen[path] >= 2 for path in paths),
                           "two scrapes of every attacker pod's /metrics", timeout=120)
    assert world.ask_victim() < PACE_S
    victim_path = f"/{world.victim}/victim/metrics"
    assert world.metrics.seen[victim_path] == 0, "a redirect made the operator read the victim's server (B4)"
    assert not [p for p in world.metrics.seen if p.startswith("/capture")], "a request left for an internal address"
    assert all("verification" not in world.status(name) for name in names), "figures read through a redirect"
    world.victim_unchanged()
    world.retreat(*names)


def test_poisoned_constants_never_reach_another_namespaces_plan(world: World):
    world.attack("lying", "poison")
    lying = wait_attacker(world, "lying", "the lying nodeSelector refused",
                          lambda s: (condition({"status": s}, "Ready") or {}).get("reason") == "NotAllowed")
    assert "nvidia.com/gpu.product='NVIDIA-L4'" in condition({"status": lying}, "Ready")["message"]
    generating = wait_attacker(world, "poison", "poison Generating", lambda s: s.get("phase") == "Generating")
    plan = ServerPlan.model_validate(generating["serverPlan"])
    spec = parse_document(world.resource(world.attacker, "poison", **ATTACKS["poison"])).spec
    fixture = _qwen_world(world.s3)
    facts = model_facts(fixture["config"], fixture["weight_bytes"])
    world.metrics.poison_step = plan_step_model(pinned_spec(spec, running_layout(plan)), facts,
                                                plan.cuda_driver_major, POISON.calibration(CALIBRATION))

    def measured() -> dict[str, str] | None:
        try:
            data = world.cluster.core.read_namespaced_config_map(CONFIGMAP_NAME, world.ops).data or {}
        except k8s.ApiException:
            return None
        return data if any(key.startswith(f"ns.{world.attacker}.") for key in data) else None

    data = world.cluster.wait_for(measured, "the attacker's refit kept", timeout=180)
    assert not [key for key in data if not key.startswith(f"ns.{world.attacker}.")], data  # f9665d2: the bare key
    world.cluster.wait_for(lambda: "for this namespace only" in world.cluster.kubectl(
        "get", "events", "-n", world.attacker, "--field-selector", "involvedObject.name=poison").stdout,
        "the ConstantsMeasured Event saying why nothing was kept for the cluster")
    assert world.ask_victim() < PACE_S
    world.victim_unchanged()  # its new generation's plan is the published fit's, as before
    world.retreat("lying", "poison")


def test_a_patched_status_plan_is_never_applied(world: World):
    world.attack("patched")
    generating = wait_attacker(world, "patched", "patched Generating", lambda s: s.get("phase") == "Generating")
    image = generating["serverPlan"]["image"]
    custom = world.cluster.api(k8s.CustomObjectsApi)
    custom.patch_namespaced_custom_object_status(*GROUP_VERSION[:2], world.attacker, GROUP_VERSION[2], "patched", {
        "status": {"serverPlan": {"image": "attacker.example/evil:1", "replicas": 64}}})
    world.cluster.wait_for(lambda: "StatusPlanRefused" in world.cluster.kubectl(
        "get", "events", "-n", world.attacker, "--field-selector", "involvedObject.name=patched").stdout,
        "StatusPlanRefused", timeout=60)
    world.cluster.wait_for(lambda: world.status("patched")["serverPlan"]["image"] == image, "the plan made anew")
    statefulset = world.cluster.apps.read_namespaced_stateful_set("patched-server", world.attacker)
    assert statefulset.spec.template.spec.containers[0].image == image  # f9665d2: attacker.example/evil:1
    assert statefulset.spec.replicas == 1  # f9665d2: 64
    assert world.ask_victim() < PACE_S
    world.retreat("patched")


def test_the_fill_gets_only_the_aws_keys_its_namespaces_folder_and_its_own_uid(world: World):
    world.attack("filler")
    statefulset = world.cluster.wait_for(lambda: world.cluster.apps.read_namespaced_stateful_set(
        "filler-server", world.attacker), "the node-local run's StatefulSet")
    [fill] = [c for c in statefulset.spec.template.spec.init_containers if c.name == cache.NODE_FILL_CONTAINER]
    assert not fill.env_from  # f9665d2: envFrom the whole Secret
    env = _env_of(world.cluster, world.attacker, fill)  # what the kubelet would give it
    assert env["AWS_CONFIG_FILE"] == "/dev/null" and "PYTHONPATH" not in env, env
    assert env["AWS_ACCESS_KEY_ID"] == "testing"
    assert [(m.mount_path, m.sub_path) for m in fill.volume_mounts] == [("/models", world.attacker)]
    assert fill.security_context.run_as_user == cache.namespace_uid(world.attacker) != cache.namespace_uid(
        world.victim)
    assert world.ask_victim() < PACE_S
    world.retreat("filler")


def test_outputs_that_describe_huge_runs_leave_the_operator_small(world: World):
    world.attack("huge-rows", "forged")
    for name in ("huge-rows", "forged"):
        wait_attacker(world, name, f"{name} observed", lambda s: s.get("observedGeneration") == 1, timeout=180)
    assert world.ask_victim() < PACE_S
    world.victim_unchanged()
    # Last in the module: the peak over every attack above.
    status = Path(f"/proc/{world.operator.process.pid}/status").read_text()
    peak = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024
    assert peak < RSS_LIMIT, f"the operator's peak RSS {peak / 2**20:.0f} MiB"
