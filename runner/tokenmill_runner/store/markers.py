"""The markers of a dataset, in commit order, from a checkpoint on: the one listing of a dataset's records folders
(its commits, its samples' state markers and failure records) and the reads of the markers in it. The runner
(catch-up, leftovers, the capture pass), the report, export, inspect and the operator (through `index_store`) all list
and read records here, so they agree on what a record is, which ones count and in which order they came.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

from .bounded_get import MARKER_BYTES, get_bounded
from .ledger import COMMITS
from .marker_names import is_marker_name, split_marker_name
from .seals import read_seals
from .storage import Storage

READ_THREADS = 16


def commits_prefix(dataset: str) -> str:
    return f"{dataset}/{COMMITS}/"


@dataclass(frozen=True)
class Listed:
    """One entry of a records folder: a record (its time key, None for a name without one, and its name's stem: a
    shard id, or a sample key with the writer's token), a late record (one of a sealed run token that its seal does
    not name: it counts for nobody, `seals.py`), or a stray (a temporary file of an interrupted write, or anything
    else that is not a record)."""

    key: str
    time: str | None = None
    stem: str | None = None
    late: bool = False

    @property
    def shard_id(self) -> str | None:
        return self.stem

    @property
    def is_marker(self) -> bool:
        return self.stem is not None and not self.late


def list_records(storage: Storage, dataset: str, folder: str, start: str | None = None) -> Iterator[Listed]:
    """The one listing of a dataset's records folder (commit markers, state markers, failure records; after
    `start`, a key, when given), each entry classified by the seals. Every reader of records goes through it, so
    they agree on what a record is and which ones count (store/ownership.py)."""
    prefix = f"{dataset}/{folder}/"
    seals = read_seals(storage, dataset)
    for key in storage.list(prefix, start):
        name = key[len(prefix):]
        if "/" in name or not is_marker_name(name):
            yield Listed(key)
        else:
            time, stem = split_marker_name(name)
            yield Listed(key, time, stem, late=not seals.counts(folder, stem))


def list_commits(storage: Storage, dataset: str, start: str | None = None) -> Iterator[Listed]:
    """The one listing of a dataset's commits folder (catch-up, commit order, leftovers)."""
    return list_records(storage, dataset, COMMITS, start)


def iter_keyed(storage: Storage, keys: Iterable[str], threads: int = READ_THREADS) -> Iterator[tuple[str, bytes]]:
    """(key, object) for each key, read `threads` at a time and yielded in key order, holding a bounded window."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        window: deque[tuple[str, Future[bytes]]] = deque()
        for key in keys:
            window.append((key, pool.submit(get_bounded, storage, key, MARKER_BYTES)))
            if len(window) >= 2 * threads:
                first, future = window.popleft()
                yield first, future.result()
        while window:
            key, future = window.popleft()
            yield key, future.result()


def marker_keys(storage: Storage, dataset: str) -> list[str]:
    return [entry.key for entry in list_commits(storage, dataset) if entry.is_marker]


def iter_markers(storage: Storage, keys: Iterable[str], threads: int = READ_THREADS) -> Iterator[dict[str, Any]]:
    """The markers at `keys`, read `threads` at a time and yielded in key order, holding at most a window of them
    in memory (folding a dataset's ledger never needs them all at once)."""
    for _, data in iter_keyed(storage, keys, threads):
        yield orjson.loads(data)


def datasets_with_commits(storage: Storage) -> list[str]:
    """Top-level folders of the output that hold commit markers (one listing of the folders, not of every shard)."""
    return [name for name in storage.folders("") if any(entry.is_marker for entry in list_commits(storage, name))]


def markers_in_commit_order(storage: Storage, dataset: str, threads: int = READ_THREADS) -> Iterator[dict[str, Any]]:
    """A dataset's markers oldest first, streamed (a window of them in memory). Time-named markers are in commit
    order by name; old-style names (written before the time prefix, always before any time-named one) are read
    once first to order them by their committed_at, then again as they are yielded."""
    def named(timed: bool) -> Iterator[str]:
        for entry in list_commits(storage, dataset):
            if entry.is_marker and (entry.time is not None) == timed:
                yield entry.key

    old = list(named(False))
    legacy = sorted((marker["committed_at"], marker["shard_id"], key)
                    for key, marker in zip(old, iter_markers(storage, old, threads), strict=True))
    yield from iter_markers(storage, [key for _, _, key in legacy], threads)
    yield from iter_markers(storage, named(True), threads)


def read_markers(storage: Storage, dataset: str, threads: int = READ_THREADS) -> list[dict[str, Any]]:
    """Every commit marker of a dataset, oldest first (all in memory: for the report and tests)."""
    markers = list(iter_markers(storage, marker_keys(storage, dataset), threads))
    markers.sort(key=lambda marker: (marker["committed_at"], marker["shard_id"]))
    return markers
