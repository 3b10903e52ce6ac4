"""A bounded look at a prompt source before any GPU is started: how many rows the dataset has, and a sample of them
spread over the source, for the plan's prompt lengths and earlier answers' lengths.

The operator runs this on a tenant's store at plan time, so every read is bounded three ways (SurveyBounds): the
bytes read from one source, the rows kept for the sample, and the seconds spent. Within the bounds the rows are
counted exactly; past them they are estimated from the bytes a row takes, and the survey says which and how:

* JSONL, uncompressed: the head is read up to the byte bound. A source that ends there (or whose `limit` is reached
  there) is counted exactly. A larger one is read in `windows` stretches spread evenly over it (ranged reads), each
  starting at its first whole line; its rows are the size over the mean bytes a row took in those stretches, and
  the sample comes from every stretch, so a source sorted by topic or length is not judged by its head.
* JSONL, gzip or zstd: the head only (a compressed stream cannot be entered in the middle); rows past the bound are
  estimated from the compressed bytes a row took.
* Parquet (a file or a folder of shards): the rows come exactly from each file's footer (a ranged read on S3), and
  the sample from the first row groups up to the byte bound.

Rows are parsed only for the sample (a row that is not a prompt is counted in `refused`, not sampled): the
count itself never parses JSON.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from ..store.bounded_get import known_size
from ..store.storage import open_storage, split_uri
from .adapters import DEFAULT_LAYOUT, RowLayout
from .prompts import Prompt, RowError, parse_line
from .reader import (
    GZIP_MAGIC,
    UTF8_BOM,
    ZSTD_MAGIC,
    HashingReader,
    StoreOpener,
    _decompressed,
    _parquet_file,
    _skip_rest,
    parquet_shards,
)
from .row_size import RowBound, prompt_size

SURVEY_BYTES = 64 * 1024 * 1024
SAMPLE_ROWS = 2000
SURVEY_SECONDS = 20.0
WINDOWS = 8
_CLOCK_EVERY = 512  # lines between two looks at the clock
# Compressed bytes read ahead of what is decompressed: the estimate's error is at most this (and gzip's own 128 KiB
# buffer) over the bytes read, 0.2 % at the default bound.
READ_AHEAD = 16 * 1024


@dataclass(frozen=True)
class SurveyBounds:
    max_bytes: int = SURVEY_BYTES  # read from one source, all stretches together
    sample_rows: int = SAMPLE_ROWS  # parsed and kept for tokenizing
    seconds: float = SURVEY_SECONDS  # spent on one source
    windows: int = WINDOWS  # stretches a source larger than max_bytes is read in


@dataclass(frozen=True)
class SourceSurvey:
    rows: int  # rows the dataset yields, its limit applied: counted, or estimated
    exact: bool
    how: str  # how the rows were counted or estimated, for the plan
    sample: tuple[Prompt, ...]  # spread over what was read, in source order
    refused: int = 0  # rows of the sample that are not prompts (invalid JSON, over the row bound, ...)


class _Counter:
    """A digest look-alike for HashingReader: the bytes that went through."""

    def __init__(self) -> None:
        self.bytes = 0

    def update(self, data: bytes) -> None:
        self.bytes += len(data)


class _Thinning:
    """Every k-th of a stream of items, k doubling whenever twice `keep` are held: an evenly spaced sample of a
    stream whose length is not known in advance, in bounded memory."""

    def __init__(self, keep: int) -> None:
        self.keep = max(1, keep)
        self.stride = 1
        self.items: list[tuple[int, bytes]] = []
        self.seen = 0

    def offer(self, line: int, raw: bytes) -> None:
        if self.seen % self.stride == 0:
            self.items.append((line, raw))
            if len(self.items) >= 2 * self.keep:
                self.items = self.items[::2]
                self.stride *= 2
        self.seen += 1

    def sample(self) -> list[tuple[int, bytes]]:
        """`keep` of the held items, evenly spaced (all of them when there are no more)."""
        held = len(self.items)
        if held <= self.keep:
            return list(self.items)
        return [self.items[i * held // self.keep] for i in range(self.keep)]


class _Raw(io.RawIOBase):
    """A store's body (its own reads bounded, e.g. the operator's TenantStorage) as raw bytes under a buffered
    reader, so lines, peeks and seeks go through its read, never around it."""

    def __init__(self, body: Any) -> None:
        super().__init__()
        self._body = body
        self.size = known_size(body)  # what known_size reads of the buffered reader over it

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def seekable(self) -> bool:
        return bool(getattr(self._body, "seekable", lambda: False)())

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self._body.seek(offset, whence))

    def tell(self) -> int:
        return int(self._body.tell())

    def close(self) -> None:
        self._body.close()
        super().close()


@dataclass(frozen=True)
class _Store:
    """Where the sources are read from: the endpoint, or the stores `opener` opens (another account's)."""

    endpoint: str | None
    opener: StoreOpener | None = None

    def open(self, source: str) -> IO[bytes]:
        parent, name = split_uri(source)
        if self.opener is None:
            return open_storage(parent, self.endpoint).open_read(name)
        return io.BufferedReader(_Raw(self.opener(parent).open_read(name)), buffer_size=READ_AHEAD)


@dataclass
class _Stretch:
    lines: int = 0  # non-blank lines that ended inside the stretch
    bytes: int = 0  # bytes of those lines
    ended: bool = False  # the source ended inside it


def _read_lines(stream: Any, budget: int, limit: int | None, first_line: int, thinning: _Thinning,
                max_line: int, deadline: Callable[[], bool], at_start: bool) -> _Stretch:
    """Whole lines of `stream` until `budget` bytes, the limit, the source's end or the deadline; each non-blank one
    offered to the sample (a line over `max_line` bytes is counted, skipped, never held)."""
    stretch = _Stretch()
    line = first_line
    while stretch.bytes < budget and (limit is None or stretch.lines < limit):
        raw = stream.readline(max_line + 2)
        if not raw:
            stretch.ended = True
            break
        size = len(raw)
        oversize = not raw.endswith(b"\n") and len(raw) >= max_line + 2
        if oversize:
            size += _skip_rest(stream)
        if at_start and line == first_line and raw.startswith(UTF8_BOM):
            raw = raw[len(UTF8_BOM):]
        stretch.bytes += size
        line += 1
        if oversize or raw.strip():  # a row (one over the bound is counted, never held); blank lines are none
            stretch.lines += 1
            if not oversize:
                thinning.offer(line, raw)
        if line % _CLOCK_EVERY == 0 and deadline():
            break
    return stretch


def _jsonl(source: str, store: _Store, limit: int | None, bounds: SurveyBounds, max_line: int,
           deadline: Callable[[], bool]) -> tuple[int, bool, str, list[tuple[int, bytes]]]:
    thinning = _Thinning(bounds.sample_rows)
    with store.open(source) as handle:
        size = known_size(handle)
        head = handle.peek(4)[:4] if hasattr(handle, "peek") else b""
        compressed = head.startswith((GZIP_MAGIC, ZSTD_MAGIC))
        if compressed or size is None or size <= bounds.max_bytes:
            counter = _Counter()
            raw_stream = io.BufferedReader(HashingReader(handle, counter), buffer_size=READ_AHEAD)
            with _decompressed(raw_stream) as stream:
                stretch = _read_lines(stream, bounds.max_bytes if not compressed else 1 << 62, limit, 0, thinning,
                                      max_line, lambda: deadline() or counter.bytes >= bounds.max_bytes, True)
            if stretch.ended or (limit is not None and stretch.lines >= limit):
                return stretch.lines, True, f"counted: {stretch.lines:,} rows", thinning.sample()
            consumed = max(counter.bytes, 1)
            total = size or consumed
            estimate = max(stretch.lines, round(stretch.lines * total / consumed))
            unit = "compressed bytes" if compressed else "bytes"
            return (estimate, False, f"estimated: ~{estimate:,} rows from {consumed / max(stretch.lines, 1):,.0f} "
                    f"{unit} a row over the first {consumed / 1e6:,.1f} MB of {total / 1e6:,.1f} MB",
                    thinning.sample())
        # Larger than the bound and seekable: evenly spread stretches.
        per_window = bounds.max_bytes // bounds.windows
        lines = taken = 0
        head_stretch = _Stretch()
        for index in range(bounds.windows):
            start = index * size // bounds.windows
            handle.seek(start)
            if index:
                start += _skip_rest(handle)  # the first line is whole only from the file's start
            stretch = _read_lines(handle, per_window, None, 0, thinning, max_line, deadline, index == 0)
            if index == 0:
                head_stretch = stretch
                if limit is not None and stretch.lines >= limit:
                    return limit, True, f"counted: the limit, {limit:,} rows, within the first {stretch.bytes:,} B", \
                        thinning.sample()
            lines += stretch.lines
            taken += stretch.bytes
            if deadline():
                break
        per_row = taken / max(lines, 1)
        estimate = max(head_stretch.lines, round(size / per_row)) if lines else 0
        return (estimate, False, f"estimated: ~{estimate:,} rows from {per_row:,.0f} bytes a row over {lines:,} rows "
                f"read in {index + 1} stretches spread over {size / 1e6:,.1f} MB", thinning.sample())


def _parquet(source: str, store: _Store, columns: tuple[str, ...], limit: int | None, bounds: SurveyBounds, bound: RowBound | None,
             deadline: Callable[[], bool]) -> tuple[int, bool, str, list[tuple[int, Any]]]:
    from ..store.parquet_rows import OversizeRow, bounded_rows

    shards = parquet_shards(source, store.endpoint, store.opener)
    files = [source] if shards is None else [f"{source.rstrip('/')}/{shard}" for shard in shards]
    thinning_rows: list[tuple[int, Any]] = []
    total = 0
    read_bytes = 0
    for path in files:
        with store.open(path) as handle:
            parquet = _parquet_file(path, handle, columns)
            rows = parquet.file.metadata.num_rows
            if read_bytes < bounds.max_bytes and len(thinning_rows) < bounds.sample_rows and not deadline():
                budget = min(bounds.max_bytes - read_bytes, 32 * 1024 * 1024)
                for number, row in enumerate(bounded_rows(parquet, bound.max_bytes if bound else None, budget),
                                             start=total + 1):
                    if len(thinning_rows) >= bounds.sample_rows or (limit is not None and number > limit):
                        break
                    if not isinstance(row, OversizeRow):
                        thinning_rows.append((number, row))
                        read_bytes += 64 + sum(len(str(v)) for v in row.values())
            total += rows
    counted = min(total, limit) if limit is not None else total
    return counted, True, f"counted: {counted:,} rows (Parquet footers)", thinning_rows


def survey_source(source: str, fmt: str, endpoint: str | None = None, limit: int | None = None,
                  layout: RowLayout = DEFAULT_LAYOUT, bound: RowBound | None = None,
                  bounds: SurveyBounds = SurveyBounds(),
                  clock: Callable[[], float] = time.monotonic, opener: StoreOpener | None = None) -> SourceSurvey:
    """The dataset's rows (its limit applied) and a sample of its prompts, within `bounds`. `opener` opens the
    stores the sources are in (the operator's: the tenant's credentials, each call under its deadline)."""
    started = clock()
    store = _Store(endpoint, opener)

    def deadline() -> bool:
        return clock() - started >= bounds.seconds

    max_line = bound.max_bytes if bound is not None else RowBound.of(None).max_bytes
    if fmt == "parquet":
        rows, exact, how, raw_rows = _parquet(source, store, layout.columns(), limit, bounds, bound, deadline)
    else:
        rows, exact, how, raw_rows = _jsonl(source, store, limit, bounds, max_line, deadline)
    if not exact and limit is not None and rows >= limit:
        rows, how = limit, f"the limit, {limit:,} rows ({how})"
    sample: list[Prompt] = []
    refused = 0
    for line, raw in raw_rows:
        item = parse_line(line, raw, layout)
        if isinstance(item, RowError) or (bound is not None and prompt_size(item) > bound.max_bytes):
            refused += 1
            continue
        sample.append(item)
    if deadline() and not exact:
        how += f" (stopped at the {bounds.seconds:g} s bound)"
    return SourceSurvey(rows=rows, exact=exact, how=how, sample=tuple(sample), refused=refused)

