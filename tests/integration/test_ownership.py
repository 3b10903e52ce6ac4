"""One ownership rule for every artifact (issue 39, store/ownership.py): the review of f9665d2's bugs 1 and 8 and its
suspected items, each with real `tokenmill run` processes stopped exactly where the review's scenario needs them
(TOKENMILL_FAULT=stall-before:...: from that write on, every write of the protocol, lease renewals included, waits
for a file the test creates), and moto's S3 server over HTTP where S3 matters. The lease's periods are shortened as
in test_lease_races.py (TOKENMILL_LEASE_STALE_SECONDS=6: renewals every 1 s, commits fenced past 4.5 s, a holder
taken over after 6 s unchanged)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import orjson
import pytest

from tests.faults.s3_proxy import FOREVER, Rule, S3FaultProxy
from tokenmill_runner.store.faults import FAULT_ENV, RELEASE_ENV
from tokenmill_runner.store.hidden_states import (
    STATE_COMMITS,
    captured_keys,
    read_state_file,
    sample_key,
    state_markers,
)
from tokenmill_runner.store.lease import LEASE, LeaseKeeper, acquire, read_versioned
from tokenmill_runner.store.lease_rules import LeaseTimes
from tokenmill_runner.store.manifest import Owner
from tokenmill_runner.store.markers import list_commits, list_records, read_markers
from tokenmill_runner.store.storage import LocalStorage, Storage, open_storage, s3_client

from .workloads import chat, spec_document, write_spec

STALE = "6"
EXIT_OK, EXIT_LEASE_LOST = 0, 6
DEMO = Path(os.environ.get("TOKENMILL_DEMO_MODEL", Path(__file__).resolve().parents[2] / "examples" / "demo-model"))


def local_spec(tmp_path: Path, prompts: int, hidden_states: dict[str, object] | None = None,
               **runner: object) -> tuple[Path, Path]:
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"\n".join(orjson.dumps(chat(i)) for i in range(prompts)) + b"\n")
    out = tmp_path / "out"
    extra = {} if hidden_states is None else {"hiddenStates": hidden_states}
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        DEMO, [{"name": "p", "source": str(source)}], str(out), sampling={"maxNewTokens": 64, "temperature": "0.6"},
        runner={"concurrency": 16, "shardMaxSamples": 8, "shardMaxSeconds": 1, "maxAttempts": 8, **runner},
        **extra))
    return spec, out


def start(spec: Path, tmp_path: Path, name: str, *extra: str, env: dict[str, str] | None = None,
          scale: str = "2000") -> subprocess.Popen:
    """`tokenmill run` with its own built-in simulator and its own cache folder (to every other process, a process of
    another machine: only the lease's staleness frees what it holds)."""
    environment = {**{k: v for k, v in os.environ.items() if k != FAULT_ENV}, "TOKENMILL_LEASE_STALE_SECONDS": STALE,
                   "TOKENMILL_CACHE": str(tmp_path / f"cache-{name}"), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "tokenmill_runner.cli", "-q", "run", str(spec), "--sim-time-scale",
                             scale, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment)


def stalled(spec: Path, tmp_path: Path, name: str, rule: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A run stopped at `rule` (a stall: it and every later write of the protocol wait for the release file)."""
    release = tmp_path / f"release-{name}"
    process = start(spec, tmp_path, name, *extra, env={FAULT_ENV: rule, RELEASE_ENV: str(release)})
    assert process.stderr is not None
    announced = ""
    while f"{rule} reached" not in announced:
        line = process.stderr.readline()
        assert line, f"{rule} never reached: {announced[-3000:]}"
        announced += line
    return process, release


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=600)
    return process.returncode, stdout, stderr


def assert_each_slot_once_and_no_dangling_marker(storage: Storage, prompts: int) -> None:
    counted: Counter[tuple[int, int]] = Counter()
    for marker in read_markers(storage, "p"):
        for part in (marker["samples"], marker["failed"]):
            counted.update(zip(part["line"], part.get("sample_index") or [0] * len(part["line"]), strict=True))
        for key in (marker.get("data"), marker.get("errors")):
            assert not key or storage.exists(f"p/{key}"), f"marker {marker['shard_id']} names a missing p/{key}"
    assert [slot for slot, n in counted.items() if n > 1] == [], "slots committed twice"
    assert set(counted) == {(line, 0) for line in range(1, prompts + 1)}


def test_review_bug_1_a_taker_seals_every_worker_of_a_shared_lease_and_no_slot_counts_twice(tmp_path):
    # Worker 0 of a DatasetGeneration proved its lease for its second marker and stopped before the PUT; worker 1
    # finished; a plain `tokenmill run` took the output over once the shared lease stood still. On f9665d2 the shared
    # record named only worker 1's token, so the taker sealed that one: worker 0's late marker counted, 8 slots twice,
    # and it named a shard the taker's cleaner had deleted (report FAIL).
    prompts = 64
    spec, out = local_spec(tmp_path, prompts)
    workers = ("--name", "dg", "--owner-uid", "uid-1", "--workers", "2", "--job-hash", "h1")
    first, release = stalled(spec, tmp_path, "w0", "stall-before:fenced:2", *workers, "--worker-index", "0")
    try:
        code, _, stderr = finish(start(spec, tmp_path, "w1", *workers, "--worker-index", "1"))
        assert code == EXIT_OK, stderr[-3000:]
        code, _, stderr = finish(start(spec, tmp_path, "taker", "--name", "taker"))
        assert code == EXIT_OK, stderr[-3000:]
        assert "was not renewed for" in stderr, stderr[-3000:]
    finally:
        release.touch()
    code, _, stderr = finish(first)
    assert code == EXIT_LEASE_LOST, stderr[-3000:]
    storage = LocalStorage(out)
    assert_each_slot_once_and_no_dangling_marker(storage, prompts)
    late = [entry.shard_id for entry in list_commits(storage, "p") if entry.late]
    assert late and all(shard.startswith("w000-") for shard in late), "worker 0's marker landed late, for nobody"


def test_review_bug_8_a_writer_taken_over_while_its_last_marker_was_in_flight_exits_6(tmp_path):
    # On f9665d2 it exited 0 with a summary counting samples that count for nobody: nothing after the stream asked
    # whether the lease was still held. Now the run proves its lease once more after its last record.
    prompts = 16
    spec, out = local_spec(tmp_path, prompts, shardMaxSeconds=60)
    first, release = stalled(spec, tmp_path, "first", "stall-before:fenced:2", "--name", "first")
    try:
        code, _, stderr = finish(start(spec, tmp_path, "taker", "--name", "taker"))
        assert code == EXIT_OK, stderr[-3000:]
    finally:
        release.touch()
    code, stdout, stderr = finish(first)
    assert code == EXIT_LEASE_LOST, (stdout[-2000:], stderr[-3000:])
    assert "lease lost" in stderr and "Report verdict" not in stdout, "no report from a run that lost its lease"
    storage = LocalStorage(out)
    assert_each_slot_once_and_no_dangling_marker(storage, prompts)
    assert [entry.late for entry in list_commits(storage, "p")].count(True) == 1


@pytest.mark.parametrize("rule", ["stall-before:states:1", "stall-before:fenced:2"],
                         ids=["its-state-file-lands-late", "its-state-marker-lands-late"])
def test_a_taken_over_capture_lands_beside_the_taker_s_states_never_over_them(tmp_path, rule):
    # Review, suspected: state files and markers were named by sample alone and the file's PUT was not fenced, so a
    # writer taken over during its capture pass replaced what the taker had committed (the taker's marker then named
    # other bytes where two captures differ); and seals covered shard markers only. One shard (fenced:1), then the
    # first sample's state file (states:1) and its marker (fenced:2).
    prompts = 6
    spec, out = local_spec(tmp_path, prompts, {"convention": "eagle3"}, shardMaxSamples=64, shardMaxSeconds=600)
    first, release = stalled(spec, tmp_path, "first", rule, "--name", "first")
    try:
        code, _, stderr = finish(start(spec, tmp_path, "taker", "--name", "taker"))
        assert code == EXIT_OK, stderr[-3000:]
    finally:
        storage = LocalStorage(out)
        committed = {key: storage.identity(key) for key in storage.list("p/") if "/hidden_" in key}
        release.touch()
    code, _, stderr = finish(first)
    assert code == EXIT_LEASE_LOST, stderr[-3000:]
    assert {key: storage.identity(key) for key in committed} == committed, "a committed object was replaced"
    markers = list(state_markers(storage, "p"))
    assert len(markers) == len(captured_keys(storage, "p")) == prompts
    for marker in markers:
        read_state_file(storage, "p", marker)  # its own file, the bytes its digest names
    if rule.endswith("fenced:2"):
        late = [entry.stem or "" for entry in list_records(storage, "p", STATE_COMMITS) if entry.late]
        assert late, "the taken-over writer's marker landed after the seal and counts for nobody"
        assert {stem.split("-")[0] for stem in late} <= {sample_key(m["sample_id"], m["sample_index"]) for m in markers}


def test_a_run_that_fails_to_commit_keeps_its_lease_while_a_marker_is_in_flight(proxy, s3_endpoint, s3_bucket,
                                                                                  tmp_path):
    # Review, suspected: a run failing with CommitFailed released its lease while another commit's marker PUT was
    # still in flight; the next run took the output at once, deleted that shard's data as a finished run's leftover,
    # generated its slots again, and then the marker landed: a dangling marker and slots twice.
    prompts = 200
    body = b"\n".join(orjson.dumps(chat(i)) for i in range(prompts)) + b"\n"
    s3_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="prompts/p.jsonl", Body=body)
    out = f"s3://{s3_bucket}/runs/one/"
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        DEMO, [{"name": "p", "source": f"s3://{s3_bucket}/prompts/p.jsonl"}], out,
        sampling={"maxNewTokens": 512, "temperature": "0.6"},
        runner={"concurrency": 16, "shardMaxSamples": 8, "shardMaxSeconds": 60, "maxAttempts": 8}))
    held = proxy.add(Rule("delay", method="PUT", path=r"/runs/one/p/commits/", delay_s=12.0))
    proxy.add(Rule("status", method="PUT", path=r"/runs/one/p/shards/", skip=1, times=FOREVER))
    # Slow answers: the store fails mid-stream, not in the final flush (which waits for every commit).
    failing = start(spec, tmp_path, "failing", "--s3-endpoint", proxy.url, "--name", "failing",
                    env={"TOKENMILL_STORAGE_RETRY_SECONDS": "1"}, scale="20")
    storage = open_storage(out, s3_endpoint)
    released, given_up = threading.Event(), []

    def watch() -> None:  # the next run starts the moment the lease is given up (or the failed run has ended)
        while failing.poll() is None:
            found = read_versioned(storage)
            if found is not None and found[0] is not None and found[0].released:
                given_up.append(storage.modified(LEASE))
                break
            released.wait(0.05)
        released.set()

    threading.Thread(target=watch, daemon=True).start()
    released.wait(300)
    assert held.matched >= 1, "a marker PUT was held in flight"
    nxt = start(spec, tmp_path, "next", "--s3-endpoint", s3_endpoint, "--name", "next")
    code, _, stderr = finish(failing)
    assert code == 1 and "cannot commit shard" in stderr, stderr[-3000:]
    # The held marker landed 12 s after it was sent; a release before that was a release under a write in flight.
    landed = storage.modified("p/commits/" + proxy.fired("delay")[0].target.split("?")[0].rsplit("/", 1)[-1])
    assert landed is not None and not [at for at in given_up if at is None or at < landed], \
        f"the lease was given up at {given_up}, before the marker in flight landed at {landed}"
    code, _, stderr = finish(nxt)
    assert code == EXIT_OK, stderr[-3000:]
    assert_each_slot_once_and_no_dangling_marker(storage, prompts)


@pytest.fixture
def proxy(s3_endpoint: str):
    with S3FaultProxy(s3_endpoint) as running:
        yield running


def test_review_bug_9_shared_renewals_of_many_workers_on_s3_each_prove_the_lease(s3_endpoint, s3_bucket):
    # 24 workers of one DatasetGeneration renewing one lease.json on a real S3 server (moto over HTTP): on f9665d2 a
    # renewal that met two 412s in a row gave up silently (26 % of rounds renewed nothing, 2 workers hit LeaseLost
    # in 40 s). Every round must now move the worker's proof forward (here every worker renews back to back, far
    # faster than the production period: the contention of hundreds of workers on one object).
    storage = open_storage(f"s3://{s3_bucket}/out/", s3_endpoint)
    times = LeaseTimes(stale_s=float(STALE))
    owner = Owner(kind="DatasetGeneration", name="dg", namespace="ml", uid="uid-1")
    keepers = [LeaseKeeper(storage, acquire(storage, owner, f"pod-{i}", f"{i:016x}", times=times), times=times,
                           every_s=3600) for i in range(24)]
    rounds: list[tuple[bool, bool]] = []  # (the proof moved, the keeper concluded the lease was lost)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(keeper: LeaseKeeper) -> None:
        try:
            for _ in range(8):
                before = keeper._renewed_at
                keeper.renew()
                with lock:
                    rounds.append((keeper._renewed_at > before, keeper.lost.is_set()))
        except BaseException as error:  # noqa: BLE001 - a renewal that raised is a round that proved nothing
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(keeper,)) for keeper in keepers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(rounds) == 24 * 8
    assert not any(lost for _, lost in rounds), "no worker lost the shared lease"
    assert sum(not moved for moved, _ in rounds) == 0, f"{len(rounds)} rounds, some proved nothing"
    assert set(read_versioned(storage)[0].tokens) == {f"{i:016x}" for i in range(24)}  # type: ignore[index,union-attr]
    assert storage.exists(LEASE)
