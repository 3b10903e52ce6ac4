"""A dataset's index kept current from storage: the newest checkpoint that verifies, then only the markers it lacks.

The storage edge of `commit_index.py` and `checkpoints.py`. `catch_up` lists the dataset's markers (all of them,
or only those named after the index's horizon) and reads only the ones whose shard the index has not folded, so a
reader's cost follows what was committed since it last looked, not the dataset's history.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice

from .bounded_get import CHECKPOINT_BYTES, get_bounded
from .checkpoints import (
    INDEX,
    OPERATOR_WRITER,
    RAW_BYTES,
    RUNNER,
    SUFFIX,
    CheckpointError,
    Signer,
    Snapshot,
    decode,
    snapshot,
    writer_of,
)
from .commit_index import DatasetIndex
from .ledger import DatasetLedger, LedgerBudget
from .marker_names import MAX_CLOCK_SKEW, horizon, time_key
from .markers import READ_THREADS, commits_prefix, decode_marker, iter_keyed, list_commits
from .ownership import Fence
from .storage import Storage, StorageError

logger = logging.getLogger(__name__)

CHECKPOINT_EVERY = 1000  # markers folded since the last checkpoint before a reader writes a new one
KEEP_CHECKPOINTS = 3  # a writer removes its dataset's checkpoints older than the newest few
TRIES = 3  # checkpoints a reader tries, newest first, before it folds every marker


def load_index(storage: Storage, dataset: str, rows: int = 0, samples_per_prompt: int = 1, signer: Signer = RUNNER,
               budget: LedgerBudget | None = None) -> DatasetIndex:
    """The newest checkpoint of the dataset that `signer` trusts and that verifies, or an empty index (nothing
    folded yet). Each is read within CHECKPOINT_BYTES and inflated within what a layout of `rows` lines can hold."""
    names = sorted((key for key in storage.list(f"{dataset}/{INDEX}/") if key.endswith(SUFFIX) and signer.trusts(key)),
                   reverse=True)
    for key in names[:TRIES]:
        try:
            index = decode(get_bounded(storage, key, CHECKPOINT_BYTES), dataset, samples_per_prompt,
                           slots=rows * samples_per_prompt, key=signer.key, budget=budget)
        except (CheckpointError, StorageError) as error:
            logger.warning("%s: checkpoint %s not used: %s", dataset, storage.uri(key), error)
            continue
        index.ledger.reserve(rows * samples_per_prompt)
        logger.info("%s: starting from checkpoint %s (%d markers folded)", dataset, key, index.markers)
        return index
    return DatasetIndex(DatasetLedger(dataset, rows, samples_per_prompt, budget))


@dataclass
class CatchUp:
    folded: int = 0  # markers read and folded
    listed: int = 0  # marker names listed
    strays: list[str] = field(default_factory=list)  # other files in the commits folder (temporary files)
    late: int = 0  # markers of a sealed run token that landed after its seal (they count for nobody)
    tainted: bool = False  # the index had folded a late marker (a checkpoint taken before the seal was read)
    read: int = 0  # markers read (one GET each)
    more: bool = False  # it stopped at a bound (markers to read, names to list) before the listing's end
    after: str | None = None  # where it stopped: the last name it dealt with (None: none)
    newest: str = ""  # the newest time key it listed ("" none), clamped to the reader's clock plus MAX_CLOCK_SKEW


def catch_up(storage: Storage, index: DatasetIndex, full: bool = False, check: Callable[[], None] | None = None,
             threads: int = READ_THREADS, now: datetime | None = None, limit: int | None = None) -> CatchUp:
    """Fold the markers the index lacks. Incremental (only names after the horizon) unless `full`; `check` is
    called between reads (the operator stops a pass of a deleted resource there by raising). Names further ahead of
    `now` than MAX_CLOCK_SKEW are folded but move the horizon no further than that.

    `limit`: read at most this many markers, in name order, then stop (`more`) without moving the horizon, so the
    next call lists from the same place, skips what this one folded (no GET) and goes on. It bounds an incremental
    listing only: one from the start (`full`, or an index with no horizon yet) would be listed whole again each
    time (a full listing in bounded steps is `sweep`)."""
    prefix = commits_prefix(index.name)
    start = None if full or not index.horizon else prefix + index.horizon
    result = _fold_listed(storage, index, start, check, threads, now, limit if start is not None else None)
    if result.newest and not result.more:
        index.listed(result.newest, horizon(result.newest))
    return result


def sweep(storage: Storage, index: DatasetIndex, after: str | None, names: int,
          check: Callable[[], None] | None = None, threads: int = READ_THREADS, now: datetime | None = None,
          limit: int | None = None) -> CatchUp:
    """One step of a full listing spread over calls: the next `names` marker names after the key `after` (from the
    first for None), the markers among them the index lacks folded (at most `limit` read). `more` and `after` say
    where the next step starts; without `more` the listing reached its end. The horizon is `catch_up`'s to move
    (`settle_horizon` for an index that has none when a full listing's steps reached the end)."""
    return _fold_listed(storage, index, after, check, threads, now, limit, names)


def settle_horizon(index: DatasetIndex, newest: str) -> None:
    """A full listing in steps (`sweep`) reached the end, the newest name it listed `newest`: an index that had no
    horizon yet gets the one a listing from the start gives it, so the next incremental listing does not start from
    the first name again. One that has a horizon keeps it: names listed in an early step may have been followed by
    late PUTs before the horizon's overlap, which only incremental listings look for."""
    if newest and not index.horizon:
        index.listed(newest, horizon(newest))


def _fold_listed(storage: Storage, index: DatasetIndex, start: str | None, check: Callable[[], None] | None,
                 threads: int, now: datetime | None, limit: int | None,
                 names: int | None = None) -> CatchUp:
    """The one fold of listed markers: those the index lacks among the names after the key `start`, reading at most
    `limit` and listing at most `names` (None: no bound)."""
    prefix = commits_prefix(index.name)
    result = CatchUp()
    latest = time_key((now or datetime.now(UTC)) + MAX_CLOCK_SKEW)
    left = -1 if limit is None else limit

    def unknown() -> Iterator[tuple[str, int]]:
        nonlocal left
        listing = list_commits(storage, index.name, start)
        seen = 0
        # Never a name past `names`: the one after a full S3 page would be the first of another LIST.
        for entry in listing if names is None else islice(listing, names):
            unread = entry.is_marker and not index.knows(entry.shard_id or "")
            if unread and left == 0:
                result.more = True
                return
            seen += 1
            if entry.late:
                result.late += 1
                result.tainted = result.tainted or index.knows(entry.shard_id or "")
            elif entry.shard_id is None:
                result.strays.append(entry.key)
            else:
                result.listed += 1
                if entry.time is not None and entry.time > latest:
                    logger.warning("%s is named %s, beyond this reader's clock plus %s: its writer's clock runs "
                                   "ahead", storage.uri(entry.key), entry.time, MAX_CLOCK_SKEW)
                if entry.time is not None and min(entry.time, latest) > result.newest:
                    result.newest = min(entry.time, latest)
            result.after = entry.key
            if unread:
                left -= 1
                result.read += 1
                yield entry.key, entry.size
        result.more = seen == names  # as many as it may list: the listing may go on (the next step finds out)

    for key, data in iter_keyed(storage, unknown(), threads):
        if check is not None:
            check()
        if index.fold(key[len(prefix):], decode_marker(data, storage.uri(key))) is not None:
            result.folded += 1
    return result


def refresh(storage: Storage, index: DatasetIndex, full: bool = False, check: Callable[[], None] | None = None,
            now: datetime | None = None, rows: int = 0, limit: int | None = None) -> tuple[DatasetIndex, CatchUp]:
    """`catch_up`, and when the index had folded a marker its seal drops (a checkpoint or an earlier pass folded it
    between a takeover's listing and its seal's write: it counts a marker nobody else does), a new index folded from
    every marker instead. Every reader that keeps an index (the runner, the operator) refreshes it here, so none
    counts a sealed-away marker."""
    caught = catch_up(storage, index, full=full, check=check, now=now, limit=limit)
    return refold(storage, index, check, now, rows) if caught.tainted else (index, caught)


def refold(storage: Storage, index: DatasetIndex, check: Callable[[], None] | None = None,
           now: datetime | None = None, rows: int = 0) -> tuple[DatasetIndex, CatchUp]:
    """A new index of the dataset folded from every marker, for one that counts a sealed-away marker (a listing
    said `tainted`)."""
    logger.warning("%s: the index counts a marker that landed after its run token was sealed; folding every marker "
                   "again", index.name)
    ledger = index.ledger
    index = DatasetIndex(DatasetLedger(index.name, rows, ledger.samples_per_prompt, ledger.budget))
    return index, catch_up(storage, index, full=True, check=check, now=now)


def open_index(storage: Storage, dataset: str, rows: int = 0, samples_per_prompt: int = 1,
               budget: LedgerBudget | None = None) -> tuple[DatasetIndex, CatchUp]:
    """The dataset's index from its newest checkpoint plus every marker that checkpoint lacks (a full listing: a
    runner must not miss a committed slot, however late its marker's PUT finished)."""
    index, caught = refresh(storage, load_index(storage, dataset, rows, samples_per_prompt, budget=budget), full=True,
                            rows=rows)
    if caught.late:
        logger.warning("%s: %d commit markers of a taken-over run landed after it was sealed; they count for nobody "
                       "and their slots are generated again", dataset, caught.late)
    return index, caught


def take_checkpoint(index: DatasetIndex, writer: str, now: datetime | None = None) -> Snapshot:
    """The index as it is now, to be written by `put_checkpoint` (possibly from another thread)."""
    taken = snapshot(index, writer, now or datetime.now(UTC))
    index.since_checkpoint = 0
    return taken


def put_checkpoint(storage: Storage, dataset: str, taken: Snapshot, key: bytes = b"",
                   fence: Fence | None = None) -> str | None:
    """Write a snapshot as a new checkpoint (its digest keyed with `key`; under the writer's fence, when it has one:
    store/ownership.py), then remove this dataset's checkpoints
    older than the newest few. None when it inflates past what any reader takes (checkpoints.RAW_BYTES): readers
    then fold the markers, as without one."""
    if taken.raw_bytes > RAW_BYTES:
        logger.warning("%s: no checkpoint written: it would inflate to %d bytes, past the %d a reader takes (failures "
                       "spread over this many slots); readers fold the markers instead", dataset, taken.raw_bytes,
                       RAW_BYTES)
        return None
    name = f"{dataset}/{INDEX}/{taken.name}"
    with fence.proof() if fence is not None else nullcontext():
        storage.put(name, taken.encode(key))
    logger.info("%s: wrote checkpoint %s (%d markers)", dataset, storage.uri(name), taken.header["markers"])
    _prune(storage, dataset, name)
    return name


def write_checkpoint(storage: Storage, index: DatasetIndex, writer: str, now: datetime | None = None,
                     key: bytes = b"") -> str | None:
    """Write the index as a new checkpoint (from the thread that folds it). Returns its key (None: not written)."""
    return put_checkpoint(storage, index.name, take_checkpoint(index, writer, now), key)


def _prune(storage: Storage, dataset: str, written: str) -> None:
    # Among the checkpoints of the writer's own kind (the operator's, or the runners'): neither trusts the other's,
    # so neither's writes may push out the other's newest.
    operator = writer_of(written) == OPERATOR_WRITER
    names = sorted(key for key in storage.list(f"{dataset}/{INDEX}/")
                   if key.endswith(SUFFIX) and (writer_of(key) == OPERATOR_WRITER) == operator)
    for key in (key for key in names[:-KEEP_CHECKPOINTS] if key < written):
        try:
            storage.delete(key)
        except StorageError as error:  # a checkpoint left behind costs storage, never correctness
            logger.warning("could not remove old checkpoint %s: %s", storage.uri(key), error)
