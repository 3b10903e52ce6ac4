"""Checkpoints: a dataset's index (`commit_index.py`) compacted into one immutable object. Pure: bytes in and out.

A reader that starts (a runner resuming, an operator restarted) reads the newest checkpoint it can verify and then
only the markers it does not cover, instead of every marker. Checkpoints are written under
`<dataset>/index/<horizon>-<markers>-<writer>-<token>.ckpt`: names sort by how much they cover, every writer's names
are its own (a random token), and an object never changes once written, so concurrent writers cannot corrupt each
other and a reader takes the newest that verifies (`packed.py`: a digest over header and payload). What a
checkpoint says is exactly which shards it folded (their hashes) and what folding them gave, so a reader folding
more markers over it counts nothing twice.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from .bounds import MAX_SLOTS
from .commit_index import Commit, DatasetIndex, parse_time
from .ledger import DatasetLedger, LedgerBudget
from .packed import PackError, pack, raw_size, unpack

KIND = "checkpoint"
VERSION = 1
INDEX = "index"
SUFFIX = ".ckpt"
NO_HORIZON = "00000000T000000.000000Z"  # an index that has listed nothing time-named yet sorts first
# The operator names its checkpoints so and keys their digest with its own secret (`Signer`): it trusts no other
# writer's, and no runner can verify its.
OPERATOR_WRITER = "operator"
# What a checkpoint may inflate to: its row bits (an eighth of a byte a slot), 8 bytes per folded shard, 9 per failure
# and per retry round. Past this a checkpoint is neither written nor read (readers fold the markers instead), so a
# forged one costs at most this much: 1 MiB of zeros said nothing and inflated to 1 GiB (security-f9665d2.md B6).
RAW_BYTES = 32 * 1024 * 1024
# Per slot of the reader's layout, the most a checkpoint of it holds (a bit, a shard hash, a failure and a round),
# plus room for outcomes of an earlier, larger layout: a small layout's reader inflates only a little.
RAW_PER_SLOT = 27
RAW_SLACK = 1024 * 1024
RECENT_KEPT = 4096  # the newest commits of the rates' ring a checkpoint keeps (the header's size stays bounded)


@dataclass(frozen=True)
class Signer:
    """Whose checkpoints a reader trusts: those of `writer` (None: any writer but the operator) whose digest verifies
    with `key` (b"": the unkeyed digest, a torn-object check only: whoever writes the prefix can write markers too,
    so a runner gains nothing from a key). The operator keys its own with a secret no tenant holds."""

    key: bytes = b""
    writer: str | None = None

    def trusts(self, name: str) -> bool:
        written_by = writer_of(name)
        return written_by == self.writer if self.writer is not None else written_by != OPERATOR_WRITER


RUNNER = Signer()


def writer_of(name: str) -> str | None:
    """The writer a checkpoint's file name names (`<horizon>-<markers>-<writer>-<token>.ckpt`)."""
    parts = name.rsplit("/", 1)[-1].split("-")
    return parts[2] if len(parts) == 4 else None


def max_raw(slots: int) -> int:
    """The most a reader whose layout has `slots` slots inflates a checkpoint to."""
    return min(RAW_BYTES, RAW_PER_SLOT * min(max(slots, 0), MAX_SLOTS) + RAW_SLACK)


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: the message names what is wrong."""


def checkpoint_name(index: DatasetIndex, writer: str) -> str:
    return f"{index.horizon or NO_HORIZON}-{index.markers:010d}-{writer}-{secrets.token_hex(4)}{SUFFIX}"


@dataclass(frozen=True)
class Snapshot:
    """An index as it was at one moment, its arrays copied: it can be packed and written from another thread while
    the index keeps folding (a view would let a fold land between the header and the arrays)."""

    name: str
    header: dict[str, Any]
    arrays: dict[str, np.ndarray]

    def encode(self, key: bytes = b"") -> bytes:
        return pack(KIND, self.header, self.arrays, key)

    @property
    def raw_bytes(self) -> int:
        return raw_size(self.arrays)


def snapshot(index: DatasetIndex, writer: str, now: datetime) -> Snapshot:
    ledger_header, arrays = index.ledger.state()
    header = {
        "version": VERSION, "dataset": index.name, "writer": writer, "written_at": now.isoformat(),
        "horizon": index.horizon, "newest": index.newest, "markers": index.markers,
        "last_commit": index.last_commit.isoformat() if index.last_commit else None,
        "recent": [[c.at.isoformat(), c.outcomes, c.tokens] for c in list(index.recent)[-RECENT_KEPT:]],
        "ledger": ledger_header,
    }
    copied = {name: array.copy() for name, array in arrays.items()}
    return Snapshot(checkpoint_name(index, writer), header, {**copied, "known": index.known_hashes().copy()})


def encode(index: DatasetIndex, writer: str, now: datetime, key: bytes = b"") -> bytes:
    return snapshot(index, writer, now).encode(key)


def decode(data: bytes, dataset: str, samples_per_prompt: int = 1, *, slots: int = MAX_SLOTS, key: bytes = b"",
           budget: LedgerBudget | None = None) -> DatasetIndex:
    """The index a checkpoint holds; CheckpointError when it does not verify (with `key`), is another dataset's, or
    inflates past what a reader of `slots` slots takes (`max_raw`)."""
    try:
        header, arrays = unpack(KIND, data, max_raw(slots), key)
    except PackError as error:
        raise CheckpointError(str(error)) from None
    if header.get("version") != VERSION:
        raise CheckpointError(f"checkpoint version {header.get('version')!r}, this tokenmill reads {VERSION}")
    if header.get("dataset") != dataset:
        raise CheckpointError(f"checkpoint of dataset {header.get('dataset')!r}, not {dataset!r}")
    try:
        return _restore(header, arrays, samples_per_prompt, budget)
    except (KeyError, TypeError, ValueError) as error:  # OverBound too: a ledger past the reader's budget
        raise CheckpointError(f"checkpoint is inconsistent: {type(error).__name__}: {error}") from None


def _restore(header: dict[str, Any], arrays: dict[str, np.ndarray], samples_per_prompt: int,
             budget: LedgerBudget | None) -> DatasetIndex:
    ledger = DatasetLedger.from_state(header["ledger"], arrays, budget)
    ledger.widen(samples_per_prompt)  # samples raised since the checkpoint; a lowered n keeps the wider layout
    known = arrays.get("known")
    if known is None or known.dtype != np.uint64 or (known.size > 1 and bool((known[1:] <= known[:-1]).any())):
        raise ValueError("checkpoint shard hashes are not a sorted set")
    if int(header["markers"]) != known.size:
        raise ValueError(f"checkpoint counts {header['markers']} markers but holds {known.size} shard hashes")
    return DatasetIndex.restore(
        ledger, known, str(header["horizon"]), str(header["newest"]),
        parse_time(header["last_commit"]) if header.get("last_commit") else None,
        [Commit(parse_time(at), int(outcomes), int(tokens)) for at, outcomes, tokens in header["recent"]])
