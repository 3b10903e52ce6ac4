"""Each committed sample's hidden states in a companion file, committed under the shards' marker protocol.

    <dataset>/hidden_states/<key>-<token>.safetensors   token_ids [n] int64, hidden_states [n, layers, hidden] (served
                                                        dtype; with spec.hiddenStates.storage fp8: float8_e4m3fn, and
                                                        beside it hidden_states_scales [n, 1, 1] float32,
                                                        hs-connectors' layout, fp8.py)
    <dataset>/hidden_commits/<key>-<token>.json         the marker: file, bytes, sha256, tokens, shape; written last
    <dataset>/hidden_errors/<key>-<token>.json          a capture that failed (retried with --retry-failed)

and the same three folders as final_states/, final_commits/, final_errors/ for the target's final (post-norm)
state, [n, 1, hidden], which SpecForge's offline layout needs beside the aux layers and which a server serves only
when started without aux capture (facts/hidden_states.py): a second pass, its own kind (FINAL) of the same files.

The file is written whole to a local spool and moved in by the storage's atomic put, then the marker: a marker never
names a missing or partial file, and a kill before the marker leaves a file nothing counts (the next pass captures
the sample again and removes the leftover, clean_state_leftovers). Every name carries the writer's run token besides
the sample's key (a digest of sample id and sample index), and the marker and the failure record are written through
the lease's fence (store/ownership.py): a writer taken over with a capture in flight lands its own objects beside the
taker's, never over them, and once sealed they count for nobody; a writer that can no longer prove it holds the lease
gets LeaseLost instead of writing them. Readers count a sample's records only through markers.list_records (the seals
applied), one per sample key: a resume and a second writer find what is committed by the key. Names without a token
(written before they carried one) are still read. One sample's states are written at a time, row block by row block,
so memory stays at one sample's size. The safetensors layout (an 8-byte little-endian header length, a JSON header,
the raw tensors) is written directly because the states are bf16 or fp8, which numpy cannot name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..facts.hidden_states import FP8_DTYPE, SAFETENSORS_DTYPE, StateShape
from .bounded_get import get_bounded
from .bounds import OverBound
from .faults import points as fault_points
from .fp8 import SCALES, dequantize, quantize
from .marker_names import shard_id_of, token_of
from .markers import Listed, list_records
from .ownership import Fence, owned_stem, put_record
from .storage import Storage, StorageError

logger = logging.getLogger(__name__)

STATES = "hidden_states"
STATE_COMMITS = "hidden_commits"
STATE_ERRORS = "hidden_errors"
MARKER_VERSION = 1
# A state marker is a few hundred bytes (names, a digest, the shape); a reader takes no more than this of one.
STATE_MARKER_BYTES = 64 * 1024
_MARKER_FIELDS = frozenset({"sample_id", "sample_index", "file", "bytes", "sha256", "tokens", "dtype"})


@dataclass(frozen=True)
class StateKind:
    """Which states: the aux layers or the final one. Each has its own folders and fault steps."""

    name: str
    states: str
    commits: str
    errors: str
    file_step: str  # store/faults.py steps
    marker_step: str


AUX = StateKind("aux", STATES, STATE_COMMITS, STATE_ERRORS, "states", "states-marker")
FINAL = StateKind("final", "final_states", "final_commits", "final_errors", "final-states", "final-marker")
KINDS = {kind.name: kind for kind in (AUX, FINAL)}
# Rows converted and written per block: bounds the working copy to this many rows besides the parsed answer.
_BLOCK_ROWS = 256


def sample_key(sample_id: str, sample_index: int) -> str:
    return hashlib.sha256(f"{sample_id}\0{sample_index}".encode()).hexdigest()[:40]


def state_file_key(dataset: str, stem: str, kind: StateKind = AUX) -> str:
    """A state file's key; `stem` is `owned_stem(sample key, token)` (a bare sample key: a name without a token)."""
    return f"{dataset}/{kind.states}/{stem}.safetensors"


def marker_key(dataset: str, stem: str, kind: StateKind = AUX) -> str:
    return f"{dataset}/{kind.commits}/{stem}.json"


def error_key(dataset: str, stem: str, kind: StateKind = AUX) -> str:
    return f"{dataset}/{kind.errors}/{stem}.json"


def key_of(stem: str) -> str:
    """The sample key of a state object's name stem (`<key>-<token>`, or a bare key)."""
    return stem.split("-", 1)[0]


