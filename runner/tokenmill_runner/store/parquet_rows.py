"""Parquet rows under a byte budget: each row's size is read from the Arrow buffers (string lengths, list offsets)
before any Python object is built, so a row over the bound costs its Arrow bytes, never its Python copy. The one
reader of Parquet that someone else wrote: prompt sources (source/reader.py) and output shards (shards.py) alike.

A Parquet file can be a decompression bomb twice over: zstd makes a page of repeated text tiny, and dictionary
encoding lets one 50 MB value stand for every row that repeats it (a 5 KB file of 40 such rows decodes to 2 GB).
Three rules keep memory bounded by the budget and the row bound, not by what the file decodes to:

* every BYTE_ARRAY leaf is read as a DictionaryArray (pyarrow's `read_dictionary`), so a dictionary-encoded value is
  held once, however many rows repeat it;
* a row group is read in batches of at most `budget / (its uncompressed bytes per row)` rows, so plain-encoded text
  never decodes more than about one budget (or one row) at a time; dictionary pages are left out of that count (their
  sizes read from their page headers), because a reader decodes a chunk's dictionary once however it is batched, and
  each further batch would hold one more copy of it (a 50 MB dictionary read in two batches took the run from 420 to
  510 MB);
* rows become Python objects in slices whose sizes add up to at most the budget, and a row over the bound never
  does: it comes out as an OversizeRow with its size.

A page is decompressed whole, so a plain-encoded page of repeated text (2 GB from 170 KB of zstd) cannot be read in
parts: a row group with a column chunk that decompresses to over MAX_CHUNK_BYTES at over MAX_CHUNK_RATIO times its
stored size is refused, each of its rows as an OversizeRow naming the column, unread; so is one whose columns read
do so together (several chunks each under the bound). Only the columns the reader names are read at all: a 69 KB
file with eight unused 250 MiB columns took `tokenmill run` to 6.4 GB when every column was decoded
(security-f9665d2.md B8).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

BATCH_ROWS = 1024
# Decoded bytes of a batch, and of the rows turned into Python objects at once: a few times this is the reader's
# peak (Arrow's copy, the Python objects, the page being decompressed).
BATCH_BYTES = 32 * 1024 * 1024
# A value that is neither text nor a container costs what text_size (row_size.py) counts for it.
SCALAR_BYTES = 8
# Text compresses 3-10x, and dictionary encoding already keeps repeats out of a chunk's uncompressed size; a chunk
# that grows 100x into more than this is a decompression bomb, not a dataset.
MAX_CHUNK_BYTES = 256 * 1024 * 1024
MAX_CHUNK_RATIO = 100


@dataclass(frozen=True)
class OversizeRow:
    """A Parquet row over the row bound, never turned into Python objects: only its size is known (and why its row
    group was not read at all, for a decompression bomb)."""

    size: int
    reason: str | None = None


@dataclass(frozen=True)
class ParquetRows:
    """An open Parquet file, the top-level columns read (None: all) and their leaves' indices, and, per row group,
    the uncompressed bytes of those leaves' dictionary pages."""

    file: pq.ParquetFile
    dictionary_bytes: list[int] = field(default_factory=list)
    columns: list[str] | None = None
    leaves: list[int] | None = None

    def read_leaves(self) -> list[int]:
        return list(range(self.file.metadata.num_columns)) if self.leaves is None else self.leaves

    def group_bytes(self, group: int) -> tuple[int, int]:
        """(uncompressed, stored) bytes of the leaves read in one row group."""
        meta = self.file.metadata.row_group(group)
        chunks = [meta.column(index) for index in self.read_leaves()]
        return (sum(chunk.total_uncompressed_size for chunk in chunks),
                sum(chunk.total_compressed_size for chunk in chunks))


