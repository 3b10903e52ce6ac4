"""The counting pass's length code of each line (`length_key.py`), one byte a line, written as the source is read
and read back in line order by each pass of the stream: a chunk in memory, never the whole file."""

from __future__ import annotations

from typing import IO

CHUNK = 1 << 16


class CodesWriter:
    """Appends one code per line, line 1 first, through a small buffer."""

    def __init__(self, sink: IO[bytes]) -> None:
        self._sink = sink
        self._buffer = bytearray()
        self.lines = 0

    def add(self, line: int, code: int) -> None:
        """The code of `line`; lines skipped since the last one get code 0."""
        if line <= self.lines:
            raise ValueError(f"line {line} after line {self.lines}: codes are written in line order")
        self._buffer.extend(bytes(line - self.lines - 1))
        self._buffer.append(code)
        self.lines = line
        if len(self._buffer) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        self._sink.write(self._buffer)
        self._buffer.clear()


class LineCodes:
    """Reads the codes back for lines asked in increasing order; a line past the end has code 0."""

    def __init__(self, source: IO[bytes]) -> None:
        self._source = source
        self._chunk = b""
        self._start = 1  # the line of self._chunk[0]
        self._ended = False

    def code(self, line: int) -> int:
        while line >= self._start + len(self._chunk):
            if self._ended:
                return 0
            self._start += len(self._chunk)
            self._chunk = self._source.read(CHUNK)
            if not self._chunk:
                self._ended = True
                return 0
        if line < self._start:
            raise ValueError(f"line {line} asked after line {self._start}: codes are read in line order")
        return self._chunk[line - self._start]

    def close(self) -> None:
        self._source.close()
