"""A `.ckpt` file as `torch.save` writes it, without torch: what SpecForge's OfflineEagle3Dataset reads with
`torch.load(path, weights_only=False, mmap=True)` (SF data/preprocessing.py:530-538). Pure.

torch.save's format (torch/serialization.py, `_save`, since torch 1.6) is an uncompressed zip of `<archive>/data.pkl`
(a pickle, protocol 2, whose tensors are `torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
requires_grad, hooks)` with each storage a persistent id `("storage", torch.<Type>Storage, key, "cpu", numel)`),
`<archive>/data/<key>` (each storage's raw little-endian bytes), `<archive>/byteorder` and `<archive>/version`. Each
record's data starts on a 64-byte boundary, as torch aligns it, so torch can map it in place. The pickle is written
opcode by opcode because Python's pickler will not name a class it cannot import (torch is not a dependency here).
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ALIGN = 64
# torch's legacy storage class names, per dtype (torch/storage.py `_pickle_storage_type`).
STORAGE_TYPE: dict[str, str] = {"bfloat16": "BFloat16Storage", "float16": "HalfStorage", "float32": "FloatStorage",
                                "int64": "LongStorage"}
ITEM_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8}


@dataclass(frozen=True)
class Tensor:
    """A contiguous tensor: its dtype, shape and raw little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        numel = 1
        for size in self.shape:
            numel *= size
        if numel * ITEM_BYTES[self.dtype] != len(self.data):
            raise ValueError(f"a {self.dtype} tensor of shape {self.shape} needs {numel * ITEM_BYTES[self.dtype]} "
                             f"bytes, got {len(self.data)}")


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _int(value: int) -> bytes:
    if -(1 << 31) <= value < (1 << 31):
        return b"J" + struct.pack("<i", value)  # BININT
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _ints(values: Sequence[int]) -> bytes:
    return b"(" + b"".join(_int(v) for v in values) + b"t"  # MARK ... TUPLE


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return list(reversed(strides))


def _pickle(tensors: dict[str, Tensor]) -> bytes:
    out = [b"\x80\x02", b"}", b"("]  # PROTO 2, EMPTY_DICT, MARK
    for key, (name, tensor) in enumerate(tensors.items()):
        numel = len(tensor.data) // ITEM_BYTES[tensor.dtype]
        out += [_text(name), b"ctorch._utils\n_rebuild_tensor_v2\n", b"(",
                b"(", _text("storage"), f"ctorch\n{STORAGE_TYPE[tensor.dtype]}\n".encode(), _text(str(key)),
                _text("cpu"), _int(numel), b"tQ",  # TUPLE, BINPERSID
                _int(0), _ints(tensor.shape), _ints(_strides(tensor.shape)), b"\x89",  # NEWFALSE: requires_grad
                b"ccollections\nOrderedDict\n)R",  # OrderedDict(): no backward hooks
                b"tR"]  # TUPLE, REDUCE
    out.append(b"u.")  # SETITEMS, STOP
    return b"".join(out)


def _write_aligned(archive: zipfile.ZipFile, name: str, data: bytes) -> None:
    """A stored record whose data starts on an ALIGN boundary (padding in the local header's extra field)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    assert archive.fp is not None
    start = archive.fp.tell() + 30 + len(name.encode())
    pad = (-(start + 4)) % ALIGN
    info.extra = struct.pack("<HH", 0x4246, pad) + b"\0" * pad  # id "FB", as torch's writer pads
    archive.writestr(info, data)


def write_ckpt(path: Path, tensors: dict[str, Tensor], archive_name: str = "archive") -> int:
    """Write `tensors` as torch.save would write a dict of them; returns the file's size."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        _write_aligned(archive, f"{archive_name}/data.pkl", _pickle(tensors))
        _write_aligned(archive, f"{archive_name}/byteorder", b"little")
        for key, tensor in enumerate(tensors.values()):
            _write_aligned(archive, f"{archive_name}/data/{key}", tensor.data)
        _write_aligned(archive, f"{archive_name}/version", b"3\n")
    return path.stat().st_size
