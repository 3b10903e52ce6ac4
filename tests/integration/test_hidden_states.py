"""Hidden states captured exactly once per committed sample, aligned to its tokens: the simulator serves states keyed
by (token, position, layer) as SGLang 0.5.23 shapes them (tokenmill_sim/hidden_states.py), the runner's capture pass
(generate/hidden_capture.py) is killed (SIGKILL, TOKENMILL_FAULT) at each step of its commit and resumed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fake_clock import FakeClock
from tokenmill_runner.facts.hidden_states import StateShape, default_eagle3_layer_ids
from tokenmill_runner.generate.hidden_capture import CaptureError, capture_dataset, parse_states
from tokenmill_runner.spec.resource import SpecError, parse_document
from tokenmill_runner.store.capture_progress import read_capture_progress
from tokenmill_runner.store.faults import FAULT_ENV
from tokenmill_runner.store.hidden_states import STATES, captured_keys, read_states, sample_key, state_markers
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.shards import decode_rows
from tokenmill_runner.store.storage import LocalStorage

from .test_exactly_once import run_cli
from .workloads import chat, spec_document, write_jsonl, write_spec

HIDDEN = 1024  # examples/demo-model/config.json
LAYERS = default_eagle3_layer_ids(8)  # its 8 layers: [1, 3, 4]
SHAPE = StateShape(len(LAYERS), HIDDEN, "bfloat16")
CHUNK = 48  # small prefill chunks, so an answer spans several


@pytest.fixture
def sim(demo_model: Path):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    config = SimConfig(model_path=str(demo_model), time_scale=5000.0, max_running_requests=32,
                       enable_return_aux_hidden_states=True, chunked_prefill_size=CHUNK)
    with SimServer(config) as server:
        yield server


def expected(sequence: list[int], layer_ids: list[int], shift: int = 0) -> np.ndarray:
    from tokenmill_sim.hidden_states import keyed_row

    return np.array([keyed_row(sequence[p], p + shift, layer_ids, HIDDEN) for p in range(len(sequence))])


def rows_by_key(storage: LocalStorage, dataset: str) -> dict[str, dict]:
    rows = {}
    for marker in read_markers(storage, dataset):
        if marker.get("data"):
            for row in decode_rows(storage.get(f"{dataset}/{marker['data']}")):
                rows[sample_key(row["sample_id"], row["sample_index"])] = row
    return rows


def run_spec(tmp_path: Path, demo_model: Path, lines: int, max_new: int = 40, **spec: Any) -> tuple[Path, Path]:
    """(spec file, output folder) of dataset d: `lines` chat rows, `max_new` tokens each."""
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(1, lines + 1)])
    out = tmp_path / "out"
    document = spec_document(demo_model, [{"name": "d", "source": str(tmp_path / "p.jsonl")}], str(out), **spec)
    document["spec"]["sampling"]["maxNewTokens"] = max_new
    return write_spec(tmp_path / "spec.yaml", document), out


def generate(tmp_path: Path, demo_model: Path, sim, lines: int, max_new: int = 40) -> tuple[LocalStorage, Path]:
    spec, out = run_spec(tmp_path, demo_model, lines, max_new)
    done = run_cli(spec, out, sim.url)
    assert done.returncode == 0, done.stderr[-2000:]
    return LocalStorage(out), out


CAPTURE = """
import asyncio, sys
from tokenmill_runner.facts.hidden_states import StateShape
from tokenmill_runner.generate.hidden_capture import capture_dataset
from tokenmill_runner.store.storage import LocalStorage
summary = asyncio.run(capture_dataset(LocalStorage(sys.argv[1]), "d", sys.argv[2], StateShape(3, 1024, "bfloat16"),
                                      chunked_prefill_tokens=int(sys.argv[3]), concurrency=2))
