"""Each committed sample's hidden states in a companion file, committed under the shards' marker protocol.

    <dataset>/hidden_states/<key>.safetensors   token_ids [n] int64, hidden_states [n, layers, hidden] (served dtype)
    <dataset>/hidden_commits/<key>.json         the marker: file, bytes, sha256, tokens, shape; written last
    <dataset>/hidden_errors/<key>.json          a capture that failed (retried with --retry-failed)

and the same three folders as final_states/, final_commits/, final_errors/ for the target's final (post-norm)
state, [n, 1, hidden], which SpecForge's offline layout needs beside the aux layers and which a server serves only
when started without aux capture (facts/hidden_states.py): a second pass, its own kind (FINAL) of the same files.

The file is written whole to a local spool and moved in by the storage's atomic put, then the marker: a marker never
names a missing or partial file, and a kill before the marker leaves a file nothing counts (the next pass rewrites
it). The marker and the failure record are written through the shards' fence (shards.put_marker): a writer that can
no longer prove it holds the output's lease gets LeaseLost instead of writing them, as for a shard's marker. The key is a digest of (sample id, sample index), so a resume and a second writer address the same objects and a
sample is captured once. One sample's states are written at a time, row block by row block, so memory stays at one
sample's size. The safetensors layout (an 8-byte little-endian header length, a JSON header, the raw tensors) is
written directly because the states are bf16, which numpy cannot name.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..facts.hidden_states import SAFETENSORS_DTYPE, StateShape
from .bounded_get import get_bounded
from .completion import StateCoverage, coverage
from .faults import points as fault_points
from .shards import Fence, put_marker
from .storage import TMP_MARK, Storage, StorageError
from .work_split import WHOLE, WorkShare

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


def state_file_key(dataset: str, key: str, kind: StateKind = AUX) -> str:
    return f"{dataset}/{kind.states}/{key}.safetensors"


def marker_key(dataset: str, key: str, kind: StateKind = AUX) -> str:
    return f"{dataset}/{kind.commits}/{key}.json"


def error_key(dataset: str, key: str, kind: StateKind = AUX) -> str:
    return f"{dataset}/{kind.errors}/{key}.json"


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
    header = {
        "token_ids": {"dtype": "I64", "shape": [tokens], "data_offsets": [0, ids_bytes]},
        "hidden_states": {"dtype": SAFETENSORS_DTYPE[shape.dtype], "shape": [tokens, shape.layers, shape.hidden],
                          "data_offsets": [ids_bytes, ids_bytes + shape.state_bytes(tokens)]},
        "__metadata__": metadata,
    }
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
                  values: np.ndarray, shape: StateShape, spool: Path | None = None,
                  fence: Fence | None = None, kind: StateKind = AUX) -> CommittedStates:
    """Write one sample's file, then its marker (fenced: LeaseLost leaves the file an unmarked leftover).
    `values` holds token_ids' states, [tokens * layers * hidden] float64 in row order."""
    tokens = len(token_ids)
    if values.size != tokens * shape.row_values:
        raise ValueError(f"sample {sample_id!r}: {values.size} state values for {tokens} tokens x "
                         f"{shape.row_values}; refusing to store a misaligned file")
    key = sample_key(sample_id, sample_index)
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
            for start in range(0, values.size, step):
                chunk = to_dtype_bytes(values[start:start + step], shape.dtype)
                out.write(chunk)
                digest.update(chunk)
            size = out.tell()
        file_key = state_file_key(dataset, key, kind)
        faults.before(kind.file_step, file_key)
        storage.put_file(file_key, path)
        faults.after(kind.file_step, file_key)
    finally:
        path.unlink(missing_ok=True)
    marker = {"version": MARKER_VERSION, "dataset": dataset, "sample_id": sample_id, "sample_index": sample_index,
              "file": f"{kind.states}/{key}.safetensors", "bytes": size, "sha256": digest.hexdigest(), "tokens": tokens,
              "layers": shape.layers, "hidden": shape.hidden, "dtype": shape.dtype}
    faults.before(kind.marker_step, marker_key(dataset, key, kind))
    put_marker(storage, marker_key(dataset, key, kind), orjson.dumps(marker), fence)
    faults.after(kind.marker_step, marker_key(dataset, key, kind))
    return CommittedStates(dataset, key, sample_id, sample_index, tokens, size)


