"""Reading a small object that someone else wrote, never more than its cap: the operator serves every tenant, and a
tenant can put a 300 MiB `config.json`, marker or checkpoint (run.json: manifest.MANIFEST_BYTES) where it will be read (one took the operator
to 1,013 MiB, past the chart's 512Mi, stopping every tenant's runs). The read stops at cap + 1 bytes (a ranged read
of the stream, whatever the object's size), so an object over its cap costs that much and is refused by name."""

from __future__ import annotations

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


def get_bounded(storage: Storage, key: str, max_bytes: int) -> bytes:
    """The object's bytes, or ObjectTooLarge once more than `max_bytes` arrived (the rest is never read)."""
    with storage.open_read(key) as body:
        # An S3 reader knows the object's ContentLength from the GET's headers: refused before a byte of the body.
        size = getattr(getattr(body, "raw", None), "size", None)
        data = body.read(max_bytes + 1) if not isinstance(size, int) or size <= max_bytes else b" " * 0
    if (isinstance(size, int) and size > max_bytes) or len(data) > max_bytes:
        raise ObjectTooLarge(f"{storage.uri(key)} is over the {max_bytes} bytes such an object may have; it was not "
                             "read further (a file of that name this large is not one tokenmill or a model writes)")
    return data
