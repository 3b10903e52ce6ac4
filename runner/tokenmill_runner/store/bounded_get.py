"""Reading a small object that someone else wrote, never more than its cap: the operator serves every tenant, and a
tenant can put a 300 MiB `config.json`, marker or checkpoint (run.json: manifest.MANIFEST_BYTES) where it will be read (one took the operator
to 1,013 MiB, past the chart's 512Mi, stopping every tenant's runs). The read stops at cap + 1 bytes (a ranged read
of the stream, whatever the object's size), so an object over its cap costs that much and is refused by name."""

from __future__ import annotations

import os
import tempfile
from typing import IO

from .storage import Storage, StorageError

# Caps far above what tokenmill or a model ships: a config.json is a few KB, a safetensors index under 2 MB (Kimi-K2.5's
# is ~150 KB), a marker a few bytes per sample of one shard (at most 16384 samples),
# a checkpoint a bit per slot plus a hash per folded shard.
CONFIG_BYTES = 4 * 1024 * 1024
WEIGHT_INDEX_BYTES = 32 * 1024 * 1024
MARKER_BYTES = 16 * 1024 * 1024
CHECKPOINT_BYTES = 64 * 1024 * 1024


class ObjectTooLarge(StorageError):
    """An object over the size its reader allows."""


COPY_CHUNK = 8 * 1024 * 1024


def known_size(body: IO[bytes]) -> int | None:
    """The object's size as its reader knows it before reading: an S3 GET's ContentLength, a local file's."""
    size = getattr(getattr(body, "raw", body), "size", None)
    if isinstance(size, int):
        return size
    try:
        return os.fstat(body.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        return None


def _too_large(storage: Storage, key: str, max_bytes: int) -> ObjectTooLarge:
    return ObjectTooLarge(f"{storage.uri(key)} is over the {max_bytes} bytes such an object may have; it was not "
                          "read further (a file of that name this large is not one tokenmill or a model writes)")


def get_bounded(storage: Storage, key: str, max_bytes: int) -> bytes:
    """The object's bytes, or ObjectTooLarge once more than `max_bytes` arrived (the rest is never read); its size,
    where the store says it, refuses it before a byte of the body (a sparse 8 GiB file, an S3 object)."""
    data = storage.get_capped(key, max_bytes)
    if data is None:
        raise _too_large(storage, key, max_bytes)
    return data


def spool_bounded(storage: Storage, key: str, max_bytes: int, folder: str | None = None) -> IO[bytes]:
    """The object copied to a temporary file (closing it removes it), or ObjectTooLarge: for a file a reader needs
    at random (Parquet's footer) and that may be larger than what it should hold in memory."""
    spool = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115 - handed to the caller, who closes it
    try:
        with storage.open_read(key) as body:
            size = known_size(body)
            if size is not None and size > max_bytes:
                raise _too_large(storage, key, max_bytes)
            copied = 0
            while chunk := body.read(min(COPY_CHUNK, max_bytes + 1 - copied)):
                spool.write(chunk)
                copied += len(chunk)
                if copied > max_bytes:
                    raise _too_large(storage, key, max_bytes)
        spool.seek(0)
        return spool
    except BaseException:
        spool.close()
        raise
