"""Two real `tokenmill run` processes on one S3 output (moto's server, through the fault proxy): the races of issue
29. Exactly one writes at a time; no slot is committed twice; no marker names a missing file; a writer that cannot
prove it still holds the lease commits nothing more and exits 6 (docs/running.md). The lease's periods are shortened
for the test (TOKENMILL_LEASE_STALE_SECONDS=6: renewals every 1 s, commits fenced past 4.5 s without one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest

from tests.faults.s3_proxy import Rule, S3FaultProxy
from tests.recount import as_counter, recount
from tokenmill_runner.store.faults import FAULT_ENV, RELEASE_ENV
from tokenmill_runner.store.lease import LEASE
from tokenmill_runner.store.markers import list_commits, read_markers
from tokenmill_runner.store.storage import Storage, open_storage, s3_client
from tokenmill_runner.store.token_counts import dataset_frequencies

from .workloads import chat, spec_document, write_spec

STALE = "6"
PROMPTS = 400
EXIT_OK, EXIT_USAGE, EXIT_LEASE_LOST = 0, 2, 6


@pytest.fixture
def proxy(s3_endpoint: str):
    with S3FaultProxy(s3_endpoint) as running:
        yield running


def output(s3_endpoint: str, bucket: str, tmp_path: Path, prompts: int = PROMPTS) -> tuple[Path, str]:
    body = b"\n".join(orjson.dumps(chat(i)) for i in range(prompts)) + b"\n"
    s3_client(s3_endpoint).put_object(Bucket=bucket, Key="prompts/p.jsonl", Body=body)
    out = f"s3://{bucket}/runs/one/"
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        Path(os.environ.get("TOKENMILL_DEMO_MODEL", Path(__file__).resolve().parents[2] / "examples" / "demo-model")),
        [{"name": "p", "source": f"s3://{bucket}/prompts/p.jsonl"}], out,
        sampling={"maxNewTokens": 512, "temperature": "0.6"},
        runner={"concurrency": 16, "shardMaxSamples": 8, "shardMaxSeconds": 1, "maxAttempts": 8}))
    return spec, out


def start(spec: Path, endpoint: str, tmp_path: Path, name: str, *extra: str, scale: str = "20",
          env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "TOKENMILL_LEASE_STALE_SECONDS": STALE, "TOKENMILL_CACHE": str(tmp_path / f"cache-{name}"),
           **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "tokenmill_runner.cli", "-q", "run", str(spec), "--s3-endpoint",
                             endpoint, "--name", name, "--sim-time-scale", scale, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    _, stderr = process.communicate(timeout=600)
    return process.returncode, stderr


def slots(storage: Storage) -> Counter[tuple[int, int]]:
    counted: Counter[tuple[int, int]] = Counter()
    for marker in read_markers(storage, "p"):
        for part in (marker["samples"], marker["failed"]):
            counted.update(zip(part["line"], part.get("sample_index") or [0] * len(part["line"]), strict=True))
    return counted


def assert_one_writer_s_truth(storage: Storage) -> None:
    """No slot counted twice, no marker naming a missing file, every slot settled."""
    counted = slots(storage)
    assert [slot for slot, n in counted.items() if n > 1] == [], "slots committed twice"
    for marker in read_markers(storage, "p"):
        for key in (marker.get("data"), marker.get("errors")):
            assert not key or storage.exists(f"p/{key}"), f"marker {marker['shard_id']} names a missing p/{key}"
    assert set(counted) == {(line, 0) for line in range(1, PROMPTS + 1)}


def test_two_runs_started_together_with_one_lease_write_slowed_one_writes_and_the_other_is_refused(
        proxy, s3_endpoint, s3_bucket, tmp_path):
    # Issue 29: the second's lease PUT slowed past the old read-back's settle time made both hold the lease: 144
    # slots committed twice. Each run's lease writes go through their own proxy: the first's land after 3 s, the
    # second's after 6 s, so both read "no lease" and both write one.
    spec, out = output(s3_endpoint, s3_bucket, tmp_path)
    with S3FaultProxy(s3_endpoint) as other:
        fast = proxy.add(Rule("delay", method="PUT", path=r"/runs/one/lease\.json", delay_s=3.0))
        slow = other.add(Rule("delay", method="PUT", path=r"/runs/one/lease\.json", delay_s=6.0))
        first = start(spec, proxy.url, tmp_path, "first")
        second = start(spec, other.url, tmp_path, "second")
        codes = {"first": finish(first), "second": finish(second)}
    assert sorted(code for code, _ in codes.values()) == [EXIT_OK, EXIT_USAGE], codes
    refused = next(stderr for code, stderr in codes.values() if code == EXIT_USAGE)
    assert "the output is being written by tokenmill run" in refused, refused[-2000:]
    assert fast.matched >= 1 and slow.matched >= 1, "both runs wrote a lease"
    assert_one_writer_s_truth(open_storage(out, s3_endpoint))


def test_a_paused_writer_taken_over_after_the_stale_period_commits_nothing_more_and_exits_6(
        proxy, s3_endpoint, s3_bucket, tmp_path):
    # Issue 29: a writer paused (Ctrl-Z, a frozen node) while a commit was in flight wrote its marker once resumed,
    # after another run had taken over and deleted its unmarked shard: slots twice, markers naming deleted files.
    spec, out = output(s3_endpoint, s3_bucket, tmp_path)
    proxy.add(Rule("delay", method="PUT", path=r"/runs/one/p/shards/", skip=2, delay_s=3.0))
    paused = start(spec, proxy.url, tmp_path, "paused")
    try:
        proxy.wait_fired("delay", timeout=120)  # its third shard's data write is in flight
        paused.send_signal(signal.SIGSTOP)
        taker = start(spec, s3_endpoint, tmp_path, "taker", scale="2000")
        code, stderr = finish(taker)
        assert code == EXIT_OK, stderr[-3000:]
        assert "was not renewed for" in stderr or "watching it" in stderr, stderr[-3000:]
    finally:
        paused.send_signal(signal.SIGCONT)
    code, stderr = finish(paused)
    assert code == EXIT_LEASE_LOST, stderr[-3000:]
    assert "lease lost" in stderr and "committed nothing after that" in stderr
    storage = open_storage(out, s3_endpoint)
    assert_one_writer_s_truth(storage)
    assert storage.exists(LEASE)


def test_a_marker_written_after_its_writer_was_taken_over_counts_for_nobody(s3_endpoint, s3_bucket, tmp_path):
    # Issue 29: a writer stopped between its lease proof and its marker's PUT (SIGSTOP there, a PUT held in flight)
    # lands that marker after another run took over and generated the same slots: no write of the taker can refuse
    # it on S3. The taker seals the old run token first, and every reader ignores a marker its seal does not name.
    # The fault stops the writer exactly there: its second marker, proved, waits (and so do its renewals).
    spec, out = output(s3_endpoint, s3_bucket, tmp_path)
    release = tmp_path / "release"
    stalled = start(spec, s3_endpoint, tmp_path, "stalled",
                    env_extra={FAULT_ENV: "stall-before:fenced:2", RELEASE_ENV: str(release)})
    try:
        assert stalled.stderr is not None
        announced = ""
        while "stall-before:fenced:2 reached" not in announced:
            line = stalled.stderr.readline()
            assert line, announced[-3000:]
            announced += line
        taker = start(spec, s3_endpoint, tmp_path, "taker", scale="2000")
        code, stderr = finish(taker)
        assert code == EXIT_OK, stderr[-3000:]
        assert "sealed run token" in stderr or "was not renewed for" in stderr, stderr[-3000:]
    finally:
        release.touch()
    code, stderr = finish(stalled)
    assert code == EXIT_LEASE_LOST, stderr[-3000:]
    storage = open_storage(out, s3_endpoint)
    assert_one_writer_s_truth(storage)
    late = [entry.shard_id for entry in list_commits(storage, "p") if entry.late]
    assert late, "the stalled marker landed after the takeover (and counts for nobody)"
    # Its loss-token counts were written before its marker and count for nobody either: the counts equal a recount
    # of the rows that count.
    assert as_counter(dataset_frequencies(storage, "p")) == recount(storage, "p")[0]


def test_a_slow_renewal_cannot_overwrite_a_take_over(proxy, s3_endpoint, s3_bucket, tmp_path):
    # Issue 29: the taken-over writer's renewal, slowed in flight, landed after --take-over: the taker stopped and
    # the taken-over writer went on, the opposite of what docs/reliability.md promises.
    spec, out = output(s3_endpoint, s3_bucket, tmp_path)
    slow = proxy.add(Rule("delay", method="PUT", path=r"/runs/one/lease\.json", skip=2, delay_s=8.0))
    # Slow answers: on a loaded machine the taker's start-up took 30 s, and a writer at scale 20 had finished (and
    # released the lease) before the taker looked; this one is still writing when any taker arrives.
    taken = start(spec, proxy.url, tmp_path, "taken", scale="5")
    proxy.wait_fired("delay", timeout=120)  # its second renewal is on its way, slowly
    taker = start(spec, s3_endpoint, tmp_path, "taker", "--take-over", scale="2000")
    code, stderr = finish(taker)
    assert code == EXIT_OK, stderr[-3000:]
    assert "taking the output over" in stderr
    code, stderr = finish(taken)
    assert slow.matched >= 3 and code == EXIT_LEASE_LOST, stderr[-3000:]
    assert_one_writer_s_truth(open_storage(out, s3_endpoint))
