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
from .bounds import DATASET_NAME, check_values
from .ledger import COMMITS, MarkerError
from .marker_names import is_marker_name, split_marker_name
from .seals import read_seals
from .storage import Storage

READ_THREADS = 16
# Marker bytes read ahead at once (by their listed sizes): 2 x 16 threads of 16 MiB markers held 582 MB before
# anything was folded (security-f9665d2.md W3).
WINDOW_BYTES = 64 * 1024 * 1024
# A marker lists at most a shard's samples (runner.shardMaxSamples <= 16384) x ~20 columns, and its failures: this many
# JSON values is ~4 markers' worth; 16 MiB of `{},` would be 5.6 million dicts.
MARKER_VALUES = 1 << 20


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
    size: int = 0  # bytes, as listed

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
    for key, size in storage.list_sizes(prefix, start):
        name = key[len(prefix):]
        if "/" in name or not is_marker_name(name):
            yield Listed(key, size=size)
        else:
            time, stem = split_marker_name(name)
            yield Listed(key, time, stem, late=not seals.counts(folder, stem), size=size)


def list_commits(storage: Storage, dataset: str, start: str | None = None) -> Iterator[Listed]:
    """The one listing of a dataset's commits folder (catch-up, commit order, leftovers)."""
    return list_records(storage, dataset, COMMITS, start)


def iter_keyed(storage: Storage, entries: Iterable[tuple[str, int]],
               threads: int = READ_THREADS) -> Iterator[tuple[str, bytes]]:
    """(key, object) for each (key, listed size), read `threads` at a time and yielded in key order, holding a window
    of at most WINDOW_BYTES (by the listed sizes; each object is capped at MARKER_BYTES however large it is)."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        window: deque[tuple[str, int, Future[bytes]]] = deque()
        held = 0
        for key, size in entries:
            size = min(max(size, 0), MARKER_BYTES)
            while window and (len(window) >= 2 * threads or held + size > WINDOW_BYTES):
                first, taken, future = window.popleft()
                held -= taken
                yield first, future.result()
            window.append((key, size, pool.submit(get_bounded, storage, key, MARKER_BYTES)))
            held += size
        while window:
            key, _, future = window.popleft()
            yield key, future.result()


def decode_marker(data: bytes, key: str) -> dict[str, Any]:
    """A commit marker's bytes parsed, its count of values bounded first (bounds.py): the one parse of a marker every
    reader (catch-up, the report, export, inspect, the operator) goes through."""
    check_values(data, MARKER_VALUES, key)
    try:
        marker = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise MarkerError(f"{key} is not a commit marker ({error}); tokenmill writes markers whole: remove it, and "
                          "its shard's slots are generated again") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("samples"), dict) \
            or not isinstance(marker.get("failed"), dict):
        raise MarkerError(f"{key} is not a commit marker (no 'samples'/'failed' tables): remove it")
    return marker


def marker_entries(storage: Storage, dataset: str) -> list[tuple[str, int]]:
    """(key, listed size) of every marker of the dataset that counts."""
    return [(entry.key, entry.size) for entry in list_commits(storage, dataset) if entry.is_marker]


def marker_keys(storage: Storage, dataset: str) -> list[str]:
    return [key for key, _ in marker_entries(storage, dataset)]


def iter_markers(storage: Storage, entries: Iterable[tuple[str, int]],
                 threads: int = READ_THREADS) -> Iterator[dict[str, Any]]:
    """The markers at `entries` ((key, listed size)), read `threads` at a time and yielded in key order, holding at
    most a window of them in memory (folding a dataset's ledger never needs them all at once)."""
    for key, data in iter_keyed(storage, entries, threads):
        yield decode_marker(data, storage.uri(key))


def datasets_with_commits(storage: Storage) -> list[str]:
    """Top-level folders of the output that hold commit markers (one listing of the folders, not of every shard).
    A folder whose name is not a dataset name (DATASET_NAME) is none: its name would become a report's file name."""
    return [name for name in storage.folders("") if DATASET_NAME.fullmatch(name)
            and any(entry.is_marker for entry in list_commits(storage, name))]


def markers_in_commit_order(storage: Storage, dataset: str, threads: int = READ_THREADS) -> Iterator[dict[str, Any]]:
    """A dataset's markers oldest first, streamed (a window of them in memory). Time-named markers are in commit
    order by name; old-style names (written before the time prefix, always before any time-named one) are read
    once first to order them by their committed_at, then again as they are yielded."""
    def named(timed: bool) -> Iterator[tuple[str, int]]:
        for entry in list_commits(storage, dataset):
            if entry.is_marker and (entry.time is not None) == timed:
                yield entry.key, entry.size

    old = list(named(False))
    legacy = sorted((str(marker.get("committed_at")), str(marker.get("shard_id")), entry)
                    for entry, marker in zip(old, iter_markers(storage, old, threads), strict=True))
    yield from iter_markers(storage, [entry for _, _, entry in legacy], threads)
    yield from iter_markers(storage, named(True), threads)


def read_markers(storage: Storage, dataset: str, threads: int = READ_THREADS) -> list[dict[str, Any]]:
    """Every commit marker of a dataset, oldest first (all in memory: for tests)."""
    markers = list(iter_markers(storage, marker_entries(storage, dataset), threads))
    markers.sort(key=lambda marker: (marker["committed_at"], marker["shard_id"]))
    return markers
