"""`tokenmill run` through SGLang's model gateway: the real `smg` binary (PyPI smg, installed by `make install` from
the test extra) in front of two `tokenmill sim-server` replicas, as a user runs it: the facts read through the
gateway, every sample once and token-exact, a replica killed mid-run, and a gateway left with no live worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import REPO, free_port
from tests.integration.sims import SimProcess
from tests.integration.test_run import committed_errors
from tokenmill_runner.generate.summary import EXIT_OK, EXIT_SERVERS_UNAVAILABLE
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import open_storage

DEMO = REPO / "examples" / "demo.yaml"
TIME_SCALE = "2000"  # simulated seconds per real second: the demo's outputs in seconds, not hours
SMG = Path(sys.executable).with_name("smg")


class Gateway:
    """One `smg launch` process in front of `workers`, on free ports (its metrics listener too)."""

    def __init__(self, workers: list[str], policy: str | None = None) -> None:
        assert SMG.exists(), f"{SMG} is missing: `make install` installs smg (pyproject.toml, the test extra)"
        self.workers = workers
        self.policy = policy  # smg's --policy (its default when None); hack/bench/bench_prefix_routing.py sets it
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Gateway:
        # Health checks every second, one failure marks a worker unhealthy: a killed replica leaves rotation soon,
        # whatever the test's timing (the runner must not lose samples to it either way).
        self.process = subprocess.Popen(
            [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1",
             "--health-failure-threshold", "1", "--worker-startup-check-interval", "1", "--log-level", "warn",
             *(["--policy", self.policy] if self.policy else []), "--worker-urls", *self.workers],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every worker is registered and healthy (smg registers them in the background)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, self._stderr()
            try:
                listed = httpx.get(f"{self.url}/workers", timeout=2.0).json()["workers"]
                if sum(worker["is_healthy"] for worker in listed) == len(self.workers):
                    return
            except (httpx.TransportError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"smg did not register {self.workers}: {self._stderr()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def _stderr(self) -> str:
        if self.process is None or self.process.poll() is None or self.process.stderr is None:
            return ""
        return self.process.stderr.read().decode(errors="replace")[-3000:]


@pytest.fixture
def replicas(demo_model: Path) -> Iterator[list[SimProcess]]:
    sims = [SimProcess(demo_model, time_scale=TIME_SCALE).start() for _ in range(2)]
    try:
        yield sims
    finally:
        for sim in sims:
            sim.kill()


@pytest.fixture
def gateway(replicas: list[SimProcess]) -> Iterator[Gateway]:
    gate = Gateway([sim.url for sim in replicas]).start()
    try:
        gate.wait_ready()
        yield gate
    finally:
        gate.stop()


def tokenmill_run(spec: Path, server: str, out: Path, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "run", str(spec), "--server", server,
                           "--out", str(out)], capture_output=True, text=True, timeout=timeout_s, check=False)


def start_run(spec: Path, server: str, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tokenmill_runner.cli", "run", str(spec), "--server", server,
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def demo_spec(tmp_path: Path, limit: int | None = None, outage_budget_s: int | None = None) -> Path:
    """examples/demo.yaml with its paths made absolute, optionally fewer rows a dataset and a shorter outage budget."""
    document = yaml.safe_load(DEMO.read_text())
    spec = document["spec"]
    spec["model"]["path"] = str((DEMO.parent / spec["model"]["path"]).resolve())
    for dataset in spec["datasets"]:
        dataset["source"] = str((DEMO.parent / dataset["source"]).resolve())
        if limit is not None:
            dataset["limit"] = limit
    if outage_budget_s is not None:
        spec["runner"]["outageBudgetSeconds"] = outage_budget_s
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def outputs(out: Path) -> dict[tuple[str, str, int], list[Any]]:
    """Each committed sample's output ids (every turn's, for a regenerated conversation), keyed by dataset, sample id
    and sample index; asserts no sample is there twice."""
    storage = open_storage(str(out))
    document = yaml.safe_load(DEMO.read_text())
    found: dict[tuple[str, str, int], list[Any]] = {}
    for dataset in document["spec"]["datasets"]:
        for row in read_committed_rows(storage, dataset["name"]):
            key = (dataset["name"], row["sample_id"], row["sample_index"])
            assert key not in found, f"{key} committed twice"
            found[key] = [turn["output_ids"] for turn in row["turns"]] if "turns" in row else row["output_ids"]
    return found


def errors(out: Path) -> list[dict[str, Any]]:
    storage = open_storage(str(out))
    names = [dataset["name"] for dataset in yaml.safe_load(DEMO.read_text())["spec"]["datasets"]]
    return [record for name in names for record in committed_errors(storage, name)]


def requests_served(sim: SimProcess) -> float:
    """sglang:num_requests_total on the replica's /metrics: how far the run got on it."""
    text = httpx.get(f"{sim.url}/metrics", timeout=5.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total"))


def test_the_demo_through_smg_is_every_sample_once_and_token_exact(tmp_path: Path, replicas: list[SimProcess],
                                                                   gateway: Gateway) -> None:
    # Before tokenmill read /get_server_info, this run exited 1 on a 404 for /server_info before any request.
    through = tokenmill_run(DEMO, gateway.url, tmp_path / "gateway")
    assert through.returncode == EXIT_OK, through.stderr[-3000:]
    assert f"{gateway.url} is a gateway with 2 healthy workers" in through.stderr
    direct = tokenmill_run(DEMO, replicas[0].url, tmp_path / "direct")
    assert direct.returncode == EXIT_OK, direct.stderr[-3000:]
    expected = outputs(tmp_path / "direct")
    got = outputs(tmp_path / "gateway")
    assert len(expected) == 326  # the demo's 296 prompts, C1_sharegpt's 30 twice
    assert got.keys() == expected.keys()
    assert [key for key in expected if got[key] != expected[key]] == []
    assert errors(tmp_path / "gateway") == []
    # Both workers generated: the gateway routed the run over them.
    assert min(requests_served(sim) for sim in replicas) > 0


def test_a_replica_killed_behind_the_gateway_loses_nothing(tmp_path: Path, replicas: list[SimProcess],
                                                           gateway: Gateway) -> None:
    spec = demo_spec(tmp_path, limit=24)
    run = start_run(spec, gateway.url, tmp_path / "out")
    try:
        victim = replicas[0]
        while requests_served(victim) < 10:  # mid-run on the victim, whatever the machine's speed
            assert run.poll() is None, run.communicate()[0][-3000:]
            time.sleep(0.05)
        victim.kill()
        log, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            os.kill(run.pid, signal.SIGKILL)
    assert run.returncode == EXIT_OK, log[-3000:]
    got = outputs(tmp_path / "out")
    assert len(got) == 24 * 4 + 24 * 2  # every prompt of the four single-sample datasets, 2 samples of C1_sharegpt
    assert errors(tmp_path / "out") == []


def test_a_gateway_without_a_live_worker_past_the_budget_exits_4_and_writes_nothing_off(
        tmp_path: Path, replicas: list[SimProcess], gateway: Gateway) -> None:
    spec = demo_spec(tmp_path, limit=24, outage_budget_s=3)
    run = start_run(spec, gateway.url, tmp_path / "out")
    try:
        while sum(requests_served(sim) for sim in replicas) < 10:
            assert run.poll() is None, run.communicate()[0][-3000:]
            time.sleep(0.05)
        for sim in replicas:
            sim.kill()
        log, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            os.kill(run.pid, signal.SIGKILL)
    assert run.returncode == EXIT_SERVERS_UNAVAILABLE, log[-3000:]
    assert "outage budget" in log
    assert errors(tmp_path / "out") == []  # nothing written off: a rerun generates the rest
    assert len(outputs(tmp_path / "out")) < 24 * 4 + 24 * 2


def test_facts_that_cannot_be_read_name_the_url_what_was_tried_and_what_to_do(tmp_path: Path) -> None:
    # Something that answers /health but is neither SGLang nor smg (here: a static file server).
    port = free_port()
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(tmp_path / "www")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1.0)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "http.server did not start"
                time.sleep(0.05)
        run = tokenmill_run(demo_spec(tmp_path, limit=2), url, tmp_path / "out", timeout_s=120)
    finally:
        server.kill()
        server.wait()
    assert run.returncode != EXIT_OK
    assert f"cannot read the server's facts from {url}" in run.stderr
    assert f"GET {url}/server_info: HTTP 404" in run.stderr and f"GET {url}/get_server_info: HTTP 404" in run.stderr
    assert "smg launch --worker-urls" in run.stderr
    assert "HTTPStatusError" not in run.stderr
