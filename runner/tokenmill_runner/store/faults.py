"""Test-only fault points in the commit protocol: the runner SIGKILLs itself at a chosen step of a chosen commit.

Tests set `TOKENMILL_FAULT` to kill the runner exactly between two writes of the protocol (data, then errors, then
the marker) instead of at a wall-clock moment that may fall anywhere:

    TOKENMILL_FAULT=kill-after:data:3      SIGKILL right after this process's 3rd shard data write
    TOKENMILL_FAULT=kill-after:errors:1    ... right after its 1st error-file write (before that shard's marker)
    TOKENMILL_FAULT=kill-before:marker:2   ... right before its 2nd marker write
    TOKENMILL_FAULT=kill-after:marker:5,kill-before:data:9   several rules: the first one reached fires
    TOKENMILL_FAULT=pause-after:data:2     SIGSTOP (not kill) right after its 2nd data write: a writer paused
                                           between a shard's data and its marker, until the test sends SIGCONT
    TOKENMILL_FAULT=stall-after:data:1     from its 1st data write on, every write of the protocol (lease
                                           renewals included) waits until the file $TOKENMILL_FAULT_RELEASE
                                           exists: a live writer whose PUTs hang (a store cut off), not a
                                           stopped process

Steps are `data`, `errors`, `counts`, `marker` (and `states`, `states-marker`, `final-states`, `final-marker`, `lease`: a renewal, `fenced`: a commit record's
write whose lease proof just passed, the window seals.py closes); counts are per step and per process (`before:N`
is the N-th write of that step to start, `after:N` the N-th to finish). Unset (always, in production) every fault point is a no-op.
The process announces the point and the object it concerns on stderr before it dies, so a test can tell it fired
and check what the store holds at that moment.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass

FAULT_ENV = "TOKENMILL_FAULT"
RELEASE_ENV = "TOKENMILL_FAULT_RELEASE"
# counts: a shard's loss-token counts (store/token_counts.py), after its errors; states and states-marker: a
# sample's aux hidden-state file and its marker, final-states and final-marker the same
# for its final state (store/hidden_states.py); lease: a renewal;
# fenced: a commit record's PUT after its lease proof (ownership.put_record).
STEPS = ("data", "errors", "counts", "marker", "states", "states-marker", "final-states", "final-marker", "lease",
         "fenced")
_RULE = re.compile(rf"(kill|pause|stall)-(before|after):({'|'.join(STEPS)}):([1-9][0-9]*)")
_RELEASE_POLL_S = 0.1


@dataclass(frozen=True)
class FaultRule:
    moment: str  # before | after
    step: str  # data | errors | marker
    count: int  # the n-th write of that step in this process
    action: str = "kill"  # kill (SIGKILL) | pause (SIGSTOP) | stall (every later write waits for the release)

    def __str__(self) -> str:
        return f"{self.action}-{self.moment}:{self.step}:{self.count}"


def parse_rules(text: str) -> list[FaultRule]:
    rules = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _RULE.fullmatch(part)
        if not match:
            raise ValueError(f"{FAULT_ENV}: {part!r} is not kill|pause|stall-before|after:"
                             f"{'|'.join(STEPS)}:N (N >= 1)")
        if match.group(1) == "stall" and not os.environ.get(RELEASE_ENV):
            raise ValueError(f"{FAULT_ENV}: {part!r} needs {RELEASE_ENV}, the file whose creation ends the stall")
        rules.append(FaultRule(match.group(2), match.group(3), int(match.group(4)), match.group(1)))
    return rules


class FaultPoints:
    """Counts the protocol's writes per step and kills the process where a rule says."""

    def __init__(self, rules: list[FaultRule]) -> None:
        self.rules = rules
        # Writes started and finished, counted apart: commits run in parallel threads, so the N-th write can start
        # before the (N-1)-th has finished.
        self._counts = {(moment, step): 0 for moment in ("before", "after") for step in STEPS}
        self._lock = threading.Lock()
        self._stalled = threading.Event()

    def before(self, step: str, key: str) -> None:
        self._reach("before", step, key)

    def after(self, step: str, key: str) -> None:
        self._reach("after", step, key)

    def _reach(self, moment: str, step: str, key: str) -> None:
        if self.rules:
            with self._lock:
                self._counts[moment, step] += 1
                self._check(moment, step, self._counts[moment, step], key)
            if moment == "before" and self._stalled.is_set():
                release = os.environ[RELEASE_ENV]
                while not os.path.exists(release):
                    time.sleep(_RELEASE_POLL_S)

    def _check(self, moment: str, step: str, count: int, key: str) -> None:
        for rule in self.rules:
            if (rule.moment, rule.step, rule.count) == (moment, step, count):
                if rule.action == "stall":
                    sys.stderr.write(f"{FAULT_ENV}: {rule} reached at {key}, every later write waits for "
                                     f"{os.environ[RELEASE_ENV]}\n")
                    sys.stderr.flush()
                    self._stalled.set()
                    continue
                stop = rule.action == "pause"
                what = "pausing the runner (SIGSTOP)" if stop else "killing the runner (SIGKILL)"
                sys.stderr.write(f"{FAULT_ENV}: {rule} reached at {key}, {what}\n")
                sys.stderr.flush()
                if stop:
                    # Not while another thread holds a local folder's flock (a lease renewal): the writer that
                    # takes over would wait on it until this process is resumed, which the test does after it.
                    from .storage import FLOCK_SECTION

                    # To this thread, not the process: kill(getpid()) hands a stop to the main thread, and the
                    # writing thread went on until that one ran, past its next write (a marker after the "pause":
                    # 22 of 30 times in a loop on the 2-core machine); a stop sent to this thread takes it at once.
                    with FLOCK_SECTION:
                        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
                    return
                os.kill(os.getpid(), signal.SIGKILL)


_points: FaultPoints | None = None
_points_lock = threading.Lock()


def points() -> FaultPoints:
    """This process's fault points, read from the environment once (one set of counters for every thread)."""
    global _points
    with _points_lock:
        if _points is None:
            _points = FaultPoints(parse_rules(os.environ.get(FAULT_ENV, "")))
        return _points
