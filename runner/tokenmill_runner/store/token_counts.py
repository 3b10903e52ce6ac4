"""Each committed shard's loss-token counts, written with the shard, read through its commit marker.

    <dataset>/token_counts/<shard_id>.bin     the shard's counts (packed.py, kind "token-counts"): distinct ids,
                                              their counts and the unit each first appears in

`shards.commit_shard` writes the file after the shard's data and errors and before its marker, which names it
(`token_counts`): like the data file it carries the shard id, so the writer's run token, and a file without a marker
is a leftover its worker removes (`shards.leftovers`). It counts only through a marker that counts: readers walk the
markers the one listing yields (`markers.list_commits`, which drops a sealed token's late markers), fold each into
a ledger, and take a shard's file only when every row of it is a slot's first row. A shard whose rows count only in
part (a slot committed twice), whose marker predates the file, or whose file is gone is recounted from its rows, so
the totals are exact under resume, kills and takeovers: they equal a count over the rows an export writes.

The rule counted (stats/token_freq.py): the ids the target generated, per generation (each turn of a conversation,
the stop token included): the loss mask's 1s in every token export (export/units.py).
"""

from __future__ import annotations

import io
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..stats.token_freq import ShardCounts, TokenFrequencies, count_units
from .bounded_get import CHECKPOINT_BYTES, get_bounded
from .ledger import DatasetLedger
from .markers import READ_THREADS, markers_in_commit_order
from .packed import PackError, pack, unpack
from .storage import Storage, StorageError

logger = logging.getLogger(__name__)

COUNTS = "token_counts"
KIND = "token-counts"
RULE = "generated-ids-per-turn/1"  # what is counted; a reader refuses a file counted by another rule
MARKER_FIELD = "token_counts"
COUNTED_COLUMNS = ["output_ids", "turns"]
# A counts file holds 20 bytes per distinct id before compression: a 256k vocabulary is 5 MB. Anyone who can write
# the output can write one, so nothing larger than this is read.
COUNTS_BYTES = CHECKPOINT_BYTES


def counts_name(shard_id: str) -> str:
    """The file's name relative to its dataset, as the marker names it."""
    return f"{COUNTS}/{shard_id}.bin"


def _list_values(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets from 0) of an Arrow list column."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = np.asarray(array.offsets, dtype=np.int64)
    values = np.asarray(array.values, dtype=np.int64)[offsets[0]:offsets[-1]] if len(array) else np.empty(0, np.int64)
    return values, offsets - offsets[0]


def count_table(table: pa.Table) -> ShardCounts:
    """The loss-token counts of a shard's rows: each single-turn row's output ids, each turn's of a conversation (its
    turns' `output_ids`, never their prompt ids, are read)."""
    outputs, output_offsets = _list_values(table.column("output_ids"))
    turns = table.column("turns") if "turns" in table.column_names else None
    if turns is None or turns.null_count == len(table):
        return count_units(outputs, output_offsets)
    conversations = turns.combine_chunks()
    is_conversation = np.asarray(conversations.is_valid())
    turn_offsets = np.asarray(conversations.offsets, dtype=np.int64)
    turn_outputs, turn_output_offsets = _list_values(pc.struct_field(conversations.values, "output_ids"))
    pieces: list[np.ndarray] = []  # one per unit, in order: a row's output, or each of its turns' outputs
    for index in range(len(table)):
        if is_conversation[index]:
            for turn in range(turn_offsets[index], turn_offsets[index + 1]):
                pieces.append(turn_outputs[turn_output_offsets[turn]:turn_output_offsets[turn + 1]])
        else:
            pieces.append(outputs[output_offsets[index]:output_offsets[index + 1]])
    offsets = np.concatenate([[0], np.cumsum([piece.size for piece in pieces])]).astype(np.int64)
    return count_units(np.concatenate(pieces) if pieces else np.empty(0, np.int64), offsets)


def encode_counts(dataset: str, shard_id: str, rows: int, counts: ShardCounts) -> bytes:
    header = {"dataset": dataset, "shard_id": shard_id, "rows": rows, "tokens": counts.tokens, "rule": RULE}
    return pack(KIND, header, {"ids": counts.ids.astype("<i4"), "counts": counts.counts.astype("<i8"),
                               "first_unit": counts.first_unit.astype("<i4")})


def decode_counts(data: bytes, where: str) -> ShardCounts:
    try:
        header, arrays = unpack(KIND, data, max_raw=COUNTS_BYTES)
    except PackError as error:
        raise StorageError(f"{where}: {error}") from None
    if header.get("rule") != RULE:
        raise StorageError(f"{where} counts by rule {header.get('rule')!r}, not {RULE!r}")
    ids, counts, first = (arrays.get(name) for name in ("ids", "counts", "first_unit"))
    if ids is None or counts is None or first is None or not ids.size == counts.size == first.size:
        raise StorageError(f"{where}: the arrays ids, counts and first_unit are missing or of unequal lengths")
    return ShardCounts(ids.astype(np.int64), counts.astype(np.int64), first.astype(np.int64))


