"""The review of f9665d2 (bugs 2, 3, 4 and 10: the hidden-state passes with several workers, a later pass, transient
capture errors and a dead replica), each as a named regression test against the real `tokenmill run` (workers of one
DatasetGeneration as the operator starts them: --owner-uid, --workers, --worker-index, --job-hash) and the simulator.
Each fails on f9665d2; the rules they hold are docs/reliability.md's one split (store/work_split.py) and one
definition of done (store/completion.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill_runner.generate.summary import EXIT_GIVEN_UP, EXIT_OK
from tokenmill_runner.source.prompts import id_hash
from tokenmill_runner.store.faults import FAULT_ENV, RELEASE_ENV
from tokenmill_runner.store.hidden_states import AUX, FINAL, captured_keys, failed_keys
from tokenmill_runner.store.storage import LocalStorage

from .test_hidden_states import rows_by_key, run_spec, sim_server

LINES = 12


@pytest.fixture
def aux_sim(demo_model: Path):
    with sim_server(demo_model, enable_return_aux_hidden_states=True) as server:
        yield server


def start(spec: Path, out: Path, servers: list[str], *extra: str, fault: str | None = None,
          release: Path | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, RELEASE_ENV)}
    if fault:
        env[FAULT_ENV] = fault
    if release:
        env[RELEASE_ENV] = str(release)
    command = [sys.executable, "-m", "tokenmill_runner.cli", "-q", "run", str(spec), "--out", str(out),
               "--server-wait", "5"]
    for url in servers:
        command += ["--server", url]
    return subprocess.Popen([*command, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def worker(index: int, count: int, job: str) -> list[str]:
    """The flags the operator's runner Job gives worker `index` (manifests.runner_args)."""
    return ["--name", "dg", "--owner-uid", "uid-1", "--workers", str(count), "--worker-index", str(index),
            "--job-hash", job]


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr


def every_row_has_states(out: Path) -> bool:
    """Straight from the store (not through the code under test): a committed state marker for every committed
    row."""
    storage = LocalStorage(out)
    return captured_keys(storage, "d", AUX) == set(rows_by_key(storage, "d"))


def test_review_bug_2_lowering_parallelism_after_the_stream_leaves_no_sample_without_states(
        tmp_path, demo_model, aux_sim):
    """3 workers generate, worker 2 is killed before its capture pass; a Job of 2 workers captures the rest: the
    capture pass is split by the current count, not by the worker that committed a row (f9665d2: each worker
    captured only the rows its index had committed, so worker 2's rows never got states and every worker exited
    7)."""
    spec, out = run_spec(tmp_path, demo_model, LINES, hiddenStates={})
    ids = [f"s{i:04d}" for i in range(1, LINES + 1)]
    assert any(id_hash(sid) % 3 == 2 for sid in ids), "worker 2 of 3 must commit something"
    first = [start(spec, out, [aux_sim.url], *worker(i, 3, "h1"), fault="kill-before:states:1" if i == 2 else None)
             for i in range(3)]
    codes = [finish(process)[0] for process in first]
    assert codes[2] == -signal.SIGKILL, codes
    # The first two captured their own share and are done with it (bug 10: f9665d2 exited 7, counting worker 2's).
    assert codes[:2] == [EXIT_OK, EXIT_OK], codes
    storage = LocalStorage(out)
    rows = rows_by_key(storage, "d")
    assert len(rows) == LINES and len(captured_keys(storage, "d")) < LINES, "worker 2's rows are without states"
    second = [start(spec, out, [aux_sim.url], *worker(i, 2, "h2")) for i in range(2)]
    ended = [finish(process) for process in second]
    assert [code for code, _, _ in ended] == [EXIT_OK, EXIT_OK], [err[-1500:] for _, _, err in ended]
    assert captured_keys(storage, "d") == set(rows), "every committed sample has its states"


