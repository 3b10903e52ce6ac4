"""A `.ckpt` file as `torch.save` writes it, without torch: what SpecForge's OfflineEagle3Dataset reads with
`torch.load(path, weights_only=False, mmap=True)` (SF data/preprocessing.py:530-538), and the `.pt` files of the
vocabulary export (a dict of ids to counts, a list of ids, a dict of tensors), which the trainers read with
`torch.load(..., weights_only=True)`: plain dicts, lists, ints, floats and tensors are all that loader allows, and
all this writes. Pure.

torch.save's format (torch/serialization.py, `_save`, since torch 1.6) is an uncompressed zip of `<archive>/data.pkl`
(a pickle, protocol 2, whose tensors are `torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
requires_grad, hooks)` with each storage a persistent id `("storage", torch.<Type>Storage, key, "cpu", numel)`),
`<archive>/data/<key>` (each storage's raw little-endian bytes), `<archive>/byteorder` and `<archive>/version`. Each
record's data starts on a 64-byte boundary, as torch aligns it, so torch can map it in place. The pickle is written
opcode by opcode because Python's pickler will not name a class it cannot import (torch is not a dependency here).
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

ALIGN = 64
# torch's legacy storage class names, per dtype (torch/storage.py `_pickle_storage_type`).
STORAGE_TYPE: dict[str, str] = {"bfloat16": "BFloat16Storage", "float16": "HalfStorage", "float32": "FloatStorage",
                                "int64": "LongStorage", "bool": "BoolStorage"}
ITEM_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8, "bool": 1}


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


def _float(value: float) -> bytes:
    return b"G" + struct.pack(">d", value)  # BINFLOAT


def _encode(value: Any, tensors: list[Tensor]) -> bytes:
    """The pickle opcodes of one value; each tensor met is appended to `tensors` (its storage key is its index)."""
    if isinstance(value, Tensor):
        key = len(tensors)
        tensors.append(value)
        numel = len(value.data) // ITEM_BYTES[value.dtype]
        return b"".join([
            b"ctorch._utils\n_rebuild_tensor_v2\n", b"(",
            b"(", _text("storage"), f"ctorch\n{STORAGE_TYPE[value.dtype]}\n".encode(), _text(str(key)), _text("cpu"),
            _int(numel), b"tQ",  # TUPLE, BINPERSID
            _int(0), _ints(value.shape), _ints(_strides(value.shape)), b"\x89",  # NEWFALSE: requires_grad
            b"ccollections\nOrderedDict\n)R",  # OrderedDict(): no backward hooks
            b"tR"])  # TUPLE, REDUCE
    if isinstance(value, bool):
        return b"\x88" if value else b"\x89"
    if isinstance(value, int):
        return _int(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, list):  # EMPTY_LIST, MARK, items, APPENDS
        return b"](" + b"".join(_encode(item, tensors) for item in value) + b"e"
    # EMPTY_DICT, MARK, key value pairs, SETITEMS
    return b"}(" + b"".join(_encode(k, tensors) + _encode(v, tensors) for k, v in value.items()) + b"u"


def _pickle(value: Any) -> tuple[bytes, list[Tensor]]:
    tensors: list[Tensor] = []
    return b"\x80\x02" + _encode(value, tensors) + b".", tensors  # PROTO 2 ... STOP


def _write_aligned(archive: zipfile.ZipFile, name: str, data: bytes) -> None:
    """A stored record whose data starts on an ALIGN boundary (padding in the local header's extra field)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    assert archive.fp is not None
    start = archive.fp.tell() + 30 + len(name.encode())
    pad = (-(start + 4)) % ALIGN
    info.extra = struct.pack("<HH", 0x4246, pad) + b"\0" * pad  # id "FB", as torch's writer pads
    archive.writestr(info, data)


def _archive(out: BinaryIO, value: Any, archive_name: str) -> None:
    pickled, tensors = _pickle(value)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        _write_aligned(archive, f"{archive_name}/data.pkl", pickled)
        _write_aligned(archive, f"{archive_name}/byteorder", b"little")
        for key, tensor in enumerate(tensors):
            _write_aligned(archive, f"{archive_name}/data/{key}", tensor.data)
        _write_aligned(archive, f"{archive_name}/version", b"3\n")


def write_ckpt(path: Path, tensors: dict[str, Tensor], archive_name: str = "archive") -> int:
    """Write `tensors` as torch.save would write a dict of them; returns the file's size."""
    with open(path, "wb") as out:
        _archive(out, dict(tensors), archive_name)
    return path.stat().st_size


def torch_bytes(value: Any, archive_name: str = "archive") -> bytes:
    """What torch.save writes for `value` (a small object: built in memory)."""
    out = io.BytesIO()
    _archive(out, value, archive_name)
    return out.getvalue()
