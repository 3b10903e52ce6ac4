"""What a reader of a dataset's commit markers knows, in memory that follows the slots, not the markers. Pure.

A `DatasetIndex` is the dataset's ledger (a bit per slot, `ledger.py`) plus what lets a reader fold only what is
new: which shards it has folded (a 64-bit hash of each shard id in a sorted array: 8 bytes per marker, 0.03 bytes
per slot at 256 samples a marker), the listing horizon (every marker named at or before it was visible to a listing
and is folded, `marker_names.py`), the newest commit time, and a ring of the last `RECENT_WINDOW` of commits for
rates. It is what the operator keeps per dataset between passes and what a checkpoint (`checkpoints.py`) stores.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import numpy as np

from .ledger import DatasetLedger
from .marker_names import split_marker_name

RECENT_WINDOW = timedelta(minutes=10)  # rates are committed samples and tokens over this window
_MERGE_AT = 1024  # shard hashes wait in a set until this many, then join the sorted array


def shard_hash(shard_id: str) -> int:
    """A stable 64-bit key of a shard id. Two of n shard ids collide with probability about n² / 2⁶⁵ (4·10⁻¹¹ at 40,000
    markers); a collision would make a reader skip one marker, which the report's full pass still reads."""
    return int.from_bytes(hashlib.blake2b(shard_id.encode(), digest_size=8).digest(), "little")


class Commit(NamedTuple):
    at: datetime  # the marker's committed_at
    outcomes: int  # rows and failures it records
    tokens: int  # completion tokens of its rows


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass(frozen=True)
class Rates:
    samples_per_s: float
    tokens_per_s: float


class DatasetIndex:
    def __init__(self, ledger: DatasetLedger) -> None:
        self.ledger = ledger
        self._known = np.empty(0, dtype=np.uint64)  # sorted hashes of the folded shards
        self._pending: set[int] = set()
        self.horizon = ""  # time key: every marker named at or before it is folded ("" = none yet)
        self.newest = ""  # time key of the newest time-named marker folded or listed
        self.last_commit: datetime | None = None
        self.recent: deque[Commit] = deque()
        self.markers = 0  # distinct markers folded
        self.since_checkpoint = 0  # markers folded since the checkpoint this index came from or last wrote

    @classmethod
    def restore(cls, ledger: DatasetLedger, known: np.ndarray, horizon: str, newest: str,
                last_commit: datetime | None, recent: list[Commit]) -> DatasetIndex:
        """The index a checkpoint recorded (`known`: the sorted hashes of its folded shards)."""
        index = cls(ledger)
        index._known = known
        index.horizon, index.newest, index.last_commit = horizon, newest, last_commit
        index.recent = deque(recent)
        index.markers = int(known.size)
        return index

    @property
    def name(self) -> str:
        return self.ledger.name

    # -- which markers are folded -----------------------------------------------------------------------------
    def knows(self, shard_id: str) -> bool:
        key = shard_hash(shard_id)
        if key in self._pending:
            return True
        at = int(np.searchsorted(self._known, np.uint64(key)))
        return at < self._known.size and int(self._known[at]) == key

    def _remember(self, shard_id: str) -> None:
        self._pending.add(shard_hash(shard_id))
        if len(self._pending) >= _MERGE_AT:
            self._merge()

    def _merge(self) -> None:
        if self._pending:
            self._known = np.union1d(self._known, np.fromiter(self._pending, dtype=np.uint64, count=len(self._pending)))
            self._pending.clear()

    def known_hashes(self) -> np.ndarray:
        self._merge()
        return self._known

    def listed(self, newest_listed: str, horizon: str) -> None:
        """A listing that saw every marker named after the old horizon, the newest named `newest_listed`, was
        folded: markers named up to `horizon` (newest_listed minus the overlap) cannot still appear."""
        self.newest = max(self.newest, newest_listed)
        self.horizon = max(self.horizon, horizon)

    # -- folding ---------------------------------------------------------------------------------------------
    def fold(self, name: str, marker: dict[str, Any]) -> np.ndarray | None:
        """Fold the marker with file name `name` (or a bare shard id); None when this shard was folded before.
        Otherwise the positions of the marker's rows that counted (see `DatasetLedger.fold`)."""
        time, shard_id = split_marker_name(name)
        if self.knows(shard_id):
            return None
        taken = self.ledger.fold(marker)
        self._remember(shard_id)
        self.markers += 1
        self.since_checkpoint += 1
        if time is not None:
            self.newest = max(self.newest, time)
        self._note_commit(marker)
        return taken

    def _note_commit(self, marker: dict[str, Any]) -> None:
        committed = marker.get("committed_at")
        if not committed:
            return
        at = parse_time(str(committed))
        samples, failed = marker.get("samples") or {}, marker.get("failed") or {}
        outcomes = len(samples.get("line") or []) + len(failed.get("line") or [])
        tokens = int(sum(samples.get("completion_tokens") or []))
        if self.last_commit is None or at > self.last_commit:
            self.last_commit = at
        self.recent.append(Commit(at, outcomes, tokens))
        self._prune()

    def _prune(self) -> None:
        if self.last_commit is None:
            return
        since = self.last_commit - RECENT_WINDOW
        # Markers arrive about in time order: dropping from the head keeps the ring bounded by the commit rate.
        while self.recent and self.recent[0].at < since:
            self.recent.popleft()


def rates(commits: list[Commit], now: datetime, started: datetime | None) -> Rates:
    """Samples and tokens per second committed within RECENT_WINDOW of `now`, or since the start when the run is
    younger than that."""
    since = now - RECENT_WINDOW
    recent = [commit for commit in commits if commit.at >= since]
    span = RECENT_WINDOW.total_seconds()
    if started is not None and started > since:
        span = max((now - started).total_seconds(), 1.0)
    return Rates(sum(c.outcomes for c in recent) / span, sum(c.tokens for c in recent) / span)