def test_review_bug_10_a_worker_whose_share_is_captured_exits_0_while_another_still_captures(
        tmp_path, demo_model, aux_sim):
    """Two workers of one Job; worker 1 is slow in its capture pass (its state writes wait): worker 0 ends first
    and exits 0, judging its own share (f9665d2: it exited 7, "states still to capture", counting worker 1's rows,
    and exit 7 counted against the Job's retries)."""
    spec, out = run_spec(tmp_path, demo_model, LINES, hiddenStates={})
    release = tmp_path / "release"
    slow = start(spec, out, [aux_sim.url], *worker(1, 2, "h1"), fault="stall-before:states:1", release=release)
    try:
        first = start(spec, out, [aux_sim.url], *worker(0, 2, "h1"))
        code, stdout, stderr = finish(first)
        assert slow.poll() is None, "worker 1 is still capturing"
        assert code == EXIT_OK, stderr[-2000:]
        assert "states are still to capture" not in stderr
    finally:
        release.touch()
    code, _, stderr = finish(slow)
    assert code == EXIT_OK, stderr[-2000:]
    assert every_row_has_states(out)


def test_review_bug_3_the_final_state_pass_never_generates(tmp_path, demo_model):
    """SpecForge's layout with runner.retryFailed: the aux pass gives samples up, the final-state pass (run with
    --retry-failed, as the operator's Job is) must not generate them: they would never get aux states (f9665d2: it
    generated them and exited 0)."""
    spec, out = run_spec(tmp_path, demo_model, LINES, hiddenStates={"layouts": ["specforge"]},
                         runner={"concurrency": 8, "shardMaxSamples": 4, "shardMaxSeconds": 1, "maxAttempts": 1,
                                 "retryFailed": True})
    with sim_server(demo_model, enable_return_aux_hidden_states=True, fault_nan_rate=0.5) as aux:
        code, _, stderr = finish(start(spec, out, [aux.url], "--states-pass", "aux"))
    assert code == EXIT_GIVEN_UP, stderr[-2000:]
    storage = LocalStorage(out)
    rows = set(rows_by_key(storage, "d"))
    assert 0 < len(rows) < LINES, "the aux pass gave samples up"
    with sim_server(demo_model, enable_return_hidden_states=True) as final:
        code, stdout, stderr = finish(start(spec, out, [final.url], "--states-pass", "final"))
    assert set(rows_by_key(storage, "d")) == rows, "the final pass generated samples"
    # Every committed sample has its aux states, or their capture is recorded as failed (the aux pass's own).
    assert rows <= captured_keys(storage, "d", AUX) | failed_keys(storage, "d", AUX)
    assert captured_keys(storage, "d", FINAL) == rows
    assert code == EXIT_GIVEN_UP, stderr[-2000:]  # the given-up samples are still there: never a success


def test_review_bug_4_a_503_during_the_capture_pass_is_retried_not_recorded(tmp_path, demo_model):
    """Half the requests answer 503 (a full queue): the capture pass retries them as the stream does (f9665d2:
    each was the sample's final capture failure)."""
    spec, out = run_spec(tmp_path, demo_model, LINES, hiddenStates={})
    with sim_server(demo_model, enable_return_aux_hidden_states=True, fault_503_rate=0.5) as flaky:
        code, stdout, stderr = finish(start(spec, out, [flaky.url]))
    assert code == EXIT_OK, stderr[-2000:]
    assert f"{LINES} captured, 0 already committed, 0 failed" in stdout
    assert not failed_keys(LocalStorage(out), "d")


def test_review_bug_4_a_replica_that_dies_before_the_capture_pass_leaves_it_to_the_live_one(
        tmp_path, demo_model):
    """Two replicas; the runner pauses at its first state file and replica A is killed meanwhile: every capture
    goes to B (f9665d2 sent every capture to the first --server and recorded each as failed)."""
    spec, out = run_spec(tmp_path, demo_model, LINES, hiddenStates={})
    with sim_server(demo_model, enable_return_aux_hidden_states=True) as a, \
            sim_server(demo_model, enable_return_aux_hidden_states=True) as b:
        process = start(spec, out, [a.url, b.url], fault="pause-before:states:1")
        _, status = os.waitpid(process.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), "the capture pass never reached its first state file"
        a.kill()
        process.send_signal(signal.SIGCONT)
        code, stdout, stderr = finish(process)
    assert code == EXIT_OK, stderr[-2000:]
    assert f"{LINES} captured, 0 already committed, 0 failed" in stdout
    assert every_row_has_states(out)
