"""Shards and commit markers in storage: encode, commit, list, read, clean up (the ledger's logic is `ledger.py`).

Layout under the output root, per dataset:
    <dataset>/shards/<shard_id>.parquet          rows (zstd Parquet)
    <dataset>/errors/<shard_id>.jsonl            per-sample errors recorded with this commit
    <dataset>/token_counts/<shard_id>.bin        the rows' loss-token counts (`token_counts.py`)
    <dataset>/commits/<time>-<shard_id>.json     the commit marker, written last; named by the time it was written
                                                 (`marker_names.py`) so readers list only what is new
    <dataset>/index/<...>.ckpt                   checkpoints of the folded markers (`checkpoints.py`)

A shard exists for readers only once its marker exists: data first, then errors, then the counts, then the marker
(each write atomic). The marker lists each sample's slot and id with the per-sample lengths and flags the report needs, so
progress and reports never scan the shards. Files without a marker are leftovers of a killed worker; that worker
deletes them on restart, and no cleaner deletes another run's unmarked file while its marker may still come
(`lease_rules.CleanRule`). Before the marker a writer proves it still holds the output's lease (`fence`), and the
marker's write retries only within the lease's margin, each attempt after a new proof (`ownership.put_record`, the
one rule every artifact is written under). `faults.py` can kill the
process at each step of a commit, for the tests.
"""

from __future__ import annotations

import io
import logging
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from .bounded_get import spool_bounded
from .bounds import OverBound
from .faults import FaultPoints
from .faults import points as fault_points
from .lease_rules import CleanRule
from .ledger import COMMITS, ERRORS, SHARDS, DatasetLedger, ShardContent, build_marker
from .marker_names import marker_name, shard_id_of
from .markers import READ_THREADS, iter_markers, list_commits, marker_entries, markers_in_commit_order
from .ownership import Fence, put_record
from .storage import TMP_MARK, Storage, StorageError, packed_names
from .token_counts import COUNTS, MARKER_FIELD, count_table, counts_name, encode_counts

logger = logging.getLogger(__name__)

# What one generation gives, in a row (single-turn) and in each turn of a conversation.
GENERATION_FIELDS = [
    ("prompt_ids", pa.list_(pa.int32())),  # exactly what was sent
    ("output_ids", pa.list_(pa.int32())),
    ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()),
    ("finish_reason", pa.string()),
    ("matched_stop", pa.int64()),
    ("reasoning_end", pa.int32()),
    ("reasoning_end_token_id", pa.int64()),  # which of the tokens that end reasoning did (null: none)
    ("has_tool_call", pa.bool_()),
    # SGLang's own accounting (null in shards written before these columns): prompt tokens it found in its prefix
    # cache (meta_info.cached_tokens; a conversation row's is its turns' total), its count of reasoning tokens
    # (meta_info.reasoning_tokens, null where the release reports none), and whether that count agrees with
    # reasoning_end (null: SGLang counted none).
    ("cached_tokens", pa.int32()),
    ("server_reasoning_tokens", pa.int32()),
    ("reasoning_agrees", pa.bool_()),
]

TURN_TYPE = pa.struct([
    *GENERATION_FIELDS,
    ("latency_s", pa.float64()),
    ("attempts", pa.int16()),
    ("history_exact", pa.bool_()),  # prompt_ids extend the previous turn's prompt + output ids (null: first turn)
    ("tool_calls", pa.string()),  # the calls parsed from this turn's output, JSON [{name, arguments, id}]
    ("seed", pa.int64()),  # the seed this turn was drawn with (seeds.py: the slot's, with `|t<turn>`)
])

ROW_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("dataset", pa.string()),
    ("line", pa.int64()),
    ("sample_index", pa.int32()),  # which sample of the prompt: (line, sample_index) is the slot
    *GENERATION_FIELDS,
    ("max_new_tokens", pa.int32()),
    ("latency_s", pa.float64()),
    ("attempts", pa.int16()),
    ("seed", pa.int64()),  # the sample's seed (seeds.py), sent as sampling_seed when the server accepts it
    # Multi-turn rows (mode all-turns) only; null otherwise. The row's own columns above are its last turn's, but
    # completion_tokens and latency_s are the conversation's totals.
    ("turns", pa.list_(TURN_TYPE)),
    ("turn_count", pa.int32()),
    ("stop_reason", pa.string()),  # conversation.STOP_REASONS
    ("stop_detail", pa.string()),  # what diverged, in words
])


