"""The hidden-state capture pass's progress, where the operator can read it.

The pass commits no shard: after the stream the run's commit markers stand still for its whole length (hours at the
JSON rate, docs/planning.md section 7), and a run whose only clock is its commits would look stalled. So each
runner worker keeps one small object per kind of states, rewritten at most every PROGRESS_EVERY_S and only when it
captured, skipped or failed a sample since: the object's LastModified is then when the worker last made progress.
It is a heartbeat for the display and the stall check, never a record: what is captured is what the markers say.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime

import orjson

from .bounded_get import get_bounded
from .storage import TMP_MARK, Storage, StorageError

logger = logging.getLogger(__name__)

PROGRESS_DIR = "capture_progress"
PROGRESS_EVERY_S = 30.0
# A progress object is a few counters; a reader takes at most this many bytes of one, and this many workers' objects.
MAX_PROGRESS_BYTES = 4096
MAX_WORKERS_READ = 1024


def progress_prefix(kind: str) -> str:
    return f"{PROGRESS_DIR}/{kind}/"


@dataclass
class CaptureCounts:
    """One worker's pass so far (a reader's sum of them: every worker's)."""

    captured: int = 0
    skipped: int = 0  # already committed before this pass reached them
    failed: int = 0  # given up by this pass (what no retry fixed), recorded
    state_bytes: int = 0
    failed_before: int = 0  # recorded as failed by an earlier pass and left to --retry-failed: never "committed"

    def __add__(self, other: CaptureCounts) -> CaptureCounts:
        return CaptureCounts(self.captured + other.captured, self.skipped + other.skipped,
                             self.failed + other.failed, self.state_bytes + other.state_bytes,
                             self.failed_before + other.failed_before)


class ProgressBeat:
    """A worker's progress object. `due` (on the event loop) hands out the document to write, once per period so
    that concurrent answers do not write it twice, and only when the counts moved; `write` puts it (in a thread)."""

    def __init__(self, storage: Storage, kind: str, worker: int, every_s: float = PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.storage, self.key = storage, f"{progress_prefix(kind)}worker-{worker:05d}.json"
        self.finished = CaptureCounts()  # the datasets this worker has passed
        self._every_s, self._clock = every_s, clock
        self._started = self._next = clock()  # the first counts are written at once: the operator sees the pass
        self._written: CaptureCounts | None = None

    def due(self, current: CaptureCounts, final: bool = False) -> bytes | None:
        """The document for the finished datasets plus `current` (the one in progress), or None: nothing new, or
        written less than a period ago (`final` writes anything new)."""
        counts = self.finished + current
        if counts == self._written or (not final and self._clock() < self._next):
            return None
        self._written = counts
        now = self._clock()
        self._next = now + self._every_s
        # The pass's own clock, not a wall time: the operator divides by it for the rate (an ETA), never compares it.
        return orjson.dumps({**asdict(counts), "elapsed_s": round(now - self._started, 1)})

    def finish(self, part: CaptureCounts) -> None:
        self.finished = self.finished + part

    def write(self, document: bytes | None) -> None:
        if document is None:
            return
        try:
            self.storage.put(self.key, document)
        except StorageError as error:  # a missed heartbeat costs a display; the capture goes on
            logger.warning("could not write the capture progress %s: %s", self.storage.uri(self.key), error)


@dataclass(frozen=True)
class CaptureProgress:
    """Every worker's progress in one kind's pass, as the operator reads it."""

    counts: CaptureCounts
    workers: int
    last_progress: datetime | None  # the newest object's LastModified: the last time any worker moved
    samples_per_second: float = 0.0  # the workers' captures over their own time in the pass, summed

    def eta_seconds(self, committed: int) -> float | None:
        """Seconds until every committed sample has its states at the workers' rate so far (None before a rate)."""
        counts = self.counts
        left = committed - counts.captured - counts.skipped - counts.failed - counts.failed_before
        return max(0.0, left) / self.samples_per_second if self.samples_per_second > 0 else None


def read_capture_progress(storage: Storage, kind: str, since: datetime | None = None) -> CaptureProgress | None:
    """The workers' progress objects of `kind` written at or after `since` (the runner Job's start: an earlier
    pass's are not this one's), summed; None when there are none. Each is read bounded, and one that does not parse
    is skipped: a tenant's runner writes them, and they are only a display."""
    total, workers, newest, rate = CaptureCounts(), 0, None, 0.0
    for key in storage.list(progress_prefix(kind)):
        if workers >= MAX_WORKERS_READ:
            break
        if TMP_MARK in key:  # a local put killed before its rename: not an object
            continue
        try:
            document = orjson.loads(get_bounded(storage, key, MAX_PROGRESS_BYTES))
            # A field an older runner did not write counts 0.
            counts = CaptureCounts(**{name: int(document.get(name, 0)) for name in asdict(CaptureCounts())})
            elapsed = float(document.get("elapsed_s") or 0.0)
            modified = storage.modified(key)
            if since is not None and (modified is None or modified < since):
                continue
        except (StorageError, orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as error:
            logger.warning("skipping the capture progress %s: %s", storage.uri(key), error)
            continue
        total, workers = total + counts, workers + 1
        if elapsed > 0:
            rate += counts.captured / elapsed
        if modified is not None and (newest is None or modified > newest):
            newest = modified
    return CaptureProgress(total, workers, newest, rate) if workers else None
