"""Immutable binary objects: a JSON header and numpy arrays, verified by a digest. Pure: bytes in and out.

Layout: `tokenmill-<kind>\\n`, an 8-byte little-endian header length, the JSON header, then a zlib payload holding
the arrays the header names (dtype and count, in order). `digest` (BLAKE2b-256 over the header with the digest
emptied, and the payload) makes a torn or altered object fail to unpack instead of being trusted. Checkpoints
(`checkpoints.py`) and cached source scans (`scan_cache.py`) are written this way.

Whoever can write the prefix can compute an unkeyed digest, so it only tells a torn object from a whole one. A reader
that must not trust the prefix's writers (the shared operator) keys the digest with a secret of its own (BLAKE2b's
key): an object it did not write is refused before its payload is touched. Either way the payload is inflated at most
to `max_raw` bytes, the reader's bound (a 1 MiB checkpoint of zeros said nothing and inflated to 1 GiB, taking the
operator to 2.1 GB: security-f9665d2.md B6).
"""

from __future__ import annotations

import hashlib
import hmac
import zlib
from typing import Any

import numpy as np
import orjson

from .bounds import OverBound, check_values


class PackError(ValueError):
    """An object that cannot be trusted: the message says what is wrong with it."""


def _magic(kind: str) -> bytes:
    return f"tokenmill-{kind}\n".encode()


KEY_BYTES = 64  # BLAKE2b's longest key
# A header is a few fields and short lists (a checkpoint's ring of recent commits, at most checkpoints.RECENT_KEPT):
# it is parsed before its digest can be checked, so its size and values are bounded first.
HEADER_BYTES = 4 * 1024 * 1024
HEADER_VALUES = 1 << 16


def _digest(header: dict[str, Any], payload: bytes, key: bytes) -> str:
    return hashlib.blake2b(orjson.dumps({**header, "digest": ""}) + payload, digest_size=32,
                           key=key[:KEY_BYTES]).hexdigest()


def raw_size(arrays: dict[str, np.ndarray]) -> int:
    """The bytes `pack` inflates to: what a reader's `max_raw` must allow."""
    return sum(int(array.nbytes) for array in arrays.values())


def pack(kind: str, header: dict[str, Any], arrays: dict[str, np.ndarray], key: bytes = b"") -> bytes:
    raw = b"".join(np.ascontiguousarray(array).tobytes() for array in arrays.values())
    payload = zlib.compress(raw, 1)
    full = {**header, "arrays": [{"name": name, "dtype": array.dtype.str, "count": int(array.size)}
                                 for name, array in arrays.items()], "raw_bytes": len(raw), "digest": ""}
    full["digest"] = _digest(full, payload, key)
    encoded = orjson.dumps(full)
    return _magic(kind) + len(encoded).to_bytes(8, "little") + encoded + payload


def unpack(kind: str, data: bytes, max_raw: int, key: bytes = b"") -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and arrays of a packed object: its digest checked (keyed with `key`), then its payload inflated to
    at most `max_raw` bytes, or PackError naming what is wrong."""
    magic = _magic(kind)
    if not data.startswith(magic) or len(data) < len(magic) + 8:
        raise PackError(f"not a tokenmill {kind}")
    start = len(magic) + 8
    length = int.from_bytes(data[len(magic):start], "little")
    if length > min(len(data) - start, HEADER_BYTES):
        raise PackError(f"{kind} header says {length} bytes: over the object's {len(data) - start} or the "
                        f"{HEADER_BYTES} a header may have")
    try:
        check_values(data[start:start + length], HEADER_VALUES, f"{kind} header")
    except OverBound as error:
        raise PackError(str(error)) from None
    try:
        header = orjson.loads(data[start:start + length])
    except orjson.JSONDecodeError as error:
        raise PackError(f"{kind} header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise PackError(f"{kind} header is not an object")
    payload = data[start + length:]
    if not hmac.compare_digest(str(header.get("digest")), _digest(header, payload, key)):
        who = "one written without this reader's key" if key else "one written with a key"
        raise PackError(f"{kind} digest does not match its content (a torn or altered object, or {who})")
    return header, _arrays(kind, header, payload, max_raw)


def _arrays(kind: str, header: dict[str, Any], payload: bytes, max_raw: int) -> dict[str, np.ndarray]:
    said = header.get("raw_bytes")
    if not isinstance(said, int) or isinstance(said, bool) or not 0 <= said <= max_raw:
        raise PackError(f"{kind} says it inflates to {said!r} bytes, over the {max_raw} this reader inflates; it "
                        "was not inflated (remove it: readers fall back to what it summarises)")
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(payload, said + 1)  # never more than one byte past what it says
    except zlib.error as error:
        raise PackError(f"{kind} payload does not decompress ({error})") from None
    if len(raw) != said or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise PackError(f"{kind} payload does not inflate to the {said} bytes its header says")
    arrays, offset = {}, 0
    try:
        for spec in header["arrays"]:
            dtype, count = np.dtype(spec["dtype"]), int(spec["count"])
            arrays[str(spec["name"])] = np.frombuffer(raw, dtype=dtype, count=count, offset=offset).copy()
            offset += dtype.itemsize * count
    except (KeyError, TypeError, ValueError) as error:
        raise PackError(f"{kind} arrays do not match the header ({error})") from None
    if offset != len(raw):
        raise PackError(f"{kind} arrays use {offset} of {len(raw)} bytes")
    return arrays
