"""Prompt sources: rows streamed from JSONL or Parquet, local or on S3, each parsed by `prompts.parse_line`."""

from __future__ import annotations

import io
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .prompts import Prompt, RowError, parse_line
from .storage import open_storage, split_uri

PARQUET_BATCH_ROWS = 1024


def source_format(source: str, declared: str = "auto") -> str:
    if declared != "auto":
        return declared
    return "parquet" if source.rstrip("/").lower().endswith(".parquet") else "jsonl"


def _open_source(source: str, endpoint: str | None) -> io.BufferedIOBase:
    parent, name = split_uri(source)
    return open_storage(parent, endpoint).open_read(name)


def read_jsonl(source: str, endpoint: str | None = None, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) for each non-blank line, streamed; at most `limit` rows."""
    rows = 0
    with _open_source(source, endpoint) as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            if limit is not None and rows >= limit:
                return
            rows += 1
            yield number, raw


def read_parquet(source: str, endpoint: str | None = None, limit: int | None = None) -> Iterator[tuple[int, Any]]:
    """(row number, row dict) streamed in record batches; S3 objects are spooled to a temporary file first
    because Parquet needs random access to its footer."""
    import pyarrow.parquet as pq

    with tempfile.TemporaryFile() as spool:
        if source.startswith("s3://"):
            with _open_source(source, endpoint) as body:
                while chunk := body.read(8 * 1024 * 1024):
                    spool.write(chunk)
            spool.seek(0)
            parquet = pq.ParquetFile(spool)
        else:
            parquet = pq.ParquetFile(source.removeprefix("file://"))
        number = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                if limit is not None and number >= limit:
                    return
                number += 1
                yield number, row


def read_prompts(source: str, fmt: str, endpoint: str | None = None, limit: int | None = None,
                 wanted: Callable[[int], bool] | None = None) -> Iterator[Prompt | RowError]:
    """The source's rows, parsed. `wanted(line)` is asked before a row is parsed: a resume skips the rows that are
    done (or another worker's) for the price of reading them, not of parsing them."""
    rows: Iterable[tuple[int, Any]] = (
        read_parquet(source, endpoint, limit) if fmt == "parquet" else read_jsonl(source, endpoint, limit)
    )
    for line, raw in rows:
        if wanted is None or wanted(line):
            yield parse_line(line, raw)
