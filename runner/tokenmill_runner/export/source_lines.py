"""A prompt source read by line number, for the text exports (a conversation needs each sample's messages).

Committed rows hold ids, not messages, and come in commit order, not line order. The source is indexed once: a
local JSONL file in place, anything else (S3, Parquet) spooled to a local JSON-lines file first. The index is one
8-byte offset per line (numpy-free `array`), never the messages themselves, so memory stays small for millions
of prompts.
"""

from __future__ import annotations

import tempfile
from array import array
from pathlib import Path
from typing import BinaryIO

import orjson

from ..source.adapters import DEFAULT_LAYOUT, RowLayout
from ..source.prompts import Prompt, RowError, parse_line
from ..source.reader import read_jsonl, read_parquet, source_format


class SourceLines:
    def __init__(self, source: str, declared_format: str = "auto", endpoint: str | None = None,
                 spool: Path | None = None, layout: RowLayout = DEFAULT_LAYOUT) -> None:
        self.source = source
        self.layout = layout
        fmt = source_format(source, declared_format, endpoint)
        local = source.removeprefix("file://")
        if fmt == "jsonl" and not source.startswith("s3://"):
            self._handle: BinaryIO = open(local, "rb")  # noqa: SIM115 - closed by close()
        else:
            self._handle = tempfile.TemporaryFile(dir=spool)  # noqa: SIM115
            self._spool(source, fmt, endpoint)
        self._offsets = self._index()

    def _spool(self, source: str, fmt: str, endpoint: str | None) -> None:
        # One JSON line per source row, at the row's own line number (blank lines keep JSONL numbering).
        rows = read_parquet(source, endpoint, layout=self.layout) if fmt == "parquet" else read_jsonl(source, endpoint)
        written = 0
        for number, raw in rows:
            self._handle.write(b"\n" * (number - 1 - written))
            data = raw if isinstance(raw, bytes) else orjson.dumps(raw, default=str)
            self._handle.write(data.rstrip(b"\r\n") + b"\n")
            written = number
        self._handle.flush()

    def _index(self) -> array[int]:
        offsets = array("q")
        self._handle.seek(0)
        position = 0
        for raw in self._handle:
            offsets.append(position)
            position += len(raw)
        return offsets

    def prompt(self, line: int) -> Prompt | RowError:
        if not 1 <= line <= len(self._offsets):
            return RowError(line, None, "source_changed", f"line {line}: {self.source} has {len(self._offsets)} lines")
        self._handle.seek(self._offsets[line - 1])
        return parse_line(line, self._handle.readline(), self.layout)

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> SourceLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