def new_shard_id(worker: int, sequence: int, run_token: str) -> str:
    # The worker prefix lets each worker clean up only its own leftovers; the run token keeps a restarted
    # worker's names distinct from anything its killed predecessor left behind.
    return f"w{worker:03d}-{run_token}-{sequence:06d}"


def new_run_token() -> str:
    # 64 bits: two restarts of one worker drawing the same token would overwrite each other's markers; at 32 bits
    # that was a 1 in 4 billion chance per pair of restarts, at 64 bits it is negligible for any run.
    return secrets.token_hex(8)


@dataclass
class ShardBuffer:
    """Rows and errors waiting for a commit; rolls by count or by age. Pure: the caller supplies the clock."""

    max_samples: int
    max_seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    opened_at: float | None = None

    def _touch(self, now: float) -> None:
        if self.opened_at is None:
            self.opened_at = now

    def add_row(self, row: dict[str, Any], now: float) -> None:
        self._touch(now)
        self.rows.append(row)

    def add_error(self, record: dict[str, Any], now: float) -> None:
        self._touch(now)
        self.errors.append(record)

    def __len__(self) -> int:
        return len(self.rows) + len(self.errors)

    def is_due(self, now: float) -> bool:
        if not len(self):
            return False
        return len(self.rows) >= self.max_samples or now - (self.opened_at or now) >= self.max_seconds

    def take(self) -> ShardContent:
        content = ShardContent(self.rows, self.errors)
        self.rows, self.errors, self.opened_at = [], [], None
        return content


ID_COLUMNS = frozenset({"prompt_ids", "output_ids"})
# Token ids take no dictionary: over a vocabulary of 10^5 ids Parquet's dictionary only costs time (half a shard's
# encoding) and size (~27 % larger files with zstd, measured on 256 rows of 10-1024 ids).
DICTIONARY_COLUMNS = [name for name in ROW_SCHEMA.names if name not in ID_COLUMNS]


def encode_rows(rows: list[dict[str, Any]]) -> bytes:
    return _encode_table(rows_table(rows))


def rows_table(rows: list[dict[str, Any]]) -> pa.Table:
    """The rows as a shard's table, built column by column: the token ids (lists, or the 4-byte arrays the runner
    holds them in) go to Arrow through numpy, without a Python int each."""
    columns = []
    for column in ROW_SCHEMA:
        values = [row.get(column.name) for row in rows]
        if column.name in ID_COLUMNS and all(value is not None for value in values):
            columns.append(_id_lists(values))
        else:
            columns.append(pa.array(values, type=column.type))
    return pa.Table.from_arrays(columns, schema=ROW_SCHEMA)


def _encode_table(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", use_dictionary=DICTIONARY_COLUMNS)
    return sink.getvalue()


def _id_lists(values: list[Any]) -> pa.Array:
    parts = [np.asarray(value, dtype=np.int32) for value in values]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([part.size for part in parts], out=offsets[1:])
    if offsets[-1] >= 1 << 31:  # list<int32> offsets are 32-bit
        raise ValueError(f"{int(offsets[-1])} token ids in one shard, over 2^31: lower spec.runner.shardMaxSamples")
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(flat, type=pa.int32()))


MULTI_TURN_FIELDS = ("turns", "turn_count", "stop_reason", "stop_detail")
# A committed shard is rows of token ids: at most runner.shardMaxSamples (16384) rows, each well under SHARD_ROW_BYTES.
# Whoever writes the output writes its shards too, so `inspect`, `export` and the capture pass read them as a source
# is read (store/parquet_rows.py: only tokenmill's columns, a byte budget, rows sized from the Arrow buffers) and
# never more of a file than SHARD_BYTES: a 5.5 KB shard decoded to 1.43 GB, a sparse 8 GiB one was read whole
# (security-f9665d2.md B9).
SHARD_BYTES = 4 * 1024 * 1024 * 1024
# A row's bytes as parquet_rows counts them (8 per token id): 8 million tokens of prompt and output, past any context.
SHARD_ROW_BYTES = 64 * 1024 * 1024


