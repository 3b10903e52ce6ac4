"""The capture pass's progress objects (store/capture_progress.py): what the operator shows while a hidden-state
pass runs and what keeps it from calling a capturing run stalled, since the pass commits no shard."""

from __future__ import annotations

from datetime import timedelta

import orjson

from tokenmill_operator.decide.facts import JobState
from tokenmill_operator.decide.lifecycle import decide
from tokenmill_operator.decide.status import StatesPass
from tokenmill_runner.store.capture_progress import (
    MAX_PROGRESS_BYTES,
    CaptureCounts,
    CaptureProgress,
    ProgressBeat,
    progress_prefix,
    read_capture_progress,
)
from tokenmill_runner.store.storage import LocalStorage

from .test_lifecycle import T0, conditions, observed, progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_worker_writes_at_once_then_at_most_once_a_period_and_only_when_it_moved(tmp_path):
    storage, clock = LocalStorage(tmp_path), Clock()
    beat = ProgressBeat(storage, "final", 3, every_s=30, clock=clock)
    first = beat.due(CaptureCounts(captured=1))
    assert first is not None and beat.due(CaptureCounts(captured=2)) is None, "a period has not passed"
    beat.write(first)
    assert orjson.loads(storage.get(f"{progress_prefix('final')}worker-00003.json"))["captured"] == 1
    clock.now = 31
    assert beat.due(CaptureCounts(captured=1)) is None, "nothing moved since the last write: its time stays"
    assert orjson.loads(beat.due(CaptureCounts(captured=2)) or b"{}")["captured"] == 2
    assert beat.due(CaptureCounts(captured=5), final=True) is not None, "the dataset's end writes what is new"
    beat.finish(CaptureCounts(captured=5, state_bytes=10))
    clock.now = 100
    assert orjson.loads(beat.due(CaptureCounts(skipped=2)) or b"{}") == {
        "captured": 5, "skipped": 2, "failed": 0, "state_bytes": 10, "elapsed_s": 100.0}, \
        "finished datasets plus the current one, and the pass's own time so far"


def test_the_operator_sums_this_pass_s_workers_and_skips_what_it_cannot_trust(tmp_path):
    storage = LocalStorage(tmp_path)
    prefix = progress_prefix("aux")
    for worker, captured in ((0, 4), (1, 6)):
        storage.put(f"{prefix}worker-{worker:05d}.json", orjson.dumps({**asdict_counts(captured), "elapsed_s": 20}))
    storage.put(f"{prefix}worker-00002.json", b"not json")
    storage.put(f"{prefix}worker-00003.json", b" " * (MAX_PROGRESS_BYTES + 1))
    found = read_capture_progress(storage, "aux")
    assert found is not None and (found.workers, found.counts.captured, found.counts.failed) == (2, 10, 2)
    assert found.samples_per_second == 4 / 20 + 6 / 20, "each worker's captures over its own time, summed"
    assert found.eta_seconds(100) == (100 - 10 - 2 - 2) / 0.5
    assert found.last_progress is not None
    assert read_capture_progress(storage, "final") is None
    later = found.last_progress + timedelta(hours=1)
    assert read_capture_progress(storage, "aux", since=later) is None, "an earlier pass's objects are not this one's"


def asdict_counts(captured: int) -> dict[str, int]:
    return {"captured": captured, "skipped": 1, "failed": 1, "state_bytes": captured * 1000}


def test_a_capturing_run_is_not_stalled_while_its_workers_move_and_says_what_they_did():
    """Every sample settled an hour ago; the final pass's Job runs and its workers wrote progress a minute ago."""
    settled = progress(100, 0, 100, last_commit=T0 - timedelta(hours=1))
    capture = CaptureProgress(CaptureCounts(captured=40, skipped=2, failed=1, state_bytes=3_500_000_000), 4,
                              T0 - timedelta(minutes=1), samples_per_second=0.5)
    states = StatesPass(kind="final", run="1:", since="2026-11-29T11:00:00Z")
    base = dict(job=JobState(active=4), job_started=T0 - timedelta(minutes=50), progress=settled, states_pass=states)
    moving = decide(observed(**base, capture=capture))
    assert conditions(moving)["Stalled"] == ("False", "Committing")
    [progressing] = [c for c in moving.status.conditions if c.type == "Progressing"]
    assert progressing.message == ("capturing the final hidden states: 42/100 samples, 1 failed, 3.50 GB this pass "
                                   "(4 workers), ETA 00:01:54"), "57 samples left at 0.5 a second"
    stuck = CaptureProgress(capture.counts, 4, T0 - timedelta(minutes=20))
    assert conditions(decide(observed(**base, capture=stuck)))["Stalled"] == ("True", "NoCommits"), \
        "workers that stopped moving are a stall like commits that stopped"
    assert conditions(decide(observed(**base)))["Stalled"] == ("True", "NoCommits")