@dataclass(frozen=True)
class CountedShard:
    """Where one committed shard's counts come from: its counts file when every row of it counts, else its rows."""

    dataset: str
    shard_id: str
    counts: str | None  # the counts file the marker names (None: a marker written before them)
    data: str | None  # the shard's data file, to recount from
    rows: np.ndarray | None  # positions of the rows that count (None: every row)

    @property
    def from_file(self) -> bool:
        return self.counts is not None and self.rows is None


def counted_shard(dataset: str, marker: dict[str, Any], taken: np.ndarray,
                  left_out: Callable[[int, int], bool] | None = None) -> CountedShard | None:
    """What counts of a marker folded into a ledger: `taken` is what the fold returned (the positions of the rows
    that were their slot's first); `left_out(line, sample_index)` drops more (an export filter). None: nothing."""
    rows = len(marker["samples"].get("line") or [])
    if left_out is not None and taken.size:
        lines = marker["samples"]["line"]
        indices = marker["samples"].get("sample_index") or [0] * rows
        taken = np.asarray([i for i in taken.tolist() if not left_out(int(lines[i]), int(indices[i] or 0))],
                           dtype=np.int64)
    if not taken.size or not marker.get("data"):
        return None
    return CountedShard(dataset, str(marker.get("shard_id")), marker.get(MARKER_FIELD), marker["data"],
                        None if taken.size == rows else taken)


def recount(storage: Storage, shard: CountedShard) -> ShardCounts:
    """Count a shard's rows (those in `shard.rows`) from its data file."""
    table = pq.read_table(io.BytesIO(storage.get(f"{shard.dataset}/{shard.data}")), columns=COUNTED_COLUMNS)
    if shard.rows is not None:
        table = table.take(pa.array(shard.rows))
    return count_table(table)


def read_shard_counts(storage: Storage, shard: CountedShard, recount_rows: bool = True) -> ShardCounts | None:
    """A shard's counts: its counts file, or its rows recounted (None: they would have to be, and `recount_rows` is
    off: the operator reads no tenant's shard, docs/security.md)."""
    if shard.from_file:
        key = f"{shard.dataset}/{shard.counts}"
        try:
            return decode_counts(get_bounded(storage, key, COUNTS_BYTES), storage.uri(key))
        except StorageError as error:
            # A file gone or unreadable costs a read of the shard, never a wrong count.
            logger.warning("%s; recounting shard %s from its rows", error, shard.shard_id)
    if not recount_rows:
        return None
    try:
        return recount(storage, shard)
    except StorageError as error:
        # The marker names a shard that is gone: the report's `dangling` finding names it, and no reader can
        # count or export its rows.
        logger.warning("shard %s is not counted: %s", shard.shard_id, error)
        return ShardCounts.empty()


def iter_shard_counts(storage: Storage, shards: Iterable[CountedShard], threads: int = READ_THREADS,
                      recount_rows: bool = True) -> Iterator[ShardCounts | None]:
    """Each shard's counts (`read_shard_counts`), in the order given, read `threads` at a time (a bounded window)."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        window: deque[Future[ShardCounts | None]] = deque()
        for shard in shards:
            window.append(pool.submit(read_shard_counts, storage, shard, recount_rows))
            if len(window) >= 2 * threads:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


def accumulate(storage: Storage, shards: Iterable[CountedShard], threads: int = READ_THREADS,
               recount_rows: bool = True) -> tuple[TokenFrequencies, int]:
    """The shards' counts merged in order, and how many shards were left uncounted (`recount_rows` off)."""
    frequencies, uncounted = TokenFrequencies(), 0
    for counts in iter_shard_counts(storage, shards, threads, recount_rows):
        if counts is None:
            uncounted += 1
        else:
            frequencies.add(counts)
    return frequencies, uncounted


def counted_shards(storage: Storage, dataset: str,
                   left_out: Callable[[int, int], bool] | None = None) -> Iterator[CountedShard]:
    """The shards of a dataset that count, in commit order, each slot once (its first row), as the export reads
    them."""
    ledger = DatasetLedger(dataset)
    for marker in markers_in_commit_order(storage, dataset):
        shard = counted_shard(dataset, marker, ledger.fold(marker), left_out)
        if shard is not None:
            yield shard


def dataset_frequencies(storage: Storage, dataset: str,
                        left_out: Callable[[int, int], bool] | None = None) -> TokenFrequencies:
    """A dataset's loss-token frequencies over its committed slots (`left_out` slots excepted)."""
    return accumulate(storage, counted_shards(storage, dataset, left_out))[0]