def shard_rows(spool: IO[bytes], where: str) -> Iterator[dict[str, Any]]:
    """The rows of a shard file, read through the bounded Parquet reader (ROW_SCHEMA's columns only); a single-turn
    row reads back without the (null) multi-turn columns. OverBound for a row over SHARD_ROW_BYTES or a decompression
    bomb, naming the shard and the row."""
    from .parquet_rows import OversizeRow, bounded_rows, open_parquet

    try:
        parquet = open_parquet(spool, ROW_SCHEMA.names)
    except (pa.ArrowException, OSError) as error:
        raise StorageError(f"{where} is not a readable Parquet file ({error}); it was changed after it was "
                           "committed: remove its commit marker and run again to generate its samples") from None
    _check_columns(parquet.file.schema_arrow, where)
    for number, row in enumerate(bounded_rows(parquet, SHARD_ROW_BYTES)):
        if isinstance(row, OversizeRow):
            why = row.reason or f"{row.size} bytes, over the {SHARD_ROW_BYTES} a committed row may have"
            raise OverBound(f"{where}, row {number}: {why}; tokenmill never wrote it: remove the shard's commit marker "
                            "and run again to generate its samples")
        if row.get("turns") is None:
            for name in MULTI_TURN_FIELDS:
                row.pop(name, None)
        yield row


# The columns every shard tokenmill wrote has, and their types (sample_index: in shards since markers version 2): a
# file without them is refused before a row is read.
CORE_COLUMNS = ("sample_id", "line", "sample_index", "prompt_ids", "output_ids")


def _check_columns(schema: pa.Schema, where: str) -> None:
    for name in CORE_COLUMNS:
        index = schema.get_field_index(name)
        found = schema.field(index).type if index >= 0 else None
        if found is None and name == "sample_index":
            continue
        if isinstance(found, pa.DictionaryType):  # text read as a dictionary (parquet_rows.open_parquet)
            found = found.value_type
        if found != ROW_SCHEMA.field(name).type:
            raise StorageError(f"{where} is not a shard tokenmill wrote: its column {name} is "
                               f"{'missing' if found is None else found}, not {ROW_SCHEMA.field(name).type}; remove "
                               "its commit marker and run again to generate its samples")


def fetch_shard(storage: Storage, key: str, folder: str | None = None) -> IO[bytes]:
    """A committed shard copied to a temporary file (at most SHARD_BYTES; closing it removes it), for `shard_rows`."""
    return spool_bounded(storage, key, SHARD_BYTES, folder)


def read_shard(storage: Storage, key: str) -> Iterator[dict[str, Any]]:
    """The rows of the committed shard at `key`, streamed (`fetch_shard`, then `shard_rows`): how every reader of an
    output's shards reads them."""
    with fetch_shard(storage, key) as spool:
        yield from shard_rows(spool, storage.uri(key))


def decode_rows(data: bytes) -> list[dict[str, Any]]:
    """The rows of a shard's bytes (for tests: readers use `read_shard`)."""
    return list(shard_rows(io.BytesIO(data), "shard"))


def encode_errors(errors: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(record) + b"\n" for record in errors)


def commit_shard(storage: Storage, dataset: str, shard_id: str, worker: int, content: ShardContent,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 fence: Fence | None = None) -> dict[str, Any]:
    """Write data, then errors, then the rows' loss-token counts, then the marker. A crash before the marker leaves
    only ignorable leftovers. The marker is named by the time just before its PUT, which is also its committed_at."""
    faults = fault_points()
    data_bytes = 0
    table = rows_table(content.rows) if content.rows else None
    if table is not None:
        data = _encode_table(table)
        data_bytes = len(data)
        _write_step(storage, faults, "data", f"{dataset}/{SHARDS}/{shard_id}.parquet", data)
    if content.errors:
        _write_step(storage, faults, "errors", f"{dataset}/{ERRORS}/{shard_id}.jsonl", encode_errors(content.errors))
    if table is not None:
        counts = encode_counts(dataset, shard_id, table.num_rows, count_table(table))
        _write_step(storage, faults, "counts", f"{dataset}/{counts_name(shard_id)}", counts)
    at = clock()
    marker = build_marker(dataset, shard_id, worker, content, data_bytes, committed_at=at)
    if table is not None:
        marker[MARKER_FIELD] = counts_name(shard_id)
    key = f"{dataset}/{COMMITS}/{marker_name(at, shard_id)}"
    faults.before("marker", key)
    put_record(storage, key, orjson.dumps(marker), fence)
    faults.after("marker", key)
    return marker


def _write_step(storage: Storage, faults: FaultPoints, step: str, key: str, data: bytes) -> None:
    faults.before(step, key)
    storage.put(key, data)
    faults.after(step, key)


