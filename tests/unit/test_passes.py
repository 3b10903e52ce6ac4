"""Reconcile passes: one at a time per resource, requests folded together, deletion stops a pass in progress."""

from __future__ import annotations

import asyncio
import threading
import time

from tokenmill_operator.passes import PassScheduler

A = ("ns", "a", "uid-a")
B = ("ns", "b", "uid-b")


class Recorder:
    """A pass that blocks until released, and records what ran and how many ran at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.running: dict[str, int] = {}
        self.most_at_once: dict[str, int] = {}
        self.runs: list[str] = []
        self.saw_stopped: list[bool] = []

    def __call__(self, key, stopped):
        name = key[1]
        with self.lock:
            self.running[name] = self.running.get(name, 0) + 1
            self.most_at_once[name] = max(self.most_at_once.get(name, 0), self.running[name])
            self.runs.append(name)
        self.started.release()
        self.release.wait(5)
        self.saw_stopped.append(stopped())
        with self.lock:
            self.running[name] -= 1
        return name


async def wait_started(recorder: Recorder, count: int = 1) -> None:
    for _ in range(count):
        while not recorder.started.acquire(blocking=False):
            await asyncio.sleep(0.005)


def test_requests_during_a_pass_fold_into_one_more_pass_never_two_at_once():
    recorder, done = Recorder(), []

    async def scenario():
        scheduler = PassScheduler(recorder, lambda key, result: done.append(result))
        scheduler.request(A)
        await wait_started(recorder)
        for _ in range(5):  # the timer and three spec edits while the first pass is still reading markers
            scheduler.request(A)
        recorder.release.set()
        await scheduler.idle()

    asyncio.run(scenario())
    assert recorder.runs == ["a", "a"], "five requests during a pass make one more pass, not five"
    assert recorder.most_at_once["a"] == 1
    assert done == ["a", "a"]


def test_different_resources_run_side_by_side():
    recorder = Recorder()

    async def scenario():
        scheduler = PassScheduler(recorder, lambda key, result: None)
        scheduler.request(A)
        scheduler.request(B)
        await wait_started(recorder, 2)  # both started before either was released
        recorder.release.set()
        await scheduler.idle()

    asyncio.run(scenario())
    assert sorted(recorder.runs) == ["a", "b"]


def test_deletion_stops_the_pass_in_progress_and_drops_requests_until_it_ended():
    recorder = Recorder()

    async def scenario():
        scheduler = PassScheduler(recorder, lambda key, result: None)
        scheduler.request(A)
        await wait_started(recorder)
        scheduler.forget("uid-a")
        assert scheduler.request(A) is None, "no new pass for a resource being deleted"
        recorder.release.set()
        await scheduler.idle()
        return scheduler

    scheduler = asyncio.run(scenario())
    assert recorder.runs == ["a"] and recorder.saw_stopped == [True]
    assert scheduler.stopped("uid-a")() is False, "nothing kept once the pass ended"


def test_a_failing_pass_does_not_stop_later_passes():
    calls = []

    def flaky(key, stopped):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("API server hiccup")
        return "ok"

    results = []

    async def scenario():
        scheduler = PassScheduler(flaky, lambda key, result: results.append(result))
        await scheduler.request(A)
        await scheduler.request(A)

    asyncio.run(scenario())
    assert len(calls) == 2 and results == ["ok"]


def test_stopping_ends_the_waits_at_once_and_starts_no_pass_after(caplog):
    """SIGTERM while a pass waits on a slow store: the operator's tasks end now (the thread is left to the exit), and
    a timer that still fires asks for nothing (it logged 'cannot schedule new futures after shutdown' as a failed
    pass)."""
    recorder = Recorder()

    async def scenario():
        scheduler = PassScheduler(recorder, lambda key, result: None)
        running = scheduler.request(A)
        await wait_started(recorder)
        scheduler.shutdown()
        await asyncio.wait_for(asyncio.gather(running, return_exceptions=True), 1)
        assert running.cancelled()
        assert scheduler.request(A) is None and scheduler.request(B) is None

    try:
        asyncio.run(scenario())
    finally:
        recorder.release.set()
    assert recorder.runs == ["a"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_pass_that_stopped_at_its_share_of_markers_is_followed_by_another_at_once(monkeypatch):
    """A resource with a backlog of markers (gather.MARKERS_PER_PASS a pass) is not left waiting for its timer: each
    pass that ends behind asks for the next, and the passes stop once one has read everything."""
    from types import SimpleNamespace

    from tokenmill_operator import handlers
    from tokenmill_operator.reconcile import PassResult

    behind = [True, True, False]
    runs: list[bool] = []

    def run(key, stopped):
        runs.append(behind[len(runs)])
        return PassResult({}, SimpleNamespace(events=[]), None, behind=runs[-1])  # type: ignore[arg-type]

    async def scenario():
        scheduler = PassScheduler(run, handlers._done)
        monkeypatch.setattr(handlers, "SCHEDULER", scheduler)
        scheduler.request(A)
        await scheduler.idle()

    asyncio.run(scenario())
    assert runs == [True, True, False], "one request, three passes: two behind, the last caught up"


def test_a_pass_starts_not_behind_whatever_the_last_one_left(tmp_path):
    """A pass that reads no marker (the resource is gone, or its run ended) never asks for another: `behind` is
    this pass's, not a leftover of an earlier one (which would make passes follow each other for ever)."""
    from tokenmill_operator.decide.settings import OperatorSettings
    from tokenmill_operator.observe.gather import OutputIndex
    from tokenmill_operator.reconcile import run_pass

    class Gone:
        def get(self, *args, **kwargs):
            return None

    output = OutputIndex(behind=True)
    assert run_pass(Gone(), "a", "ns", "uid-a", output, OperatorSettings()) is None  # type: ignore[arg-type]
    assert output.behind is False