def to_dtype_bytes(values: np.ndarray, dtype: str) -> bytes:
    """float64 values (exact copies of the served dtype's) as that dtype's little-endian bytes; bf16 by rounding the
    float32 to nearest even, which is exact for values that came from bf16."""
    if dtype == "float32":
        return values.astype("<f4").tobytes()
    if dtype == "float16":
        return values.astype("<f2").tobytes()
    bits = values.astype("<f4").view("<u4")
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def from_dtype_bytes(data: bytes, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return np.frombuffer(data, "<f4").astype(np.float64)
    if dtype == "float16":
        return np.frombuffer(data, "<f2").astype(np.float64)
    return (np.frombuffer(data, "<u2").astype("<u4") << 16).view("<f4").astype(np.float64)


def _header(tokens: int, shape: StateShape, metadata: dict[str, str]) -> bytes:
    ids_bytes = 8 * tokens
    values_end = ids_bytes + shape.value_bytes(tokens)
    header: dict[str, Any] = {
        "token_ids": {"dtype": "I64", "shape": [tokens], "data_offsets": [0, ids_bytes]},
        "hidden_states": {"dtype": SAFETENSORS_DTYPE[shape.stored_dtype],
                          "shape": [tokens, shape.layers, shape.hidden], "data_offsets": [ids_bytes, values_end]},
    }
    if shape.storage == "fp8":
        header[SCALES] = {"dtype": "F32", "shape": [tokens, 1, 1], "data_offsets": [values_end, values_end + 4 * tokens]}
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the spec's alignment of the data that follows
    return struct.pack("<Q", len(text)) + text


@dataclass(frozen=True)
class CommittedStates:
    dataset: str
    key: str
    sample_id: str
    sample_index: int
    tokens: int
    bytes: int


def commit_states(storage: Storage, dataset: str, sample_id: str, sample_index: int, token_ids: list[int],
                  values: np.ndarray, shape: StateShape, fence: Fence, spool: Path | None = None,
                  kind: StateKind = AUX) -> CommittedStates:
    """Write one sample's file, then its marker, both named by the fence's token (fenced: LeaseLost leaves the
    file an unmarked leftover). `values` holds token_ids' states, [tokens * layers * hidden] float64 in row order."""
    tokens = len(token_ids)
    if values.size != tokens * shape.row_values:
        raise ValueError(f"sample {sample_id!r}: {values.size} state values for {tokens} tokens x "
                         f"{shape.row_values}; refusing to store a misaligned file")
    key = sample_key(sample_id, sample_index)
    stem = owned_stem(key, fence.token)
    faults = fault_points()
    digest = hashlib.sha256()
    fd, name = tempfile.mkstemp(prefix="states-", suffix=".safetensors", dir=spool)
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in (_header(tokens, shape, {"sample_id": sample_id, "sample_index": str(sample_index)}),
                          np.asarray(token_ids, dtype="<i8").tobytes()):
                out.write(chunk)
                digest.update(chunk)
            step = _BLOCK_ROWS * shape.row_values
            scales = []
            for start in range(0, values.size, step):
                if shape.storage == "fp8":
                    codes, block_scales = quantize(values[start:start + step].reshape(-1, shape.row_values))
                    chunk = codes.tobytes()
                    scales.append(block_scales.astype("<f4").tobytes())
                else:
                    chunk = to_dtype_bytes(values[start:start + step], shape.dtype)
                out.write(chunk)
                digest.update(chunk)
            for chunk in scales:  # fp8: the scales' tensor follows the values'
                out.write(chunk)
                digest.update(chunk)
            size = out.tell()
        file_key = state_file_key(dataset, stem, kind)
        faults.before(kind.file_step, file_key)
        storage.put_file(file_key, path)
        faults.after(kind.file_step, file_key)
    finally:
        path.unlink(missing_ok=True)
    marker = {"version": MARKER_VERSION, "dataset": dataset, "sample_id": sample_id, "sample_index": sample_index,
              "file": f"{kind.states}/{stem}.safetensors", "bytes": size, "sha256": digest.hexdigest(), "tokens": tokens,
              "layers": shape.layers, "hidden": shape.hidden, "dtype": shape.stored_dtype, "served_dtype": shape.dtype}
    faults.before(kind.marker_step, marker_key(dataset, stem, kind))
    put_record(storage, marker_key(dataset, stem, kind), orjson.dumps(marker), fence)
    faults.after(kind.marker_step, marker_key(dataset, stem, kind))
    return CommittedStates(dataset, key, sample_id, sample_index, tokens, size)


def record_failure(storage: Storage, dataset: str, sample_id: str, sample_index: int, reason: str,
                   fence: Fence, kind: StateKind = AUX) -> None:
    # Fenced like a marker: a resume skips a recorded failure, so a writer without the lease must not add one.
    record = {"dataset": dataset, "sample_id": sample_id, "sample_index": sample_index, "error": reason}
    stem = owned_stem(sample_key(sample_id, sample_index), fence.token)
    put_record(storage, error_key(dataset, stem, kind), orjson.dumps(record), fence)


def clear_failure(storage: Storage, dataset: str, key: str, fence: Fence, kind: StateKind = AUX) -> None:
    """Remove the sample's failure records (every writer's), proving the lease first: it is captured now."""
    for name in list(storage.list(f"{dataset}/{kind.errors}/{key}")):
        with fence.proof():
            storage.delete(name)


def _counted(storage: Storage, dataset: str, folder: str) -> Iterator[Listed]:
    # Not the temporary files of an interrupted write (list_records calls them strays): the local store writes a
    # marker as `<key>.json.tmp-XXXX` beside it, then renames it (storage.write_atomic). The markers are written by
    # parallel threads, so a kill at one commit can leave another's whole marker under its temporary name: counted,
    # the resume wrote that sample's marker again and readers saw two markers of one sample (or, if cut short, one
    # that does not parse).
    return (entry for entry in list_records(storage, dataset, folder) if entry.is_marker)


def _keys_in(storage: Storage, dataset: str, folder: str) -> set[str]:
    return {key_of(entry.stem or "") for entry in _counted(storage, dataset, folder)}


def captured_keys(storage: Storage, dataset: str, kind: StateKind = AUX) -> set[str]:
    """Samples with a counted marker (a file without one is a leftover; a sealed-away writer's counts for nobody)."""
    return _keys_in(storage, dataset, kind.commits)


def failed_keys(storage: Storage, dataset: str, kind: StateKind = AUX) -> set[str]:
    return _keys_in(storage, dataset, kind.errors)


def clean_state_leftovers(storage: Storage, dataset: str, kind: StateKind, fence: Fence) -> int:
    """Delete state files no counted marker names (a writer killed or taken over between its file and its marker)
    that the fence's clean rule allows: a younger one of another live writer may still get its marker. Returns how
    many were deleted."""
    if fence.clean is None:
        return 0
    marked = {entry.stem for entry in _counted(storage, dataset, kind.commits)}
    removed = 0
    for key in storage.list(f"{dataset}/{kind.states}/"):
        stem = shard_id_of(key)
        if stem in marked or token_of(stem) == fence.token:
            continue
        if not fence.clean.may_delete(stem, storage.modified(key)):
            continue
        with fence.proof():
            storage.delete(key)
        removed += 1
    if removed:
        logger.info("%s: removed %d %s state files no counted marker names", dataset, removed, kind.name)
    return removed


def state_markers(storage: Storage, dataset: str, kind: StateKind = AUX) -> Iterator[dict[str, Any]]:
    """Every counted state marker of `dataset`, one per sample (two writers may each have committed one: either
    names its own file, checked against its own digest), each read bounded (the operator's report reads them: a
    tenant's runner wrote them) and refused by name when it is not one."""
    seen: set[str] = set()
    for entry in _counted(storage, dataset, kind.commits):
        key = key_of(entry.stem or "")
        if key in seen:
            continue
        seen.add(key)
        name = entry.key
        try:
            marker = orjson.loads(get_bounded(storage, name, STATE_MARKER_BYTES))
        except orjson.JSONDecodeError as error:
            raise StorageError(f"{storage.uri(name)}: not a state marker ({error}); tokenmill writes it whole after "
                               "its file, so it was changed since: delete it and run again to capture that sample") from error
        if not isinstance(marker, dict) or not _MARKER_FIELDS <= marker.keys():
            raise StorageError(f"{storage.uri(name)}: a state marker without {sorted(_MARKER_FIELDS)}; delete it and "
                               "run again to capture that sample")
        yield marker


def committed_samples(storage: Storage, dataset: str, worker: int | None = None
                      ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(sample key, row) of every committed row, once each, in commit order, one shard decoded at a time (those
    `worker` committed, when given: the workers split the states as they split the samples)."""
    from .markers import markers_in_commit_order
    from .shards import read_shard

    seen: set[str] = set()
    for marker in markers_in_commit_order(storage, dataset):
        if not marker.get("data") or (worker is not None and marker.get("worker") != worker):
            continue
        for row in read_shard(storage, f"{dataset}/{marker['data']}"):
            key = sample_key(row["sample_id"], row.get("sample_index", 0))
            if key not in seen:
                seen.add(key)
                yield key, row


def read_state_file(storage: Storage, dataset: str, marker: dict[str, Any]) -> bytes:
    """The whole safetensors file of one committed sample, checked against its marker."""
    # The marker says how large the file is: never read more (a replaced file could be any size).
    data = get_bounded(storage, f"{dataset}/{marker['file']}", int(marker["bytes"]))
    if len(data) != marker["bytes"] or hashlib.sha256(data).hexdigest() != marker["sha256"]:
        raise StorageError(f"{dataset}/{marker['file']}: {len(data)} bytes whose digest differs from its marker's "
                           f"({marker['bytes']} bytes); the file was changed after it was committed")
    return data


def _tensors(data: bytes) -> tuple[dict[str, Any], int]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), 8 + length


def _tensor_bytes(data: bytes, header: dict[str, Any], base: int, name: str) -> bytes:
    start, end = header[name]["data_offsets"]
    return data[base + start:base + end]


def parse_state_file(data: bytes) -> tuple[np.ndarray, bytes, tuple[int, ...]]:
    """token_ids [n], the states' raw bytes in the stored dtype and their shape [n, layers, hidden] of a file
    commit_states wrote."""
    header, base = _tensors(data)
    token_ids = np.frombuffer(_tensor_bytes(data, header, base, "token_ids"), "<i8")
    return token_ids, _tensor_bytes(data, header, base, "hidden_states"), tuple(header["hidden_states"]["shape"])


def read_state_bytes(storage: Storage, dataset: str, marker: dict[str, Any]
                     ) -> tuple[np.ndarray, bytes, tuple[int, ...]]:
    """token_ids [n], the states' raw bytes in the served dtype and their shape [n, layers, hidden], of one
    committed sample, checked against its marker."""
    return parse_state_file(read_state_file(storage, dataset, marker))


def read_states(storage: Storage, dataset: str, marker: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """token_ids [n] and states [n, layers, hidden] (float64) of one committed sample, checked against its marker;
    fp8 states as hs-connectors' FP8Transfer hands them to the trainer (bf16 values, fp8.dequantize)."""
    data = read_state_file(storage, dataset, marker)
    token_ids, raw, shape = parse_state_file(data)
    if marker["dtype"] == FP8_DTYPE:
        header, base = _tensors(data)
        scales = np.frombuffer(_tensor_bytes(data, header, base, SCALES), "<f4")
        return token_ids, dequantize(np.frombuffer(raw, np.uint8).reshape(shape), scales)
    return token_ids, from_dtype_bytes(raw, marker["dtype"]).reshape(shape)


# Committed samples the hidden-state report and the capture pass's room check hold at once, 16 bytes each (a key's
# 64-bit head and a length): a sample's states are megabytes, so 4 million of them is petabytes of states. A dataset
# whose markers name more (780,000 ids in each of four markers took the operator's report to 1.46 GB:
# security-f9665d2.md B5) is refused by name.
MAX_STATE_SAMPLES = 1 << 22


def state_key(key: str) -> int:
    """The 64-bit head of a `sample_key`: how the report matches committed samples and their states."""
    return int(key[:16], 16)


def expected_lengths(storage: Storage, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """Every committed sample of `dataset` (sorted `state_key`s of its sample keys) and its sequence length (prompt
    + output tokens; -1 for a conversation, whose states cover its last turn), from the shard markers, the last
    marker naming a sample winning. OverBound past MAX_STATE_SAMPLES samples, before more are held."""
    from .markers import markers_in_commit_order

    keys: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    held = 0
    for marker in markers_in_commit_order(storage, dataset):
        samples = marker["samples"]
        ids = samples["sample_id"]
        held += len(ids)
        if held > MAX_STATE_SAMPLES:
            raise OverBound(f"{dataset}: the commit markers name over {MAX_STATE_SAMPLES} samples, more than a "
                            "hidden-state report holds (each sample's states are megabytes): split the run, or the "
                            "markers were not written by tokenmill")
        turns = samples.get("turn_count") or [None] * len(ids)
        keys.append(np.fromiter((state_key(sample_key(sid, index)) for sid, index in
                                 zip(ids, samples["sample_index"], strict=True)), dtype=np.uint64, count=len(ids)))
        lengths.append(np.fromiter((-1 if turn is not None else prompt + completion for prompt, completion, turn in
                                    zip(samples["prompt_tokens"], samples["completion_tokens"], turns, strict=True)),
                                   dtype=np.int64, count=len(ids)))
    every = np.concatenate(keys[::-1]) if keys else np.empty(0, np.uint64)  # the last marker's first
    unique, first = np.unique(every, return_index=True)
    return unique, (np.concatenate(lengths[::-1])[first] if keys else np.empty(0, np.int64))


def state_records(storage: Storage, dataset: str, kind: StateKind = AUX
                  ) -> Iterator[tuple[str, int, int, int, str]]:
    """(label, state_key, tokens, bytes, stored dtype) of each committed state marker, streamed."""
    for marker in state_markers(storage, dataset, kind):
        label = f"{marker['sample_id']} (index {marker['sample_index']})"
        yield label, state_key(sample_key(str(marker["sample_id"]), int(marker["sample_index"]))), \
            int(marker["tokens"]), int(marker["bytes"]), str(marker["dtype"])