def read_ledger(storage: Storage, dataset: str, rows: int = 0, threads: int = READ_THREADS) -> DatasetLedger:
    """A dataset's ledger folded from its commit markers as they are read (none is kept in memory)."""
    return DatasetLedger(dataset, rows).fold_all(iter_markers(storage, marker_entries(storage, dataset), threads))


class FileNames:
    """A set of names packed into one sorted array of fixed-width UTF-8 bytes (~50 bytes a name, against ~150 in a
    set of str): the report and export hold every shard's name while they read the markers."""

    def __init__(self, names: Iterable[str]) -> None:
        # b"" (no name is empty) keeps an empty set's array typed
        self._names = np.unique(np.concatenate([packed_names(names), np.array([b""], dtype=np.bytes_)]))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        encoded = name.encode("utf-8", "surrogatepass")
        if not encoded or len(encoded) > self._names.dtype.itemsize or encoded.endswith(b"\0"):
            return False  # longer than every name (numpy would cut it to the width), or one a NUL would hide
        at = int(np.searchsorted(self._names, encoded))
        return at < self._names.size and bytes(self._names[at]) == encoded

    def __len__(self) -> int:
        return int(self._names.size) - 1


def stored_files(storage: Storage, dataset: str) -> FileNames:
    """The data and error files a dataset has (`shards/<id>.parquet`, `errors/<id>.jsonl`, relative to the
    dataset, as markers name them): one listing, to find markers that name a file that is gone."""
    return FileNames(key[len(dataset) + 1:] for folder in (SHARDS, ERRORS) for key in storage.list(f"{dataset}/{folder}/")
                     if TMP_MARK not in key)


def missing_files(marker: dict[str, Any], stored: FileNames) -> list[str]:
    """The files a commit marker names that are not in `stored`: a dangling marker (another writer deleted its
    data as a leftover, or someone removed it by hand)."""
    return [name for name in (marker.get("data"), marker.get("errors")) if name and name not in stored]


def leftovers(storage: Storage, dataset: str, worker: int | None = None,
              committed: Callable[[str], bool] | None = None, strays: Iterable[str] | None = None) -> Iterator[str]:
    """Data, error and counts files without a commit marker, and temporary files of interrupted writes (of one worker, or
    of all when worker is None). `committed(shard_id)` says whether a shard's marker exists (a reader's index,
    `DatasetIndex.knows`, after a full catch-up) and `strays` are the non-marker files that catch-up met in the
    commits folder; without them both come from listing the markers here."""
    if committed is None or strays is None:
        entries = list(list_commits(storage, dataset))
        names = {entry.shard_id for entry in entries if entry.is_marker}
        committed, strays = names.__contains__, [entry.key for entry in entries if not entry.is_marker]
    prefix = "" if worker is None else f"w{worker:03d}-"
    for folder in (SHARDS, ERRORS, COUNTS):
        for key in storage.list(f"{dataset}/{folder}/{prefix}"):
            if TMP_MARK in key or not committed(shard_id_of(key)):
                yield key
    yield from (key for key in strays if TMP_MARK in key and shard_id_of(key).startswith(prefix))


def clean_leftovers(storage: Storage, dataset: str, worker: int, rule: CleanRule,
                    committed: Callable[[str], bool] | None = None, strays: Iterable[str] | None = None) -> int:
    """Delete this worker's leftovers that `rule` allows: a younger unmarked file of another run may still get its
    marker (a writer paused or taken over with a commit in flight), and deleting it would leave a marker naming a
    missing file."""
    removed = kept = 0
    for key in list(leftovers(storage, dataset, worker, committed, strays)):
        if not rule.may_delete(shard_id_of(key), storage.modified(key)):
            kept += 1
            continue
        logger.info("removing uncommitted leftover %s", storage.uri(key))
        storage.delete(key)
        removed += 1
    if kept:
        logger.info("%s: kept %d unmarked files of worker %d that another run wrote less than %.0f s ago (their "
                    "marker may still come; a later run removes them)", dataset, kept, worker, rule.keep_s)
    return removed


def read_committed_rows(storage: Storage, dataset: str) -> Iterator[dict[str, Any]]:
    """All committed rows of a dataset in commit order (reads the shards; for inspection and tests, not for
    progress), streamed: a window of markers and one shard in memory."""
    for marker in markers_in_commit_order(storage, dataset):
        if marker["data"]:
            yield from read_shard(storage, f"{dataset}/{marker['data']}")
