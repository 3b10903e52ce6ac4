"""The commit protocol's fault points kill the process exactly at the named step, leaving what that step implies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tokenmill_runner.store.faults import FAULT_ENV, RELEASE_ENV, FaultRule, parse_rules
from tokenmill_runner.store.marker_names import shard_id_of
from tokenmill_runner.store.markers import marker_keys
from tokenmill_runner.store.storage import LocalStorage

# Three commits of one shard each: rows and errors in every one.
COMMITS = """
import sys
from tokenmill_runner.store.ledger import ShardContent
from tokenmill_runner.store.shards import commit_shard
from tokenmill_runner.store.storage import LocalStorage

storage = LocalStorage(sys.argv[1])
for n in (1, 2, 3):
    row = {"sample_id": f"s{n}", "dataset": "d", "line": n, "sample_index": 0, "prompt_ids": [1],
           "output_ids": [2], "prompt_tokens": 1, "completion_tokens": 1, "finish_reason": "stop"}
    error = {"dataset": "d", "line": 10 + n, "sample_index": 0, "sample_id": None, "reason": "invalid_json",
             "message": "x"}
    commit_shard(storage, "d", f"w000-t-{n:06d}", 0, ShardContent([row], [error]))
    print(f"committed {n}", flush=True)
"""


def committed_shards(storage: LocalStorage, dataset: str) -> set[str]:
    return {shard_id_of(key) for key in marker_keys(storage, dataset)}


def commit_three(tmp_path, rule: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", COMMITS, str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, FAULT_ENV: rule}, timeout=120)


@pytest.mark.parametrize(("rule", "present", "absent"), [
    ("kill-before:data:2", [], ["shards/w000-t-000002.parquet"]),
    ("kill-after:data:2", ["shards/w000-t-000002.parquet"], ["errors/w000-t-000002.jsonl"]),
    ("kill-after:errors:2", ["shards/w000-t-000002.parquet", "errors/w000-t-000002.jsonl"], []),
    ("kill-before:marker:2", ["shards/w000-t-000002.parquet", "errors/w000-t-000002.jsonl"], []),
    ("kill-after:marker:2", [], ["shards/w000-t-000003.parquet"]),
])
def test_the_process_dies_at_the_named_step_of_the_named_commit(tmp_path, rule, present, absent):
    done = commit_three(tmp_path, rule)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout == "committed 1\n", "the second commit never returned"
    assert f"{rule} reached at d/" in done.stderr
    storage = LocalStorage(tmp_path)
    committed = committed_shards(storage, "d")
    assert "w000-t-000001" in committed, "the commit before the fault point is complete"
    for key in present:
        assert storage.exists(f"d/{key}"), key
    for key in absent:
        assert not storage.exists(f"d/{key}"), key
    # Markers are named <time>-<shard id>.json (marker_names.py): look the shard up among the committed ones.
    assert ("w000-t-000002" in committed) == (rule == "kill-after:marker:2"), "the marker exists iff it was reached"


def test_without_the_variable_every_commit_completes(tmp_path):
    done = commit_three(tmp_path, "")
    assert done.returncode == 0 and done.stdout.count("committed") == 3, done.stderr


def test_rules_are_parsed_or_refused_with_the_variable_named():
    assert parse_rules("kill-after:data:3, kill-before:marker:1") == [FaultRule("after", "data", 3),
                                                                      FaultRule("before", "marker", 1)]
    assert parse_rules("pause-after:data:2") == [FaultRule("after", "data", 2, "pause")]
    assert parse_rules("") == []
    for bad in ("kill-after:data", "kill-after:data:0", "kill-during:data:1", "kill-after:shard:1", "stop-after:data:1"):
        with pytest.raises(ValueError, match=rf"{FAULT_ENV}: '{bad}' is not kill\|pause\|stall-before\|after"):
            parse_rules(bad)
    with pytest.raises(ValueError, match=f"needs {RELEASE_ENV}"):
        parse_rules("stall-after:data:1")


def test_a_stall_holds_every_later_write_until_its_release_file_exists(tmp_path):
    """The writer stays alive (its threads run) while its writes hang, as when the store is cut off."""
    release = tmp_path / "release"
    writer = subprocess.Popen([sys.executable, "-c", COMMITS, str(tmp_path / "out")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, FAULT_ENV: "stall-after:data:1", RELEASE_ENV: str(release)})
    assert writer.stderr is not None and writer.stdout is not None
    announced = writer.stderr.readline()
    assert "stall-after:data:1 reached at d/shards/w000-t-000001.parquet" in announced, announced
    storage = LocalStorage(tmp_path / "out")
    assert writer.poll() is None and committed_shards(storage, "d") == set(), "the marker waits"
    release.touch()
    stdout, _ = writer.communicate(timeout=120)
    assert writer.returncode == 0 and stdout.count("committed") == 3
    assert len(committed_shards(storage, "d")) == 3


# A writer thread reaches a pause point while the main thread waits (as the event loop does in epoll), then writes.
PAUSED_WRITER = """
import pathlib, sys, threading, time
from tokenmill_runner.store.faults import points

def write() -> None:
    points().after("data", "k")
    pathlib.Path(sys.argv[1]).touch()  # the write the pause must come before

threading.Thread(target=write).start()
time.sleep(0.5)
"""


def test_a_pause_stops_the_writing_thread_before_its_next_write(tmp_path):
    # kill(getpid(), SIGSTOP) from a writer thread handed the stop to the main thread and the writer went on past its
    # next write (22 of 30 times on the 2-core machine): a "paused" writer had written its marker
    # (test_hidden_states.py's capture pass taken over failed so in CI). The stop is sent to the writing thread.
    for attempt in range(10):
        written = tmp_path / f"after-{attempt}"
        process = subprocess.Popen([sys.executable, "-c", PAUSED_WRITER, str(written)],
                                   env={**os.environ, FAULT_ENV: "pause-after:data:1"}, stderr=subprocess.DEVNULL)
        try:
            _, status = os.waitpid(process.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status)
            assert not written.exists(), f"attempt {attempt}: the paused writer wrote after its pause point"
        finally:
            process.send_signal(signal.SIGCONT)
        assert process.wait(timeout=30) == 0 and written.exists()