def record_failure(storage: Storage, dataset: str, sample_id: str, sample_index: int, reason: str,
                   fence: Fence | None = None, kind: StateKind = AUX) -> None:
    # Fenced like a marker: a resume skips a recorded failure, so a writer without the lease must not add one.
    record = {"dataset": dataset, "sample_id": sample_id, "sample_index": sample_index, "error": reason}
    put_marker(storage, error_key(dataset, sample_key(sample_id, sample_index), kind), orjson.dumps(record), fence)


def clear_failure(storage: Storage, dataset: str, key: str, fence: Fence | None = None,
                  kind: StateKind = AUX) -> None:
    if storage.exists(error_key(dataset, key, kind)):
        if fence is not None:
            fence.prove()
        storage.delete(error_key(dataset, key, kind))


def _records_under(storage: Storage, prefix: str) -> Iterator[str]:
    # Not the temporary files of an interrupted write: the local store writes a marker as `<key>.json.tmp-XXXX`
    # beside it, then renames it (storage.write_atomic). The markers are written by parallel threads, so a kill at
    # one commit can leave another's whole marker under its temporary name: counted, the resume wrote that sample's
    # marker again and readers saw two markers of one sample (or, if cut short, one that does not parse).
    return (name for name in storage.list(prefix) if TMP_MARK not in name.rsplit("/", 1)[-1])


def _keys_under(storage: Storage, prefix: str) -> set[str]:
    return {name.rsplit("/", 1)[-1].removesuffix(".json") for name in _records_under(storage, prefix)}


def captured_keys(storage: Storage, dataset: str, kind: StateKind = AUX) -> set[str]:
    """Samples whose marker is committed (a file without a marker is a leftover and not counted)."""
    return _keys_under(storage, f"{dataset}/{kind.commits}/")


def failed_keys(storage: Storage, dataset: str, kind: StateKind = AUX) -> set[str]:
    return _keys_under(storage, f"{dataset}/{kind.errors}/")


def state_markers(storage: Storage, dataset: str, kind: StateKind = AUX) -> Iterator[dict[str, Any]]:
    """Every committed state marker of `dataset`, each read bounded (the operator's report reads them: a tenant's
    runner wrote them) and refused by name when it is not one."""
    for name in _records_under(storage, f"{dataset}/{kind.commits}/"):
        try:
            marker = orjson.loads(get_bounded(storage, name, STATE_MARKER_BYTES))
        except orjson.JSONDecodeError as error:
            raise StorageError(f"{storage.uri(name)}: not a state marker ({error}); tokenmill writes it whole after "
                               "its file, so it was changed since: delete it and run again to capture that sample") from error
        if not isinstance(marker, dict) or not _MARKER_FIELDS <= marker.keys():
            raise StorageError(f"{storage.uri(name)}: a state marker without {sorted(_MARKER_FIELDS)}; delete it and "
                               "run again to capture that sample")
        yield marker


