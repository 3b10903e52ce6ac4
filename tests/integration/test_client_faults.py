"""The runner against SGLang servers that fail: real simulators over HTTP, killed, restarted, answering 503 or NaN;
the runner, its client and its ledger as they run in production (no mocks).

Time is scaled: the simulators run `time_scale` times faster than the wall clock, and the runner's /health probe
intervals are a tenth of their defaults, so an outage of "45 s" lasts 4.5 s here. What a server does while it comes
back is SGLang's: nothing listens while weights load (connection refused), then /health answers 503 until the
warm-up generation is done (0.5.23 entrypoints/http_server.py:723), then 200.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenmill_runner.generate.seeds import sample_seed
from tokenmill_runner.prepare import prepare
from tokenmill_runner.spec.config import RunnerConfig
from tokenmill_runner.spec.resource import load_spec_file
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import open_storage
from tokenmill_sim.config import SimConfig
from tokenmill_sim.server import SimServer

from .sims import SimProcess, run_with_faults
from .test_run import assert_exactly_once, committed_errors
from .workloads import chat, spec_document, write_jsonl, write_spec

SCALE = 10  # wall-clock seconds here per ten seconds of the scenario
PROBES = {"probe_first_s": 1.0 / SCALE, "probe_max_s": 30.0 / SCALE}


def runner_config(tmp_path: Path, demo_model: Path, servers: list[str], prompts: int, **runner: Any) -> RunnerConfig:
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(prompts)])
    settings = {"concurrency": 32, "shardMaxSamples": 16, "shardMaxSeconds": 1, **runner}
    spec = load_spec_file(write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "p", "source": "p.jsonl"}], "out", sampling={"maxNewTokens": 1024},
        runner=settings))).spec
    return RunnerConfig(spec=spec, name="faults", servers=servers, output_uri=str(tmp_path / "out"), **PROBES)


def sim(demo_model: Path, **overrides: Any) -> SimConfig:
    return SimConfig(model_path=str(demo_model), **{"time_scale": 100.0, "max_running_requests": 16, **overrides})


def ids(count: int) -> set[str]:
    return {f"s{i:04d}" for i in range(count)}


def gauge(runner: Any, name: str, **labels: str) -> float | None:
    return runner.metrics.registry.get_sample_value(name, {"dsgen": "faults", "namespace": "", "worker": "0",
                                                           **labels})


def test_a_replica_killed_for_good(tmp_path: Path, demo_model: Path) -> None:
    """One of two replicas dies in the middle of the run: its in-flight requests go to the other one, no request is
    sent to it again except /health probes, and no sample is given up."""
    with SimServer(sim(demo_model)) as doomed, SimServer(sim(demo_model, seed=1)) as steady:
        async def go() -> tuple[Any, Any]:
            runner = await prepare(runner_config(tmp_path, demo_model, [doomed.url, steady.url], 240), api_key=None)
            summary = await run_with_faults(runner, [(60, lambda: asyncio.to_thread(doomed.kill))])
            return runner, summary

        runner, summary = asyncio.run(go())
    assert summary.datasets[0].failed == {} and summary.datasets[0].generated == 240
    rows = assert_exactly_once(open_storage(str(tmp_path / "out")), "p", ids(240))
    assert gauge(runner, "tokenmill_runner_replica_live", replica=doomed.url) == 0
    assert gauge(runner, "tokenmill_runner_replica_live", replica=steady.url) == 1
    assert any(row["attempts"] > 1 for row in rows), "requests in flight on the dead replica were sent again"


def test_every_replica_down_for_a_long_outage_and_back_after_loading(tmp_path: Path, demo_model: Path) -> None:
    """The only replica dies, stays down for "60 s", comes back answering 503 on /health while it "warms up": the
    runner waits without spending any sample's attempts (maxAttempts 1: a single charged failure would give a
    sample up), and every sample is generated once."""
    outage_s, warmup_s = 60.0 / SCALE, 10.0 / SCALE
    revived: list[SimServer] = []
    peaks: list[float] = []
    with SimServer(sim(demo_model)) as first:
        async def go() -> tuple[Any, Any]:
            runner = await prepare(runner_config(tmp_path, demo_model, [first.url], 160, maxAttempts=1),
                                   api_key=None)

            async def watch() -> None:
                while True:
                    peaks.append(gauge(runner, "tokenmill_runner_outage_seconds") or 0.0)
                    await asyncio.sleep(0.1)

            async def outage() -> None:
                await asyncio.to_thread(first.kill)
                watcher = asyncio.create_task(watch())
                await asyncio.sleep(outage_s)
                back = SimServer(sim(demo_model, startup_seconds=warmup_s), port=first.port)
                revived.append(await asyncio.to_thread(back.start))
                await asyncio.sleep(warmup_s + 0.5)
                watcher.cancel()

            return runner, await run_with_faults(runner, [(40, outage)])

        try:
            runner, summary = asyncio.run(go())
        finally:
            for server in revived:
                server.stop()
    assert summary.datasets[0].failed == {} and summary.datasets[0].generated == 160
    assert_exactly_once(open_storage(str(tmp_path / "out")), "p", ids(160))
    assert max(peaks) >= outage_s * 0.8, "the outage was seen and measured"
    assert gauge(runner, "tokenmill_runner_outage_seconds") == 0.0, "and it is over"


def test_a_replica_answering_503_for_minutes_is_not_hammered(tmp_path: Path, demo_model: Path) -> None:
    """One replica answers every /generate with 503 for "60 s" (a queue that stays full) while its /health keeps
    answering 200, as SGLang's does while the scheduler produces output. Its breaker opens after a few 503s and
    probes it with a growing interval, so it gets a few bursts of requests, not a retry storm; once the window is
    over it serves again; nothing is given up."""
    window = 60.0 / SCALE
    flaky = sim(demo_model, fault_503_after_s=0.0, fault_503_for_s=window, time_scale=20.0)
    with SimServer(flaky) as bad, SimServer(sim(demo_model, seed=1, time_scale=20.0)) as good:
        async def go() -> Any:
            return await (await prepare(runner_config(tmp_path, demo_model, [bad.url, good.url], 300),
                                        api_key=None)).run()

        summary = asyncio.run(go())
        refused = _metric(bad.url, "sglang:num_aborted_requests_total")
        served = _metric(bad.url, "sglang:num_requests_total")
    assert summary.datasets[0].failed == {} and summary.datasets[0].generated == 300
    assert_exactly_once(open_storage(str(tmp_path / "out")), "p", ids(300))
    assert summary.elapsed_s > window and served > 0, "the run outlasted the window and the replica served again"
    # At most one burst of the concurrency (32) per reopening, and reopenings double their wait from the first probe.
    reopenings = 1 + int(window / PROBES["probe_first_s"]).bit_length()
    assert refused <= 32 * reopenings, (refused, reopenings)
    print(f"503s: {refused} in a {window:.0f} s window; served after it: {served}; run {summary.elapsed_s:.1f} s")


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def test_nan_answers_are_retried_and_never_stored_as_clean(tmp_path: Path, demo_model: Path) -> None:
    """A third of the answers carry finish_reason.matched "NaN happened" (SGLang replaced the last token with EOS):
    each is retried, so every stored row ends in the token the model really produced."""
    with SimServer(sim(demo_model, fault_nan_rate=0.3, seed=4)) as server:
        config = runner_config(tmp_path, demo_model, [server.url], 120, maxAttempts=12)

        async def go() -> Any:
            return await (await prepare(config, api_key=None)).run()

        summary = asyncio.run(go())
    assert summary.datasets[0].failed == {} and summary.retries > 0
    rows = assert_exactly_once(open_storage(str(tmp_path / "out")), "p", ids(120))
    eos = 4  # examples/demo-model/config.json eos_token_id
    for row in rows:
        assert row["finish_reason"] in ("stop", "length")
        if row["finish_reason"] == "stop":
            assert row["matched_stop"] == eos == row["output_ids"][-1]
    assert sum(row["attempts"] > 1 for row in rows) > 10
    # Each attempt is drawn with a seed of its own (review 9: under deterministic inference one seed would replay the
    # NaN on every retry); the row records the seed of the attempt that produced it.
    for row in rows:
        assert row["seed"] == sample_seed(None, "p", row["line"], 0, attempt=row["attempts"] - 1)


def test_an_outage_longer_than_the_budget_stops_the_run_with_exit_4_and_writes_nothing_off(
        tmp_path: Path, demo_model: Path) -> None:
    """The only server dies and stays down past spec.runner.outageBudgetSeconds: `tokenmill run` exits 4, the
    samples not generated are not recorded as failed, and a rerun once the server is back generates exactly them."""
    config = runner_config(tmp_path, demo_model, ["x"], 150, outageBudgetSeconds=2)
    spec_path = tmp_path / "spec.yaml"
    out = tmp_path / "out"
    with SimProcess(demo_model, time_scale=20.0, max_running_requests=16) as server:
        server.start()
        command = [sys.executable, "-m", "tokenmill_runner.cli", "-q", "run", str(spec_path), "--out", str(out),
                   "--server", server.url]
        run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        storage = open_storage(str(out))
        deadline = time.monotonic() + 120
        while not list(read_markers(storage, "p")) and time.monotonic() < deadline:
            assert run.poll() is None, run.communicate()
            time.sleep(0.05)
        server.kill()
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 4, stderr[-3000:]
        assert re.search(r"^stopped: no SGLang server was live for \d+ s, more than the outage budget of 2 s .*"
                         r"Nothing was written off", stdout, re.MULTILINE), stdout
        committed = {row["sample_id"] for row in read_committed_rows(storage, "p")}
        assert 0 < len(committed) < 150
        assert committed_errors(storage, "p") == [], "no sample was written off"
        server.start()
        again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_exactly_once(storage, "p", ids(150))
    assert config.spec.runner.outage_budget_seconds == 2


def test_the_outage_scenario_of_issue_10(tmp_path: Path, demo_model: Path) -> None:
    """Two replicas; one is killed for good, the other is killed and comes back after 45 s (time-scaled: the
    process is started again after 4.5 s, loads for as long as a simulator takes to start, then warms up); 400
    prompts. Every prompt is generated exactly once and no sample is given up."""
    flags = {"time_scale": 60.0, "max_running_requests": 32}
    with SimProcess(demo_model, **flags) as gone, SimProcess(demo_model, seed=1, **flags) as back:
        gone.start(wait=False)
        back.start()
        gone.wait_listening()
        config = runner_config(tmp_path, demo_model, [gone.url, back.url], 400, concurrency=64)

        async def comes_back() -> None:
            back.kill()
            await asyncio.sleep(45.0 / SCALE)
            back.start(wait=False, startup_seconds=10.0 / SCALE)

        async def go() -> Any:
            runner = await prepare(config, api_key=None)
            summary = await run_with_faults(runner, [(100, gone.kill), (200, comes_back)])
            return summary

        summary = asyncio.run(go())
    assert summary.datasets[0].failed == {}, summary.datasets[0].failed
    assert summary.datasets[0].generated == 400 and summary.elapsed_s > 45.0 / SCALE, "it waited out the outage"
    rows = assert_exactly_once(open_storage(str(tmp_path / "out")), "p", ids(400))
    print(f"attempts per sample: {sorted(Counter(row['attempts'] for row in rows).items())}")


def test_runner_metrics_name_the_replicas(tmp_path: Path, demo_model: Path) -> None:
    with SimServer(sim(demo_model)) as server:
        async def go() -> Any:
            runner = await prepare(runner_config(tmp_path, demo_model, [server.url], 10), api_key=None)
            await runner.run()
            return runner

        runner = asyncio.run(go())
    assert gauge(runner, "tokenmill_runner_replica_live", replica=server.url) == 1
    assert gauge(runner, "tokenmill_runner_outage_seconds") == 0


def test_a_prompt_that_crashes_the_server_every_time_is_given_up_in_bounded_time(tmp_path: Path,
                                                                                 demo_model: Path) -> None:
    """Issue 19 (review 4): one prompt kills the server process whenever it is sent (restarted "2 s" later, as a pod
    is). Before, the sample was never charged (the replica died, so the failure was not the sample's) and the run
    went on crashing the server forever. Now the sample is given up as `replica_crash` after the replica died
    RetryPolicy.max_replica_deaths times while it was the one suspect in flight (suspects run one at a time, so the
    samples that were only in flight beside it are generated), and the run ends (exit 3: given up, retryable)."""
    poison = "POISON-PILL"
    write_jsonl(tmp_path / "p.jsonl", [chat(i, poison if i == 7 else None) for i in range(40)])
    config = runner_config(tmp_path, demo_model, ["http://placeholder"], 0)
    write_jsonl(tmp_path / "p.jsonl", [chat(i, poison if i == 7 else None) for i in range(40)])  # after the helper's
    crashes: list[float] = []
    first = SimServer(sim(demo_model, fault_crash_text=poison)).start()
    servers = [first]

    async def supervise(stop: asyncio.Event) -> None:
        """A pod's restart: when the server died, start it again on its port 0.2 s later."""
        while not stop.is_set():
            current = servers[-1]
            if current._thread is None or not current._thread.is_alive():  # noqa: SLF001 - the process died
                crashes.append(time.monotonic())
                await asyncio.sleep(2.0 / SCALE)
                servers.append(await asyncio.to_thread(
                    SimServer(sim(demo_model, fault_crash_text=poison), port=first.port).start))
            await asyncio.sleep(0.02)

    async def go() -> Any:
        runner = await prepare(config.model_copy(update={"servers": [first.url]}), api_key=None)
        stop = asyncio.Event()
        watcher = asyncio.create_task(supervise(stop))
        try:
            return await asyncio.wait_for(runner.run(), timeout=120)
        finally:
            stop.set()
            await watcher

    try:
        summary = asyncio.run(go())
    finally:
        for server in servers:
            server.stop()
    dataset = summary.datasets[0]
    assert dataset.failed == {"replica_crash": 1} and dataset.generated == 39
    assert 3 <= len(crashes) <= 8, f"the server was crashed {len(crashes)} times"
    [error] = committed_errors(open_storage(str(tmp_path / "out")), "p")
    assert error["sample_id"] == "s0007" and error["reason"] == "replica_crash"
    assert "2 of them while it was the only suspect in flight" in error["message"]
