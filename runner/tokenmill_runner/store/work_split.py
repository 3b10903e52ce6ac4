"""Which worker owns a slot: the one split of the work that every pass uses. Pure.

A run's workers (the runner Job's indexes) divide the slots of the current layout among themselves by the sample id:
worker `index` of `count` owns every slot whose id hashes to `index` modulo `count`, so the samples of one prompt and
the copies of a repeated id meet in one worker. The generation stream (the source's lines), the aux capture pass and
the final capture pass (the committed rows) all ask `WorkShare.owns`, with the *current* count: a Job of another
parallelism, a worker killed for good and its index retried, or a row committed by a worker that no longer exists
all leave every slot with exactly one owner among the workers that run now. Nothing reads the worker a shard's marker
names to decide who works on its rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def id_hash(sample_id: str) -> int:
    """A stable 64-bit key: the same in every process (unlike hash()); see source/duplicates.py for collisions."""
    return int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class WorkShare:
    """One worker's share: worker `index` of `count`."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"worker index {self.index} must be in 0..{self.count - 1}")

    @property
    def whole(self) -> bool:
        """A single worker: it owns every slot."""
        return self.count == 1

    def owner(self, sample_id: str | None, line: int) -> int:
        """The worker that owns the slots of this row: by its sample id, by its line when the row has no valid id
        (a row refused before its id was read)."""
        if self.count == 1:
            return 0
        return (id_hash(sample_id) if sample_id is not None else line) % self.count

    def owns(self, sample_id: str | None, line: int) -> bool:
        return self.owner(sample_id, line) == self.index


WHOLE = WorkShare()