def committed_samples(storage: Storage, dataset: str, share: WorkShare = WHOLE
                      ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(sample key, row) of every committed row `share` owns (work_split.py: by the current worker count, whoever
    committed it), once each, in commit order, one shard decoded at a time; a shard none of whose samples the share
    owns (the marker lists them) is not read."""
    from .markers import markers_in_commit_order
    from .shards import decode_rows

    seen: set[str] = set()
    for marker in markers_in_commit_order(storage, dataset):
        samples = marker.get("samples") or {}
        if not marker.get("data") or not any(
                share.owns(sid, line) for sid, line in zip(samples.get("sample_id") or [], samples.get("line") or [],
                                                           strict=False)):
            continue
        for row in decode_rows(storage.get(f"{dataset}/{marker['data']}")):
            key = sample_key(row["sample_id"], row.get("sample_index", 0))
            if key not in seen and share.owns(row["sample_id"], row.get("line", 0)):
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


def parse_state_file(data: bytes) -> tuple[np.ndarray, bytes, tuple[int, ...]]:
    """token_ids [n], the states' raw bytes in the served dtype and their shape [n, layers, hidden] of a file
    commit_states wrote."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    base = 8 + length
    ids_start, ids_end = header["token_ids"]["data_offsets"]
    hs_start, hs_end = header["hidden_states"]["data_offsets"]
    token_ids = np.frombuffer(data[base + ids_start:base + ids_end], "<i8")
    return token_ids, data[base + hs_start:base + hs_end], tuple(header["hidden_states"]["shape"])


def read_state_bytes(storage: Storage, dataset: str, marker: dict[str, Any]
                     ) -> tuple[np.ndarray, bytes, tuple[int, ...]]:
    """token_ids [n], the states' raw bytes in the served dtype and their shape [n, layers, hidden], of one
    committed sample, checked against its marker."""
    return parse_state_file(read_state_file(storage, dataset, marker))


def read_states(storage: Storage, dataset: str, marker: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """token_ids [n] and states [n, layers, hidden] (float64) of one committed sample, checked against its marker."""
    token_ids, raw, shape = read_state_bytes(storage, dataset, marker)
    return token_ids, from_dtype_bytes(raw, marker["dtype"]).reshape(shape)


SampleRef = tuple[str, int]  # (sample id, sample index)


def committed_refs(storage: Storage, dataset: str, share: WorkShare = WHOLE) -> dict[SampleRef, int | None]:
    """Every committed sample `share` owns (work_split.py) with its sequence length, from the shard markers (None
    for a conversation, whose states cover its last turn)."""
    from .markers import markers_in_commit_order

    expected: dict[SampleRef, int | None] = {}
    for marker in markers_in_commit_order(storage, dataset):
        samples = marker["samples"]
        turns = samples.get("turn_count") or [None] * len(samples["sample_id"])
        lines = samples.get("line") or [0] * len(samples["sample_id"])
        for sid, index, line, prompt, completion, turn_count in zip(
                samples["sample_id"], samples["sample_index"], lines, samples["prompt_tokens"],
                samples["completion_tokens"], turns, strict=True):
            if share.owns(sid, line):
                expected[(sid, index)] = None if turn_count is not None else prompt + completion
    return expected


def state_coverage(storage: Storage, dataset: str, kind: StateKind = AUX, share: WorkShare = WHOLE,
                   read_markers: bool = False) -> tuple[StateCoverage, int]:
    """One kind's states over the committed samples of `dataset` that `share` owns (store/completion.py), and the
    bytes of their files. `read_markers` reads every state marker (its token count: alignment, and its bytes); else
    the markers are only listed (the runner's and the operator's check: a capture was aligned when committed)."""
    expected = committed_refs(storage, dataset, share)
    by_key = {sample_key(*ref): ref for ref in expected}
    size = 0
    states: list[tuple[Hashable, int | None]] = []
    if read_markers:
        for marker in state_markers(storage, dataset, kind):
            ref = (marker["sample_id"], marker["sample_index"])
            states.append((ref, marker["tokens"]))
            size += marker["bytes"] if ref in expected else 0
    else:
        states = [(by_key.get(key, key), None) for key in captured_keys(storage, dataset, kind)]
    failed = {by_key.get(key, key) for key in failed_keys(storage, dataset, kind)}
    found = coverage(kind.name, dict(expected), states, failed, _describe)
    return found, size


def _describe(sample: Hashable) -> str:
    if isinstance(sample, tuple) and len(sample) == 2:
        return f"{sample[0]} (index {sample[1]})"
    return str(sample)