print(summary.captured, summary.skipped, summary.failed)
"""


def capture_cli(out: Path, server: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-c", CAPTURE, str(out), server, str(CHUNK)], capture_output=True,
                          text=True, env=env, timeout=300)


def assert_every_sample_once_and_aligned(storage: LocalStorage) -> int:
    rows = rows_by_key(storage, "d")
    markers = list(state_markers(storage, "d"))
    assert sorted(m["sample_id"] for m in markers) == sorted(row["sample_id"] for row in rows.values())
    total = 0
    for marker in markers:
        row = rows[sample_key(marker["sample_id"], marker["sample_index"])]
        sequence = row["prompt_ids"] + row["output_ids"]
        token_ids, states = read_states(storage, "d", marker)
        assert token_ids.tolist() == sequence
        assert states.shape == (len(sequence), len(LAYERS), HIDDEN)
        np.testing.assert_array_equal(states.reshape(len(sequence), -1), expected(sequence, LAYERS))
        total += marker["bytes"]
    return total


def test_states_of_every_committed_sample_match_their_tokens_and_the_plans_bytes(tmp_path, demo_model, sim):
    storage, _ = generate(tmp_path, demo_model, sim, lines=6)
    summary = asyncio.run(capture_dataset(storage, "d", sim.url, SHAPE, chunked_prefill_tokens=CHUNK))
    assert (summary.captured, summary.failed) == (6, 0), summary.failures
    on_disk = assert_every_sample_once_and_aligned(storage)
    tokens = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in rows_by_key(storage, "d").values())
    assert summary.state_bytes == SHAPE.state_bytes(tokens)
    # The files hold the states plus the token ids and a header no larger than file_bytes allows for.
    assert SHAPE.state_bytes(tokens) + 8 * tokens < on_disk <= sum(
        SHAPE.file_bytes(len(r["prompt_ids"]) + len(r["output_ids"])) for r in rows_by_key(storage, "d").values())
    # A second pass finds everything committed and asks the server nothing.
    again = asyncio.run(capture_dataset(storage, "d", sim.url, SHAPE, chunked_prefill_tokens=CHUNK))
    assert (again.captured, again.skipped) == (0, 6)


def test_the_keyed_values_tell_a_shifted_state_and_a_wrong_layer(tmp_path, demo_model, sim):
    storage, _ = generate(tmp_path, demo_model, sim, lines=1)
    asyncio.run(capture_dataset(storage, "d", sim.url, SHAPE, chunked_prefill_tokens=CHUNK))
    marker = next(state_markers(storage, "d"))
    token_ids, states = read_states(storage, "d", marker)
    flat = states.reshape(len(token_ids), -1)
    sequence = token_ids.tolist()
    assert not np.array_equal(flat, expected(sequence, LAYERS, shift=1))
    assert not np.array_equal(flat, expected(sequence, [LAYERS[0], LAYERS[1], LAYERS[2] + 1]))
    assert not np.array_equal(flat[1:], expected(sequence, LAYERS)[:-1])


@pytest.mark.parametrize("rule", ["kill-before:states:2", "kill-after:states:2", "kill-before:states-marker:3",
                                  "kill-after:states-marker:3"])
def test_a_capture_killed_at_each_step_resumes_to_every_sample_once(tmp_path, demo_model, sim, rule):
    storage, out = generate(tmp_path, demo_model, sim, lines=5)
    done = capture_cli(out, sim.url, rule)
    assert done.returncode == -signal.SIGKILL, f"{rule} never fired: {done.stderr[-2000:]}"
    committed_before = captured_keys(storage, "d")
    assert len(committed_before) < 5
    # A file without its marker is a leftover, never counted.
    files = {p.stem.split("-")[0] for p in (out / "d" / STATES).glob("*.safetensors")}  # <sample key>-<token>
    assert committed_before <= files
    resumed = capture_cli(out, sim.url)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    captured, skipped, failed = map(int, resumed.stdout.split())
    assert (captured, skipped, failed) == (5 - len(committed_before), len(committed_before), 0)
    assert_every_sample_once_and_aligned(storage)
    assert not list((out / "d" / STATES).glob("states-*"))  # no spool file moved in


def test_an_answer_from_the_prefix_cache_or_for_other_tokens_is_refused(tmp_path, demo_model, sim):
    import httpx
    import orjson

    sequence = [5, 6, 7, 8, 9, 10, 11, 12]
    base = {"input_ids": sequence, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
            "return_hidden_states": True, "return_prompt_token_ids": True}
    first = httpx.post(f"{sim.url}/generate", content=orjson.dumps({**base, "rid": "a"}), timeout=60).content
    cached = httpx.post(f"{sim.url}/generate", content=orjson.dumps({**base, "rid": "b"}), timeout=60).content
    assert parse_states(first, sequence, SHAPE, "first").size == len(sequence) * SHAPE.row_values
    # The second request's prefix comes from the radix cache: SGLang computes no state for it.
    with pytest.raises(CaptureError, match="state rows"):
        parse_states(cached, sequence, SHAPE, "cached")
    with pytest.raises(CaptureError, match="differ from the row"):
        parse_states(first, [*sequence[:-1], 99], SHAPE, "other tokens")


def test_max_new_tokens_zero_gets_no_states_as_in_0_5_23(demo_model, sim):
    import httpx

    answer = httpx.post(f"{sim.url}/generate", json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}, "return_hidden_states": True,
        "return_logprob": True, "logprob_start_len": 0}, timeout=60).json()
    assert answer["meta_info"]["hidden_states"] == []


def spec_with(**server) -> dict:
    return {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "t"},
            "spec": {"model": {"path": "/m"}, "datasets": [{"name": "a", "source": "/p/a.jsonl"}],
                     "output": {"uri": "/o"}, "server": server, "hiddenStates": {}}}


def test_hidden_states_are_refused_where_sglang_cannot_serve_them():
    assert parse_document(spec_with()).spec.hidden_states is not None
    with pytest.raises(SpecError, match="0.5.22.*first ships in 0.5.23"):
        parse_document(spec_with(image="lmsysorg/sglang:v0.5.22"))
    with pytest.raises(SpecError, match=r"extraArgs\[0\].*pp_size 1"):
        parse_document(spec_with(extraArgs=["--pp-size", "2"]))
    assert parse_document(spec_with(extraArgs=["--pp-size=1"])).spec.hidden_states is not None
    document = spec_with()
    document["spec"]["hiddenStates"] = {"layerIds": [1, 1]}
    with pytest.raises(SpecError, match="hiddenStates.layerIds.*repeat"):
        parse_document(document)
    document["spec"]["hiddenStates"] = {"layouts": ["parquet"]}
    with pytest.raises(SpecError, match="hiddenStates.layouts"):
        parse_document(document)
    # speculators reads the target's pre-norm final state, which 0.5.23 serves only as gpt_oss's last explicit aux
    # layer (id L - 1: models/gpt_oss.py:727-738, 1346-1352): without layerIds it is refused by name, and the
    # planner checks the architecture (tests/unit/test_speculators_layout.py). SpecForge's post-norm one comes
    # from a second pass (test_specforge_offline.py).
    document["spec"]["hiddenStates"] = {"layouts": ["speculators"]}
    with pytest.raises(SpecError, match=r"hiddenStates.layouts 'speculators' needs explicit layerIds"):
        parse_document(document)
    document["spec"]["hiddenStates"] = {"layouts": ["specforge"]}
    assert parse_document(document).spec.hidden_states.layouts == ["specforge"]


def test_tokenmill_run_captures_the_states_and_retry_failed_retries_failed_captures(tmp_path, demo_model, sim):
    from tokenmill_runner.generate.summary import EXIT_GIVEN_UP
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    spec, out = run_spec(tmp_path, demo_model, 4, hiddenStates={"convention": "eagle3"})
    # A server started without --enable-return-aux-hidden-states answers 400: every capture fails, the run says so.
    with SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0)) as plain:
        first = run_cli(spec, out, plain.url)
    assert first.returncode == EXIT_GIVEN_UP, first.stderr[-2000:]
    assert "0 captured, 0 already committed, 4 failed" in first.stdout
    storage = LocalStorage(out)
    assert captured_keys(storage, "d") == set()
    # A resume leaves failed captures alone; --retry-failed captures them.
    again = run_cli(spec, out, sim.url)
    assert "0 captured, 4 already committed, 0 failed" in again.stdout
    retried = run_cli(spec, out, sim.url, None, "--retry-failed")
    assert retried.returncode == 0, retried.stderr[-2000:]
    assert "4 captured, 0 already committed, 0 failed" in retried.stdout
    assert_every_sample_once_and_aligned(storage)
    assert not list((out / "d" / "hidden_errors").glob("*.json"))
    # What the operator shows while a pass runs (store/capture_progress.py): the last pass's counts, as written.
    found = read_capture_progress(storage, "aux")
    assert found is not None and found.workers == 1
    assert (found.counts.captured, found.counts.skipped, found.counts.failed) == (4, 0, 0)
    assert found.counts.state_bytes == sum(m["tokens"] * m["layers"] * m["hidden"] * 2
                                           for m in state_markers(storage, "d"))


def test_tokenmill_run_captures_the_states_through_smg(tmp_path, demo_model):
    """Behind SGLang's model gateway (the real smg, two replicas): the prefill chunk is read from the workers' facts
    through it (a GET of /server_info there is a 404), and the capture requests pass through it unchanged."""
    from .sims import SimProcess
    from .test_gateway import Gateway

    replicas = [SimProcess(demo_model, time_scale=5000, enable_return_aux_hidden_states=True,
                           chunked_prefill_size=CHUNK).start() for _ in range(2)]
    gateway = Gateway([replica.url for replica in replicas]).start()
    try:
        gateway.wait_ready()
        spec, out = run_spec(tmp_path, demo_model, 6, hiddenStates={})
        run = run_cli(spec, out, gateway.url)
    finally:
        gateway.stop()
        for replica in replicas:
            replica.kill()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "6 captured, 0 already committed, 0 failed" in run.stdout
    assert_every_sample_once_and_aligned(LocalStorage(out))


def test_tokenmill_run_without_a_server_captures_from_the_built_in_simulator(tmp_path, demo_model):
    spec, out = run_spec(tmp_path, demo_model, 3, hiddenStates={})
    done = subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "-q", "run", str(spec), "--out", str(out),
                           "--sim-time-scale", "5000"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "3 captured" in done.stdout
    assert len(captured_keys(LocalStorage(out), "d")) == 3


def test_the_report_shows_coverage_bytes_and_fails_on_a_length_mismatch(tmp_path, demo_model, sim):
    import orjson

    from tokenmill_runner.report.files import write_report
    from tokenmill_runner.store.hidden_states import marker_key

    spec, out = run_spec(tmp_path, demo_model, 4, hiddenStates={})
    done = run_cli(spec, out, sim.url)
    assert done.returncode == 0, done.stderr[-2000:]
    storage = LocalStorage(out)
    report, _ = write_report(storage)
    section = report["hidden_states"]["d"]
    on_disk = sum(m["bytes"] for m in state_markers(storage, "d"))
    assert (section["samples"], section["with_states"], section["coverage"], section["bytes"]) == (4, 4, 1.0, on_disk)
    assert not [f for f in report["findings"] if f["check"].startswith("hidden_states")]
    # One marker claiming a state row too few: the report fails that dataset.
    marker = next(state_markers(storage, "d"))
    key = marker_key("d", Path(marker["file"]).stem)  # the stem its file and its marker share
    storage.put(key, orjson.dumps({**marker, "tokens": marker["tokens"] - 1}))
    report, _ = write_report(storage)
    (finding,) = [f for f in report["findings"] if f["check"] == "hidden_states_length"]
    assert finding["level"] == "fail" and report["verdict"] == "fail"  # (the short outputs fail other checks too)
    assert marker["sample_id"] in finding["message"]
    # A sample without states: coverage below 1 and a failing finding.
    storage.delete(key)
    report, _ = write_report(storage)
    assert report["hidden_states"]["d"]["coverage"] == 0.75
    assert [f["check"] for f in report["findings"] if f["check"].startswith("hidden")] == ["hidden_states_coverage"]


def test_two_writers_capturing_the_same_run_leave_one_aligned_file_per_sample(tmp_path, demo_model, sim):
    storage, out = generate(tmp_path, demo_model, sim, lines=6)

    async def both() -> list:
        return await asyncio.gather(*(capture_dataset(storage, "d", sim.url, SHAPE, chunked_prefill_tokens=CHUNK,
                                                      spool=tmp_path) for _ in range(2)))

    first, second = asyncio.run(both())
    assert first.failed == second.failed == 0
    # Both may capture a sample: each writer names its objects by its own token (store/ownership.py), so neither
    # replaces the other's, and a reader counts one marker per sample, each naming its own aligned file.
    files = list((out / "d" / STATES).glob("*.safetensors"))
    assert 6 <= len(files) == len(list((out / "d" / "hidden_commits").glob("*.json"))) <= 12
    assert_every_sample_once_and_aligned(storage)


def test_a_capture_pass_whose_lease_is_lost_commits_nothing_more_and_raises_lease_lost(tmp_path, demo_model, sim):
    # Issue 28: the state markers answer to the output's lease like the shards' markers (store/ownership.put_record).
    import threading

    from tokenmill_runner.store.hidden_states import failed_keys
    from tokenmill_runner.store.lease import LeaseKeeper, LeaseLost, acquire
    from tokenmill_runner.store.lease_rules import LeaseTimes
    from tokenmill_runner.store.manifest import Owner

    storage, _ = generate(tmp_path, demo_model, sim, lines=6)
    times, clock = LeaseTimes(stale_s=120.0), FakeClock()
    acquired = acquire(storage, Owner(kind="cli", name="capture"), "here:1", "tok", times=times, clock=clock,
                       sleep=clock.sleep)
    keeper = LeaseKeeper(storage, acquired, times=times, clock=clock, every_s=3600)
    proofs, lock = [0], threading.Lock()

    def prove() -> AbstractContextManager[None]:
        with lock:
            proofs[0] += 1
            if proofs[0] == 3:  # the writer is paused past the stale period before its third marker
                clock.now += times.stale_s + 1
        return keeper.writing()

    with pytest.raises(LeaseLost, match="past its stale period"):
        asyncio.run(capture_dataset(storage, "d", sim.url, SHAPE, chunked_prefill_tokens=CHUNK, concurrency=2,
                                    fence=replace(keeper.commit_fence, proof=prove)))
    assert len(captured_keys(storage, "d")) == 2, "only the markers proved while the lease was held"
    assert failed_keys(storage, "d") == set(), "nor is any failure recorded"
    # The next holder captures the rest; every sample's states then counted once.
    again = asyncio.run(capture_dataset(storage, "d", sim.url, SHAPE, chunked_prefill_tokens=CHUNK))
    assert (again.captured, again.skipped, again.failed) == (4, 2, 0)
    assert_every_sample_once_and_aligned(storage)


def test_tokenmill_run_taken_over_during_its_capture_pass_exits_6_and_the_taker_s_states_count(
        tmp_path, demo_model, sim):
    from tokenmill_runner.generate.summary import EXIT_LEASE_LOST
    from tokenmill_runner.store.lease import read_lease

    spec, out = run_spec(tmp_path, demo_model, 4, hiddenStates={"convention": "eagle3"})
    command = [sys.executable, "-m", "tokenmill_runner.cli", "-q", "run", str(spec), "--out", str(out),
               "--server", sim.url, "--server-wait", "2"]
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env["TOKENMILL_LEASE_STALE_SECONDS"] = "6"
    # Its own cache folder: to the taker, a process of another machine, so only the lease's staleness frees it.
    paused = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, FAULT_ENV: "pause-after:states:1",
                                   "TOKENMILL_CACHE": str(tmp_path / "cache-elsewhere")})
    try:
        _, status = os.waitpid(paused.pid, os.WUNTRACED)  # stopped between its first state file and its marker
        assert os.WIFSTOPPED(status), "the capture pass never reached its first state file"
        assert captured_keys(LocalStorage(out), "d") == set()
        taker = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert taker.returncode == 0, taker.stderr[-2000:]
        assert "4 captured" in taker.stdout
    finally:
        paused.send_signal(signal.SIGCONT)
    _, stderr = paused.communicate(timeout=300)
    assert paused.returncode == EXIT_LEASE_LOST, stderr[-2000:]
    assert "lease lost" in stderr and "committed nothing after that" in stderr
    storage = LocalStorage(out)
    assert_every_sample_once_and_aligned(storage)
    assert read_lease(storage) is None, "the taker gave the lease up; the taken-over writer left it alone"
