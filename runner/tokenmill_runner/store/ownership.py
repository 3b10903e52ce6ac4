"""One ownership rule for every artifact a writer puts in an output.

A run writes under one run token, which the output's lease lists (`lease.py`; a DatasetGeneration's shared record
lists every worker's). Every object it writes into a dataset's folders carries that token in its name, and every
record that makes work count is written through its lease's fence:

    shards/<w000-token-seq>.parquet, errors/<w000-token-seq>.jsonl   a shard's data and errors
    commits/<time>-<w000-token-seq>.json                                its commit marker (a record)
    hidden_states/<sample key>-<token>.safetensors                      a sample's states (and final_states/)
    hidden_commits/<sample key>-<token>.json                            their marker (a record; and final_commits/)
    hidden_errors/<sample key>-<token>.json                             a capture that failed (a record; final_errors/)
    index/<horizon>-<markers>-<token>-<nonce>.ckpt                      a checkpoint (the runner's, fenced too)

So no writer can replace another's object: a writer taken over while a PUT was in flight lands its own object beside
the taker's, never over it. A record is written by `put_record`: it proves the lease first (`Fence.proof`), and while
its PUT is in flight the lease keeper gives nothing up (`LeaseKeeper.close` waits for it). Readers count records only
through `markers.list_records`, which applies the seals (`seals.py`): a run that takes the output from a holder that
may still be alive seals every run token found in the lease and in the output's names except its own, and a sealed
token's record counts only when its seal names it. A checkpoint is a reader's fold of counted markers: one that folded
a marker its seal drops is refolded (`index_store.refresh`). What is not an artifact: `lease.json`, `run.json` (one
description, written under the fence by worker 0), the capture pass's progress heartbeats and the report (written
after the writer proved its lease once more, `LeaseKeeper.confirm`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from .faults import points as fault_points
from .lease_rules import CleanRule
from .storage import Storage, StorageError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fence:
    """What a writer's artifacts answer to: its run `token` (in every name it writes), `proof()` (entered around a
    record's write: raises LeaseLost unless the writer still holds the output's lease, and keeps the lease from being
    given up until the write ends), how long one record write retries (`attempt_s`), how long new proofs and writes
    go on for in all (`patience_s`, the store's retry budget), and which unmarked objects it may delete (`clean`)."""

    token: str
    proof: Callable[[], AbstractContextManager[None]]
    attempt_s: float
    patience_s: float
    clean: CleanRule | None = None

    def prove(self) -> None:
        with self.proof():
            pass

    @classmethod
    def unleased(cls, token: str, patience_s: float = 600.0) -> Fence:
        """A writer of an output nobody else writes (tools, tests): its names carry `token`, nothing is proven."""
        return cls(token, nullcontext, patience_s, patience_s)


def owned_stem(stem: str, token: str) -> str:
    """The name stem of an object `token`'s writer keeps per sample (its states, their marker, a failure record)."""
    return f"{stem}-{token}"


def put_record(storage: Storage, key: str, data: bytes, fence: Fence | None) -> None:
    """Write a record (a shard's commit marker, a sample's state marker or failure record), proving the lease first
    when fenced: no writer that lost the output's lease can make anything count."""
    if fence is None:
        storage.put(key, data)
        return
    started = time.monotonic()
    while True:
        with fence.proof():  # between the data write and this one, the lease may have been lost: LeaseLost
            # A writer stopped here (SIGSTOP, a PUT held in flight) lands this record after the proof expired: a
            # taker seals its run token first, so it counts for nobody (seals.py).
            fault_points().before("fenced", key)
            try:
                storage.put(key, data, budget_s=fence.attempt_s)
                return
            except StorageError:
                if time.monotonic() - started >= fence.patience_s:
                    raise
        logger.warning("record %s not written within %.0f s; proving the lease again before the next try",
                       storage.uri(key), fence.attempt_s)
