"""Prompt sources: rows streamed from JSONL or Parquet, local or on S3, each parsed by `prompts.parse_line`.

A source may also be a folder of Parquet shards, as Hugging Face lays out a dataset (`*.parquet`, else
`data/*.parquet`, e.g. data/train-00000-of-00003.parquet): the shards are read in name order and row numbers
continue across them, so (line, sample index) stays a stable identity of each sample while the folder is unchanged.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..store.manifest import SourceIdentity
from ..store.storage import Storage, open_storage, split_uri
from .adapters import DEFAULT_LAYOUT, RowLayout
from .prompts import Prompt, RowError, parse_line
from .row_size import RowBound, prompt_size

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz")
SHARD_FOLDERS = ("", "data/")  # where a dataset folder keeps its shards, in the order they are looked for


def _folder_storage(source: str, endpoint: str | None) -> Storage | None:
    """The storage rooted at the source when it names a folder, else None."""
    if source.lower().endswith(FILE_SUFFIXES):
        return None
    if source.startswith("s3://"):
        return open_storage(source.rstrip("/") + "/", endpoint)
    local = Path(source.removeprefix("file://"))
    return open_storage(str(local), endpoint) if local.is_dir() else None


def parquet_shards(source: str, endpoint: str | None = None) -> list[str] | None:
    """The shard keys (relative to the folder, in name order) when `source` is a dataset folder, else None. A folder
    without shards is an error that says where tokenmill looked."""
    storage = _folder_storage(source, endpoint)
    if storage is None:
        return None
    for folder in SHARD_FOLDERS:
        shards = sorted(key for key in storage.list(folder)
                        if key.endswith(".parquet") and "/" not in key[len(folder):])
        if shards:
            return shards
    if source.startswith("s3://") and not source.endswith("/"):
        return None  # an S3 object without a known extension: read as a file
    raise FileNotFoundError(f"{source}: a folder without *.parquet or data/*.parquet shards")


def source_problem(source: str, endpoint: str | None = None) -> str | None:
    """Why the source cannot be read, found with one look before anything starts (a file that does not exist, a
    folder without shards), or None."""
    try:
        if parquet_shards(source, endpoint) is not None:
            return None
    except FileNotFoundError as error:
        return str(error)
    parent, name = split_uri(source)
    if not name or not open_storage(parent, endpoint).exists(name):
        return f"{source} does not exist"
    return None


def source_format(source: str, declared: str = "auto", endpoint: str | None = None) -> str:
    if declared != "auto":
        return declared
    if source.rstrip("/").lower().endswith(".parquet") or parquet_shards(source, endpoint) is not None:
        return "parquet"
    return "jsonl"


def source_identity(source: str, endpoint: str | None) -> str:
    """What changes when the source does: the object's identity, or each shard's name and identity."""
    shards = parquet_shards(source, endpoint)
    if shards is None:
        parent, name = split_uri(source)
        return open_storage(parent, endpoint).identity(name)
    storage = _folder_storage(source, endpoint)
    assert storage is not None
    return ";".join(f"{shard}:{storage.identity(shard)}" for shard in shards)


GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
UTF8_BOM = b"\xef\xbb\xbf"
SKIP_CHUNK = 1024 * 1024  # how much of an oversize line is held at a time while it is skipped


@dataclass(frozen=True)
class OversizeLine:
    """A line longer than the row bound, skipped without being held: only its size is known."""
    size: int


IDENTITY_BLOCK = 65536  # bytes of a source's head hashed into its identity


def describe_source(source: str, endpoint: str | None) -> SourceIdentity:
    """The source's identity for the run manifest: its size, the store's version string, and a hash of its first
    block (of each shard's name and size, and the first shard's first block, for a folder). A replaced or rewritten
    file changes the hash or the size; a re-upload of the same bytes changes only the version."""
    version = source_identity(source, endpoint)
    sizes = [int(size) for size in re.findall(r"size=(\d+)", version)]
    digest = hashlib.blake2b(digest_size=16)
    shards = parquet_shards(source, endpoint)
    if shards is not None:
        digest.update(";".join(f"{shard}:{size}" for shard, size in zip(shards, sizes, strict=False)).encode())
        first = f"{source.rstrip('/')}/{shards[0]}"
    else:
        first = source
    with _open_source(first, endpoint) as handle:
        digest.update(handle.read(IDENTITY_BLOCK))
    return SourceIdentity(uri=source, size=sum(sizes) if sizes else None, version=version,
                          head_hash=digest.hexdigest())


def _open_source(source: str, endpoint: str | None) -> IO[bytes]:
    parent, name = split_uri(source)
    return open_storage(parent, endpoint).open_read(name)


# A source's bytes as read: the raw stream, or one of the decompressors over it.
ByteStream = IO[bytes] | io.BufferedIOBase


def _decompressed(handle: IO[bytes]) -> ByteStream:
    """The text of a gzip or zstd file, found by its first bytes whatever its name (`.jsonl.gz`, or a `.jsonl`
    that is compressed): read raw, compressed bytes become one or two rows of garbage."""
    head = handle.peek(4)[:4] if hasattr(handle, "peek") else b""
    if head.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=handle, mode="rb")
    if head.startswith(ZSTD_MAGIC):
        import pyarrow as pa  # pyarrow's zstd codec: no other zstd package is installed

        stream = pa.CompressedInputStream(pa.PythonFile(handle, mode="r"), "zstd")
        return io.BufferedReader(stream)
    return handle


def _skip_rest(handle: ByteStream) -> int:
    """Read past the end of the current line a chunk at a time; the bytes skipped."""
    skipped = 0
    while chunk := handle.readline(SKIP_CHUNK):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def _lines(handle: ByteStream, max_bytes: int | None) -> Iterator[bytes | OversizeLine]:
    """Each line, or an OversizeLine for a line over `max_bytes`: never more than max_bytes + 2 bytes held (room
    for a line of exactly max_bytes and its "\r\n", so line numbers never depend on the bound)."""
    first = True
    while raw := handle.readline(-1 if max_bytes is None else max_bytes + 2):
        if first and raw.startswith(UTF8_BOM):  # editors on Windows start files with one; it is not JSON
            raw = raw[len(UTF8_BOM):]
        first = False
        if max_bytes is not None and len(raw.rstrip(b"\r\n")) > max_bytes:
            yield OversizeLine(len(raw) + (0 if raw.endswith(b"\n") else _skip_rest(handle)))
        else:
            yield raw


def read_jsonl(source: str, endpoint: str | None = None, limit: int | None = None,
               max_bytes: int | None = None, digest: Any = None) -> Iterator[tuple[int, bytes | OversizeLine]]:
    """(line number, raw line) for each non-blank line, streamed, gzip or zstd decompressed; at most `limit` rows.
    A line over `max_bytes` comes as an OversizeLine, so memory never depends on one line's size. A `digest`
    (hashlib) is fed every byte of the file as stored, to its end whatever the limit."""
    rows = 0
    with _open_source(source, endpoint) as opened:
        handle: IO[bytes] = (opened if digest is None else
                             io.BufferedReader(HashingReader(opened, digest), buffer_size=SKIP_CHUNK))
        with _decompressed(handle) as text:
            for number, raw in enumerate(_lines(text, max_bytes), start=1):
                if isinstance(raw, bytes) and not raw.strip():
                    continue
                if limit is not None and rows >= limit:
                    break
                rows += 1
                yield number, raw
            if digest is not None:  # past the limit too: the identity is of the whole file
                while handle.read(SKIP_CHUNK):
                    pass


def read_parquet(source: str, endpoint: str | None = None, limit: int | None = None,
                 max_bytes: int | None = None, layout: RowLayout = DEFAULT_LAYOUT) -> Iterator[tuple[int, Any]]:
    """(row number, row dict or OversizeRow) streamed in bounded batches (store/parquet_rows.py), only the
    layout's columns; a folder's shards one after the other, numbered on."""
    return (item[:2] for item in read_parquet_rows(source, endpoint, limit, max_bytes=max_bytes, layout=layout))


def read_parquet_rows(source: str, endpoint: str | None = None, limit: int | None = None,
                      digest: Any = None, max_bytes: int | None = None,
                      layout: RowLayout = DEFAULT_LAYOUT) -> Iterator[tuple[int, Any, str | None, int]]:
    """(row number, row dict or OversizeRow, shard key or None, row within the shard) of a Parquet file or dataset
    folder, read from the layout's columns only (the others are never decoded). A `digest` is fed every shard's
    name and bytes, in order, past the limit too. A row over `max_bytes` comes as an OversizeRow, never as Python
    objects."""
    shards = parquet_shards(source, endpoint)
    columns = layout.columns()
    if shards is None:
        for number, row in _read_one_parquet(source, endpoint, limit, digest, max_bytes, columns):
            yield number, row, None, number
        return
    base = source.rstrip("/") + "/"
    number = 0  # rows of the shards before this one
    for shard in shards:
        if digest is not None:
            digest.update(f"{shard}\n".encode())
        left = None if limit is None else limit - number
        if left is not None and left <= 0:
            if digest is not None:
                _hash_file(base + shard, endpoint, digest)
            continue
        read = 0
        for read, row in _read_one_parquet(base + shard, endpoint, left, digest, max_bytes, columns):
            yield number + read, row, shard, read
        number += read


def _hash_file(source: str, endpoint: str | None, digest: Any) -> None:
    with _open_source(source, endpoint) as handle:
        while chunk := handle.read(SKIP_CHUNK):
            digest.update(chunk)


class HashingReader(io.RawIOBase):
    """A reader that feeds every byte read through it to a digest: the scan's one pass over a source also gives
    the hash of its whole content (`manifest.SourceIdentity.content_hash`)."""

    def __init__(self, inner: IO[bytes], digest: Any) -> None:
        self._inner, self._digest = inner, digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._inner.read(len(buffer))
        if not data:
            return 0
        self._digest.update(data)
        buffer[:len(data)] = data
        return len(data)


class SourceError(ValueError):
    """A source file that cannot be read as its format at all (a truncated Parquet file, JSONL named .parquet)."""


def _parquet_file(source: str, handle: Any, columns: tuple[str, ...]) -> Any:
    import pyarrow as pa

    from ..store.parquet_rows import open_parquet  # pyarrow only for Parquet sources

    try:
        return open_parquet(handle, columns)
    except (pa.ArrowException, OSError) as error:  # ArrowInvalid: "Parquet magic bytes not found in footer"
        raise SourceError(f"{source} is not a readable Parquet file ({error}); is it truncated, or another "
                          "format (set the dataset's format)?") from None


def _read_one_parquet(source: str, endpoint: str | None, limit: int | None, digest: Any = None,
                      max_bytes: int | None = None,
                      columns: tuple[str, ...] = DEFAULT_LAYOUT.columns()) -> Iterator[tuple[int, Any]]:
    """S3 objects are spooled to a temporary file first because Parquet needs random access to its footer (the
    spooling feeds the `digest`; a local file is read through once for it, as pyarrow reads it out of order)."""
    with tempfile.TemporaryFile() as spool:
        if source.startswith("s3://"):
            with _open_source(source, endpoint) as body:
                while chunk := body.read(8 * 1024 * 1024):
                    if digest is not None:
                        digest.update(chunk)
                    spool.write(chunk)
            spool.seek(0)
            parquet = _parquet_file(source, spool, columns)
        else:
            if digest is not None:
                _hash_file(source, endpoint, digest)
            parquet = _parquet_file(source, source.removeprefix("file://"), columns)
        from ..store.parquet_rows import bounded_rows

        number = 0
        for row in bounded_rows(parquet, max_bytes):
            if limit is not None and number >= limit:
                return
            number += 1
            yield number, row


def read_prompts(source: str, fmt: str, endpoint: str | None = None, limit: int | None = None,
                 wanted: Callable[[int], bool] | None = None,
                 layout: RowLayout = DEFAULT_LAYOUT, bound: RowBound | None = None,
                 digest: Any = None) -> Iterator[Prompt | RowError]:
    """The source's rows, parsed. `wanted(line)` is asked before a row is parsed: a resume skips the rows that are
    done (or another worker's) for the price of reading them, not of parsing them. A bad row of a dataset folder
    names its shard too. A row over the `bound` is refused as prompt_too_long before it is parsed (JSONL, by its
    bytes) or rendered (Parquet, by its text). A `digest` is fed the source's whole content (`read_jsonl`)."""
    if fmt != "parquet":
        for line, raw in read_jsonl(source, endpoint, limit, None if bound is None else bound.max_bytes, digest):
            if wanted is None or wanted(line):
                yield _jsonl_row(line, raw, layout, bound)
        return
    from ..store.parquet_rows import OversizeRow

    for line, row, shard, within in read_parquet_rows(source, endpoint, limit, digest,
                                                      None if bound is None else bound.max_bytes, layout):
        if wanted is None or wanted(line):
            if isinstance(row, OversizeRow):
                item: Prompt | RowError = (
                    RowError(line, None, "prompt_too_long", f"line {line}: {row.reason}") if row.reason
                    else bound.refusal(line, row.size) if bound is not None
                    else RowError(line, None, "prompt_too_long", f"line {line}: the row is {row.size} bytes"))
            else:
                item = _bounded(parse_line(line, row, layout), bound)
            if shard is not None and isinstance(item, RowError):
                item = dataclasses.replace(item, message=f"{item.message} [shard {shard}, row {within}]")
            yield item


def _jsonl_row(line: int, raw: bytes | OversizeLine, layout: RowLayout, bound: RowBound | None) -> Prompt | RowError:
    if isinstance(raw, OversizeLine):
        assert bound is not None  # lines are only cut short against a bound
        return bound.refusal(line, raw.size)
    return _bounded(parse_line(line, raw, layout), bound)


def _bounded(item: Prompt | RowError, bound: RowBound | None) -> Prompt | RowError:
    if bound is None or not isinstance(item, Prompt):
        return item
    size = prompt_size(item)
    return item if size <= bound.max_bytes else bound.refusal(item.line, size, item.sample_id, "characters")
