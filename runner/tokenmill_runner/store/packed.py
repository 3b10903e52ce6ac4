"""Immutable binary objects: a JSON header and numpy arrays, verified by a digest. Pure: bytes in and out.

Layout: `tokenmill-<kind>\\n`, an 8-byte little-endian header length, the JSON header, then a zlib payload holding
the arrays the header names (dtype and count, in order). `digest` (BLAKE2b-256 over the header with the digest
emptied, and the payload) makes a torn or altered object fail to unpack instead of being trusted. Checkpoints
(`checkpoints.py`) and cached source scans (`scan_cache.py`) are written this way.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

import numpy as np
import orjson


class PackError(ValueError):
    """An object that cannot be trusted: the message says what is wrong with it."""


def _magic(kind: str) -> bytes:
    return f"tokenmill-{kind}\n".encode()


def _digest(header: dict[str, Any], payload: bytes) -> str:
    return hashlib.blake2b(orjson.dumps({**header, "digest": ""}) + payload, digest_size=32).hexdigest()


def pack(kind: str, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    raw = b"".join(np.ascontiguousarray(array).tobytes() for array in arrays.values())
    payload = zlib.compress(raw, 1)
    full = {**header, "arrays": [{"name": name, "dtype": array.dtype.str, "count": int(array.size)}
                                 for name, array in arrays.items()], "raw_bytes": len(raw), "digest": ""}
    full["digest"] = _digest(full, payload)
    encoded = orjson.dumps(full)
    return _magic(kind) + len(encoded).to_bytes(8, "little") + encoded + payload


def unpack(kind: str, data: bytes, max_raw: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and arrays of an object `pack` wrote; `max_raw` bounds what its payload may decompress to (an
    object anyone could write is refused by its header, never inflated past that)."""
    magic = _magic(kind)
    if not data.startswith(magic) or len(data) < len(magic) + 8:
        raise PackError(f"not a tokenmill {kind}")
    start = len(magic) + 8
    length = int.from_bytes(data[len(magic):start], "little")
    try:
        header = orjson.loads(data[start:start + length])
    except orjson.JSONDecodeError as error:
        raise PackError(f"{kind} header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise PackError(f"{kind} header is not an object")
    payload = data[start + length:]
    if header.get("digest") != _digest(header, payload):
        raise PackError(f"{kind} digest does not match its content (a torn or altered object)")
    raw_bytes = header.get("raw_bytes")
    if max_raw is not None and (not isinstance(raw_bytes, int) or raw_bytes > max_raw):
        raise PackError(f"{kind} holds {raw_bytes} bytes, over the {max_raw} such an object may have")
    return header, _arrays(kind, header, payload, max_raw)


def _arrays(kind: str, header: dict[str, Any], payload: bytes, max_raw: int | None = None) -> dict[str, np.ndarray]:
    try:
        raw = zlib.decompressobj().decompress(payload, max_raw + 1) if max_raw is not None else zlib.decompress(payload)
    except zlib.error as error:
        raise PackError(f"{kind} payload does not decompress ({error})") from None
    if len(raw) != header.get("raw_bytes"):
        raise PackError(f"{kind} payload holds {len(raw)} bytes, the header says {header.get('raw_bytes')}")
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
