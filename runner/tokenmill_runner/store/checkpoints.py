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

from .commit_index import Commit, DatasetIndex, parse_time
from .ledger import DatasetLedger
from .packed import PackError, pack, unpack

KIND = "checkpoint"
VERSION = 1
INDEX = "index"
SUFFIX = ".ckpt"
NO_HORIZON = "00000000T000000.000000Z"  # an index that has listed nothing time-named yet sorts first


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

    def encode(self) -> bytes:
        return pack(KIND, self.header, self.arrays)


def snapshot(index: DatasetIndex, writer: str, now: datetime) -> Snapshot:
    ledger_header, arrays = index.ledger.state()
    header = {
        "version": VERSION, "dataset": index.name, "writer": writer, "written_at": now.isoformat(),
        "horizon": index.horizon, "newest": index.newest, "markers": index.markers,
        "last_commit": index.last_commit.isoformat() if index.last_commit else None,
        "recent": [[c.at.isoformat(), c.outcomes, c.tokens] for c in index.recent],
        "ledger": ledger_header,
    }
    copied = {name: array.copy() for name, array in arrays.items()}
    return Snapshot(checkpoint_name(index, writer), header, {**copied, "known": index.known_hashes().copy()})


def encode(index: DatasetIndex, writer: str, now: datetime) -> bytes:
    return snapshot(index, writer, now).encode()


def decode(data: bytes, dataset: str, samples_per_prompt: int = 1) -> DatasetIndex:
    """The index a checkpoint holds; CheckpointError when it does not verify or is another dataset's."""
    try:
        header, arrays = unpack(KIND, data)
    except PackError as error:
        raise CheckpointError(str(error)) from None
    if header.get("version") != VERSION:
        raise CheckpointError(f"checkpoint version {header.get('version')!r}, this tokenmill reads {VERSION}")
    if header.get("dataset") != dataset:
        raise CheckpointError(f"checkpoint of dataset {header.get('dataset')!r}, not {dataset!r}")
    ledger_header = header["ledger"]
    try:
        ledger = DatasetLedger.from_state(ledger_header, arrays)
        ledger.widen(samples_per_prompt)  # samples raised since the checkpoint; a lowered n keeps the wider layout
    except (KeyError, ValueError) as error:
        raise CheckpointError(f"checkpoint ledger is inconsistent: {error}") from None
    known = arrays.get("known")
    if known is None or known.dtype != np.uint64 or (known.size > 1 and bool((known[1:] <= known[:-1]).any())):
        raise CheckpointError("checkpoint shard hashes are not a sorted set")
    if int(header["markers"]) != known.size:
        raise CheckpointError(f"checkpoint counts {header['markers']} markers but holds {known.size} shard hashes")
    return DatasetIndex.restore(
        ledger, known, str(header["horizon"]), str(header["newest"]),
        parse_time(header["last_commit"]) if header.get("last_commit") else None,
        [Commit(parse_time(at), int(outcomes), int(tokens)) for at, outcomes, tokens in header["recent"]])