def open_parquet(source: Any, columns: Collection[str] | None = None) -> ParquetRows:
    """The file with its text and binary leaves read as dictionaries (one copy of each distinct value); `source` is
    a path or a seekable binary file. `columns`: the top-level columns a reader uses (those the file has are read,
    every other is never decoded); None reads them all."""
    plain = pq.ParquetFile(source)
    leaves = [column.path for column in plain.schema if column.physical_type == "BYTE_ARRAY"]
    parquet = pq.ParquetFile(source, read_dictionary=leaves) if leaves else plain
    metadata = parquet.metadata
    named = None if columns is None else [name for name in parquet.schema_arrow.names if name in set(columns)]
    read = None if named is None else [index for index in range(metadata.num_columns)
                                       if metadata.schema.column(index).path.split(".", 1)[0] in set(named)]
    rows = ParquetRows(parquet, [], named, read)
    rows.dictionary_bytes.extend(sum(_dictionary_page_size(source, metadata.row_group(group).column(index))
                                     for index in rows.read_leaves()) for group in range(metadata.num_row_groups))
    return rows


# A page header's first three fields, in Thrift's compact protocol (parquet.thrift PageHeader): type,
# uncompressed_page_size and compressed_page_size, each an i32 as a zigzag varint. Far fewer bytes than this.
_PAGE_HEADER_PREFIX = 32
_THRIFT_I32 = 5
_DICTIONARY_PAGE = 2


def _dictionary_page_size(source: Any, chunk: Any) -> int:
    """The uncompressed size of a column chunk's dictionary page from its header, or 0 (none, or a header that does
    not read as one: then its bytes count as data, as they did before)."""
    offset = chunk.dictionary_page_offset
    if not chunk.has_dictionary_page or offset is None or offset < 0:
        return 0
    if isinstance(source, str):
        with open(source, "rb") as handle:
            handle.seek(offset)
            prefix = handle.read(_PAGE_HEADER_PREFIX)
    else:
        position = source.tell()
        source.seek(offset)
        prefix = source.read(_PAGE_HEADER_PREFIX)
        source.seek(position)
    fields = _compact_i32_fields(prefix, 3)
    if fields is None or fields[0] != _DICTIONARY_PAGE or fields[1] < 0:
        return 0
    return min(fields[1], chunk.total_uncompressed_size)


