"""The counting pass's result kept in the output, so a resume does not parse the whole source again.

`scan.py` parses every row of a source (rows, this worker's rows and lines, repeated ids): about 20 µs a row, over
three minutes at 10 million rows, on every start of every worker. Its result depends only on the source's bytes, the
dataset's limit and the worker split, so it is written to `<dataset>/scans/<key>.scan` (`packed.py`: verified by a
digest) with `key` a hash of those and of the source's identity as the store reports it (local: size, mtime and
inode; S3: ETag, size and modification time; a dataset folder: each shard's name and identity), and of the
input layout (the same rows read as another layout have other valid rows and ids). A changed source has another identity, so another key: its old
result is never used. A cache that is missing, torn or of another format is ignored and the scan runs again.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import astuple, replace
from pathlib import Path

import numpy as np

from ..store.bounded_get import get_bounded
from ..store.packed import PackError, pack, raw_size, unpack
from ..store.storage import Storage, StorageError
from .adapters import DEFAULT_LAYOUT, RowLayout
from .duplicates import DuplicateIds
from .length_key import CODES
from .reader import source_identity
from .row_size import RowBound
from .scan import LineSet, SourceScan, scan_source

logger = logging.getLogger(__name__)

KIND = "scan"
# bump when what the scan computes changes (2: rows read through the dataset's input layout; 3: bound; 4: the last
# line, the skipped lines and the content hash; 5: the length codes, counted here and per line beside it)
VERSION = 5
SCANS = "scans"
CODES_SUFFIX = ".codes"  # beside `<key>.scan`: each line's length code, one byte a line (line_codes.py)
# A scan is two bits per line (this worker's lines, the skipped ones) and 16 bytes per repeated id: far under these
# at any source a run may have (bounds.MAX_SLOTS lines). Whoever writes the output writes the cache too, so a larger
# one is neither read past SCAN_BYTES nor inflated past SCAN_RAW_BYTES (a forged 1 MiB scan inflated to 1 GiB): the
# source is scanned again instead.
SCAN_RAW_BYTES = 128 * 1024 * 1024
SCAN_BYTES = SCAN_RAW_BYTES + 1024 * 1024  # the hashes of repeated ids do not compress


def cache_key(dataset: str, source: str, identity: str, fmt: str, limit: int | None, worker_index: int,
              worker_count: int, layout: RowLayout = DEFAULT_LAYOUT, bound: RowBound | None = None) -> str:
    described = (f"{VERSION}|{source}|{identity}|{fmt}|{limit}|{worker_index}|{worker_count}|{bound}|"
                 f"{'|'.join(str(part) for part in astuple(layout))}")
    digest = hashlib.blake2b(described.encode(), digest_size=16).hexdigest()
    return f"{dataset}/{SCANS}/w{worker_index:03d}-{digest}.scan"


def _arrays(scan: SourceScan) -> dict[str, np.ndarray]:
    arrays = {"duplicate_hashes": scan.duplicates.hashes.astype(np.uint64),
              "duplicate_lines": scan.duplicates.first_lines.astype(np.int64)}
    if scan.owned is not None:
        arrays["owned"] = scan.owned.to_array()
    if scan.skipped is not None:
        arrays["skipped"] = scan.skipped.to_array()
    return arrays


def encode_scan(scan: SourceScan, described: Mapping[str, object]) -> bytes:
    arrays = _arrays(scan)
    return pack(KIND, {"version": VERSION, "rows": scan.rows, "worker_rows": scan.worker_rows,
                       "last_line": scan.last_line, "content_hash": scan.content_hash, "source": described,
                       "length_codes": list(scan.length_codes or ())}, arrays)


def decode_scan(data: bytes) -> SourceScan:
    header, arrays = unpack(KIND, data, SCAN_RAW_BYTES)
    if header.get("version") != VERSION:
        raise PackError(f"scan version {header.get('version')!r}, this tokenmill reads {VERSION}")
    hashes, lines = arrays["duplicate_hashes"], arrays["duplicate_lines"]
    if hashes.shape != lines.shape or (hashes.size > 1 and bool((hashes[1:] < hashes[:-1]).any())):
        raise PackError("scan duplicate ids are not sorted pairs")
    owned = LineSet(arrays["owned"].tobytes()) if "owned" in arrays else None
    skipped = LineSet(arrays["skipped"].tobytes()) if "skipped" in arrays else None
    last = header.get("last_line")
    content = header.get("content_hash")
    codes = header.get("length_codes")
    if not isinstance(codes, list) or len(codes) not in (0, CODES) or not all(type(n) is int and n >= 0
                                                                              for n in codes):
        raise PackError("scan length codes are not a count per code")
    return SourceScan(int(header["rows"]), int(header["worker_rows"]), DuplicateIds(hashes, lines), owned,
                      None if last is None else int(last), skipped, None if content is None else str(content),
                      tuple(codes) or None)


def codes_key(scan_key: str) -> str:
    """Where the lines' length codes of the scan at `scan_key` are kept."""
    return scan_key.removesuffix(".scan") + CODES_SUFFIX


def cached_scan(storage: Storage, dataset: str, source: str, fmt: str, endpoint: str | None = None,
                limit: int | None = None, worker_index: int = 0, worker_count: int = 1,
                layout: RowLayout = DEFAULT_LAYOUT, bound: RowBound | None = None) -> SourceScan:
    """The scan of `source` for this worker: from the output's cache when the source is unchanged, else scanned now
    (and cached for the next start). Its `codes` names where its lines' length codes are kept (the object may be
    missing: the codes are a help to the order, never needed)."""
    identity = source_identity(source, endpoint)
    key = cache_key(dataset, source, identity, fmt, limit, worker_index, worker_count, layout, bound)
    try:
        if storage.exists(key):
            scan = decode_scan(get_bounded(storage, key, SCAN_BYTES))
            logger.info("%s: source scan from cache %s (%d rows)", dataset, storage.uri(key), scan.rows)
            return replace(scan, codes=codes_key(key))
    except (PackError, KeyError, TypeError, ValueError, StorageError) as error:
        logger.warning("%s: cached scan %s not used (%s); scanning the source again", dataset, storage.uri(key), error)
    with tempfile.NamedTemporaryFile(prefix="tokenmill-codes-", suffix=CODES_SUFFIX, delete=False) as codes:
        try:
            scan = scan_source(source, fmt, endpoint, limit, worker_index, worker_count, layout, bound, codes)
        except BaseException:
            Path(codes.name).unlink(missing_ok=True)
            raise
    described = {"source": source, "identity": identity, "format": fmt, "limit": limit, "worker_index": worker_index,
                 "worker_count": worker_count}
    if raw_size(_arrays(scan)) > SCAN_RAW_BYTES:  # no reader would take it
        logger.warning("%s: the source scan inflates to over the %d bytes a cached one may: not cached", dataset,
                       SCAN_RAW_BYTES)
        return scan
    try:
        storage.put_file(codes_key(key), Path(codes.name))  # before the scan: a cached scan has its codes
        storage.put(key, encode_scan(scan, described))
    except StorageError as error:  # the next start scans again; nothing else depends on it
        logger.warning("%s: could not cache the source scan: %s", dataset, error)
    finally:
        Path(codes.name).unlink(missing_ok=True)
    return replace(scan, codes=codes_key(key))
