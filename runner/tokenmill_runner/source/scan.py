"""The counting pass over a prompt source, before any request: its rows, this worker's rows, and its duplicate ids.

The source is streamed once and each row parsed as the stream will parse it. The (id hash, line) pairs of this
worker's valid rows are spooled into `BUCKETS` temporary files by the hash's top bits; each bucket is then resolved
on its own (`duplicates.repeated_ids`), so memory stays bounded by one bucket (16 bytes per row / BUCKETS) and
the temporary files take 16 bytes per row (160 MB at 10 million rows, under $TMPDIR).
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

import numpy as np

from .adapters import DEFAULT_LAYOUT, RowLayout
from .duplicates import PAIR, DuplicateIds, repeated_ids
from .length_key import CODES, length_code
from .line_codes import CodesWriter
from .prompts import Prompt, belongs_to_worker, id_hash
from .reader import read_prompts
from .row_size import RowBound, prompt_size

logger = logging.getLogger(__name__)

BUCKET_BITS = 6
BUCKETS = 1 << BUCKET_BITS
FLUSH_ROWS = 1 << 16


@dataclass(frozen=True)
class SourceScan:
    rows: int  # rows the source yields (after the dataset's limit), every worker's
    worker_rows: int  # of them, the rows this worker generates or records
    duplicates: DuplicateIds  # ids on several lines among this worker's rows
    owned: LineSet | None = None  # the lines this worker owns (None: a single worker owns every line)
    last_line: int | None = None  # the highest line the source yields (None: `rows`, no line skipped)
    skipped: LineSet | None = None  # lines of 1..last_line that yield no row (a JSONL source's blank lines)
    content_hash: str | None = None  # BLAKE2b of every byte of the source (each shard's name and bytes)
    # This worker's valid rows per length code (length_key.py): what the stream's whole-job order plans from.
    length_codes: tuple[int, ...] | None = None
    codes: str | None = None  # the storage key of each line's code, one byte a line (scan_cache.py)

    def owns(self, line: int) -> bool:
        return self.owned is None or self.owned.has(line)

    @property
    def lines(self) -> int:
        return self.rows if self.last_line is None else self.last_line

    def worker_lines(self) -> np.ndarray | None:
        """A bool per line of 1..lines: the lines this worker settles (None: every one), for
        `DatasetLedger.completeness`."""
        if self.owned is not None:
            return self.owned.mask(self.lines)
        if self.skipped is not None:
            return ~self.skipped.mask(self.lines)
        return None


class LineSet:
    """A set of 1-based line numbers as a bitmap: a bit per line of the source, never an object per line."""

    def __init__(self, bits: bytes | bytearray = b"") -> None:
        self._bits = bytearray(bits)

    def add(self, line: int) -> None:
        byte = (line - 1) >> 3
        if byte >= len(self._bits):
            self._bits.extend(bytes(max(byte + 1 - len(self._bits), len(self._bits))))
        self._bits[byte] |= 1 << ((line - 1) & 7)

    def has(self, line: int) -> bool:
        byte = (line - 1) >> 3
        return 0 <= byte < len(self._bits) and bool((self._bits[byte] >> ((line - 1) & 7)) & 1)

    def to_array(self) -> np.ndarray:
        return np.frombuffer(bytes(self._bits), dtype=np.uint8)

    def mask(self, lines: int) -> np.ndarray:
        """A bool per line of 1..lines: in the set or not."""
        bits = np.unpackbits(self.to_array(), bitorder="little").astype(bool)[:lines]
        return np.concatenate([bits, np.zeros(lines - bits.size, dtype=bool)]) if bits.size < lines else bits

    def __len__(self) -> int:
        return int(np.unpackbits(self.to_array()).sum(dtype=np.int64))


class PairSpool:
    """(id hash, line) pairs spooled to bucket files by the hash's top bits, resolved bucket by bucket."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._hashes = array("Q")
        self._lines = array("q")
        self._files: dict[int, BinaryIO] = {}

    def add(self, key: int, line: int) -> None:
        self._hashes.append(key)
        self._lines.append(line)
        if len(self._hashes) >= FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self._hashes:
            return
        pairs = np.empty(len(self._hashes), PAIR)
        pairs["hash"] = np.frombuffer(self._hashes, dtype=np.uint64)
        pairs["line"] = np.frombuffer(self._lines, dtype=np.int64)
        buckets = (pairs["hash"] >> np.uint64(64 - BUCKET_BITS)).astype(np.int64)
        order = np.argsort(buckets, kind="stable")
        pairs, buckets = pairs[order], buckets[order]
        bounds = np.searchsorted(buckets, np.arange(BUCKETS + 1))
        for bucket in range(BUCKETS):
            start, end = int(bounds[bucket]), int(bounds[bucket + 1])
            if start < end:
                self._file(bucket).write(pairs[start:end].tobytes())
        self._hashes, self._lines = array("Q"), array("q")

    def _file(self, bucket: int) -> BinaryIO:
        if bucket not in self._files:
            self._files[bucket] = (self.folder / f"ids-{bucket:02d}.bin").open("wb")
        return self._files[bucket]

    def resolve(self) -> DuplicateIds:
        self._flush()
        resolved = []
        for bucket, handle in sorted(self._files.items()):
            handle.close()
            pairs = np.fromfile(self.folder / f"ids-{bucket:02d}.bin", dtype=PAIR)
            hashes, lines = repeated_ids(pairs)
            if hashes.size:
                resolved.append((hashes, lines))
        self._files.clear()
        return DuplicateIds.from_buckets(resolved)


