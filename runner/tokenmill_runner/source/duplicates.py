"""Duplicate sample ids: which ids occur on more than one line of a source, and the first line of each. Pure.

The first valid line with an id is generated; every later line with the same id gets a `duplicate_sample_id`
error keyed by its own line. That decision must not depend on which lines were committed before a restart, so it
is made from the whole source, before the stream starts: the counting pass (`scan.py`) spools (id hash, line)
pairs into bucket files by the hash's top bits, and each bucket is resolved here on its own, so memory is bounded
by one bucket, not by the number of samples. What is kept is only the ids that repeat, as two sorted arrays.

Ids are compared by a 64-bit BLAKE2b hash (`prompts.id_hash`). Two different ids collide with probability about
n² / 2⁶⁵ for n distinct ids in a source: 3·10⁻⁶ at 10 million, 3·10⁻⁴ at 100 million. A collision makes the
later of the two lines a `duplicate_sample_id` error naming both lines, visible in the errors and the report,
never a silent loss or a second row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PAIR = np.dtype([("hash", "<u8"), ("line", "<i8")])


def repeated_ids(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """From (hash, line) pairs: the hashes that occur more than once, sorted, and the smallest line of each."""
    if pairs.size == 0:
        return np.empty(0, np.uint64), np.empty(0, np.int64)
    order = np.lexsort((pairs["line"], pairs["hash"]))
    hashes, lines = pairs["hash"][order], pairs["line"][order]
    starts = np.flatnonzero(np.r_[True, hashes[1:] != hashes[:-1]])
    runs = np.diff(np.r_[starts, hashes.size])
    repeated = starts[runs > 1]
    return hashes[repeated], lines[repeated]


@dataclass(frozen=True)
class DuplicateIds:
    """The ids of a source that occur on several lines: their hashes (sorted) and the first line of each."""

    hashes: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))
    first_lines: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    @classmethod
    def from_buckets(cls, resolved: list[tuple[np.ndarray, np.ndarray]]) -> DuplicateIds:
        """Join buckets resolved by `repeated_ids`; buckets hold disjoint hash ranges, so they are sorted."""
        if not resolved:
            return cls()
        hashes = np.concatenate([h for h, _ in resolved]).astype(np.uint64)
        lines = np.concatenate([ln for _, ln in resolved]).astype(np.int64)
        order = np.argsort(hashes, kind="stable")
        return cls(hashes[order], lines[order])

    def __len__(self) -> int:
        return int(self.hashes.size)

    def first_line(self, key: int) -> int | None:
        """The first line whose id hashes to `key`, if that id occurs more than once."""
        at = int(np.searchsorted(self.hashes, np.uint64(key)))
        if at < self.hashes.size and int(self.hashes[at]) == key:
            return int(self.first_lines[at])
        return None

    def first_of(self, line: int, key: int) -> int | None:
        """The line this one duplicates (an earlier line with the same id), or None when it is the first."""
        first = self.first_line(key)
        return first if first is not None and first != line else None