def _compact_i32_fields(data: bytes, count: int) -> list[int] | None:
    """The first `count` fields of a compact-protocol struct when they are i32 fields 1..count, else None (each
    field header is then one byte: an id delta of 1 over the type)."""
    values, position = [], 0
    for _ in range(count):
        if position >= len(data) or data[position] != (1 << 4) | _THRIFT_I32:
            return None
        position += 1
        value, shift = 0, 0
        while True:
            if position >= len(data) or shift > 35:
                return None
            byte = data[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        values.append((value >> 1) ^ -(value & 1))
    return values


def _lengths(array: pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(pc.binary_length(array), 0).to_numpy(zero_copy_only=False), dtype=np.int64)


def _valid(array: pa.Array) -> np.ndarray:
    return np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _nested(offsets: pa.Array, values: np.ndarray) -> np.ndarray:
    """Per list: the sum of its items' sizes, by the list offsets (which already account for a slice)."""
    bounds = np.asarray(offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    total = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    return total[bounds[1:]] - total[bounds[:-1]]


def value_sizes(array: pa.Array) -> np.ndarray:
    """Bytes of text (and SCALAR_BYTES per other value) of each element, from the Arrow buffers alone."""
    kind = array.type
    if pa.types.is_dictionary(kind):
        sizes = value_sizes(array.dictionary)
        indices = np.asarray(pc.fill_null(array.indices, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
        picked = sizes[indices] if len(sizes) else np.zeros(len(array), dtype=np.int64)
        return np.where(_valid(array), picked, 0)
    if (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind) or pa.types.is_string_view(kind) or pa.types.is_binary_view(kind)):
        return _lengths(array)
    if pa.types.is_struct(kind):
        total = np.zeros(len(array), dtype=np.int64)
        for child in array.flatten():  # flatten() applies the struct's own slice and nulls to its children
            total += value_sizes(child)
        return total
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        values = array.values
        if pa.types.is_map(kind):
            items = value_sizes(array.keys) + value_sizes(array.items)
        else:
            items = value_sizes(values)
        return _nested(array.offsets, items)
    if pa.types.is_fixed_size_list(kind):
        items = value_sizes(array.flatten())
        return items.reshape(len(array), kind.list_size).sum(axis=1) if len(array) else items
    return np.where(_valid(array), SCALAR_BYTES, 0).astype(np.int64)


def row_sizes(batch: pa.RecordBatch) -> np.ndarray:
    """Each row's size: column names plus every value's bytes, as text_size counts a parsed row."""
    total = np.zeros(batch.num_rows, dtype=np.int64)
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        total += len(name) + value_sizes(column)
    return total


def batch_rows(parquet: ParquetRows, group: int, budget: int = BATCH_BYTES) -> int:
    """Rows per batch in one row group: as many as its uncompressed bytes per row, less its dictionary pages, let fit
    the budget (at least one, at most BATCH_ROWS)."""
    meta = parquet.file.metadata.row_group(group)
    data = parquet.group_bytes(group)[0] - (parquet.dictionary_bytes[group] if parquet.dictionary_bytes else 0)
    per_row = max(0, data) / max(1, meta.num_rows)
    return max(1, min(BATCH_ROWS, int(budget // max(1.0, per_row))))


def bomb(parquet: ParquetRows, group: int) -> str | None:
    """Why a row group is not decompressed at all, or None."""
    meta = parquet.file.metadata.row_group(group)
    advice = "Write the file with smaller pages or dictionary encoding"
    for index in parquet.read_leaves():
        chunk = meta.column(index)
        stored, size = max(1, chunk.total_compressed_size), chunk.total_uncompressed_size
        if size > MAX_CHUNK_BYTES and size > MAX_CHUNK_RATIO * stored:
            return (f"row group {group}, column {chunk.path_in_schema}: {size} bytes stored in {stored} (over "
                    f"{MAX_CHUNK_RATIO}x and over {MAX_CHUNK_BYTES} bytes), a decompression bomb; its "
                    f"{meta.num_rows} rows were refused unread. {advice}")
    size, stored = parquet.group_bytes(group)
    if size > MAX_CHUNK_BYTES and size > MAX_CHUNK_RATIO * max(1, stored):
        read = ", ".join(parquet.columns) if parquet.columns is not None else "every column"
        return (f"row group {group}: the columns read ({read}) are {size} bytes stored in {stored} (over "
                f"{MAX_CHUNK_RATIO}x and over {MAX_CHUNK_BYTES} bytes together), a decompression bomb; its "
                f"{meta.num_rows} rows were refused unread. {advice}")
    return None


def _slices(sizes: np.ndarray, max_bytes: int | None, budget: int) -> Iterator[tuple[int, int] | int]:
    """(start, stop) runs of rows under the bound adding up to at most the budget (one row at least), or the index
    of a row over the bound."""
    start, held = 0, 0
    for index, size in enumerate(sizes.tolist()):
        if max_bytes is not None and size > max_bytes:
            if index > start:
                yield start, index
            yield index
            start, held = index + 1, 0
            continue
        if index > start and held + size > budget:
            yield start, index
            start, held = index, 0
        held += size
    if start < len(sizes):
        yield start, len(sizes)


def bounded_rows(parquet: ParquetRows, max_bytes: int | None,
                 budget: int = BATCH_BYTES) -> Iterator[dict[str, Any] | OversizeRow]:
    """Every row in file order: a dict, or an OversizeRow for one over `max_bytes` (None: no bound, the budget
    still holds)."""
    for group in range(parquet.file.metadata.num_row_groups):
        if why := bomb(parquet, group):
            meta = parquet.file.metadata.row_group(group)
            share = meta.total_byte_size // max(1, meta.num_rows)
            for _ in range(meta.num_rows):
                yield OversizeRow(share, why)
            continue
        for batch in parquet.file.iter_batches(batch_size=batch_rows(parquet, group, budget), row_groups=[group],
                                               columns=parquet.columns):
            sizes = row_sizes(batch)
            for part in _slices(sizes, max_bytes, budget):
                if isinstance(part, tuple):
                    yield from batch.slice(part[0], part[1] - part[0]).to_pylist()
                else:
                    yield OversizeRow(int(sizes[part]))
        # Arrow's allocator keeps what a row group's reader freed: handed back, a second pass over the file (the
        # scan, then the stream) costs one group's decoding, not two (a 50 MB dictionary: 512 -> 420 MB peak).
        pa.default_memory_pool().release_unused()