def scan_source(source: str, fmt: str, endpoint: str | None = None, limit: int | None = None,
                worker_index: int = 0, worker_count: int = 1, layout: RowLayout = DEFAULT_LAYOUT,
                bound: RowBound | None = None, codes: IO[bytes] | None = None) -> SourceScan:
    """Count the source's rows and this worker's, and find the ids that occur on more than one valid line. Rows
    over the `bound` are read as the stream reads them: refused, without being held. Each line's length code
    (length_key.py; 0 for a line this worker does not generate) goes to `codes`, one byte a line."""
    rows = worker_rows = last = 0
    histogram = [0] * CODES
    writer = CodesWriter(codes) if codes is not None else None
    owned = LineSet() if worker_count > 1 else None
    skipped = LineSet()
    digest = hashlib.blake2b(digest_size=32)
    with tempfile.TemporaryDirectory(prefix="tokenmill-ids-") as folder:
        spool = PairSpool(Path(folder))
        for item in read_prompts(source, fmt, endpoint, limit, layout=layout, bound=bound, digest=digest):
            rows += 1
            for gap in range(last + 1, item.line):  # blank lines: numbered, yield no row, so they are no slot
                skipped.add(gap)
            last = item.line
            if not belongs_to_worker(item, worker_index, worker_count):
                continue
            worker_rows += 1
            if owned is not None:
                owned.add(item.line)
            # Only rows that would be generated take part: a bad row with an id does not make a later good row
            # with the same id a duplicate (it is recorded for what is wrong with it).
            if isinstance(item, Prompt):
                spool.add(id_hash(item.sample_id), item.line)
                code = length_code(item.messages, prompt_size(item))
                histogram[code] += 1
                if writer is not None:
                    writer.add(item.line, code)
        duplicates = spool.resolve()
    if writer is not None:
        writer.flush()
    if len(duplicates):
        logger.info("%s: %d sample ids occur on more than one line; later lines are recorded as duplicates",
                    source, len(duplicates))
    if last > rows:
        logger.info("%s: %d blank lines among its first %d lines; they yield no row and are no slot", source,
                    last - rows, last)
    return SourceScan(rows, worker_rows, duplicates, owned, last, skipped if last > rows else None,
                      digest.hexdigest(), tuple(histogram))
