"""Frequencies of loss-bearing token ids: counted per shard, merged exactly, weighted for a mix. Pure.

A *unit* is one generation (a turn), as the token exports write them (export/units.py): its loss-bearing tokens are
exactly the ids the target generated, the stop token included. Counting keeps, besides each id's count, the order in
which ids first appeared, the way a trainer that counts record by record meets them: units in order, and within a
unit its distinct ids ascending (both trainers count `unique(return_counts=True)` per record, which sorts). SpecForge
breaks ties between equal counts by that order (its `Counter.most_common`), so the maps it would build need it.

`ShardCounts` is what one shard holds (a few arrays, one entry per distinct id); `TokenFrequencies` adds shards in
commit order, or whole datasets in spec order, into dense arrays indexed by id: memory is 16 bytes per id up to the
largest id seen (a 160k vocabulary: 2.5 MB), whatever the number of tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# Draft vocabulary sizes the report shows: EAGLE-3 drafters' 32000 (the Llama vocabulary SpecForge's and
# speculators' EAGLE-3 configs name) and the powers of two around it.
REPORT_SIZES = (8192, 16384, 32000, 32768, 65536)
SHARES = (0.9, 0.95, 0.99, 0.999)  # the report's "ids needed to cover this share of loss tokens"


@dataclass(frozen=True)
class ShardCounts:
    """Distinct ids ascending, their counts, and the first unit (position among the shard's units) each appears in."""

    ids: np.ndarray  # int64, ascending
    counts: np.ndarray  # int64
    first_unit: np.ndarray  # int64

    @property
    def tokens(self) -> int:
        return int(self.counts.sum())

    @classmethod
    def empty(cls) -> ShardCounts:
        nothing = np.empty(0, dtype=np.int64)
        return cls(nothing, nothing, nothing)


def count_units(values: np.ndarray, offsets: np.ndarray) -> ShardCounts:
    """Counts of `values`, cut into units by `offsets` (unit u is values[offsets[u]:offsets[u + 1]], as Arrow lists
    are laid out)."""
    values = np.asarray(values, dtype=np.int64)
    if values.size == 0:
        return ShardCounts.empty()
    if values.min() < 0:
        raise ValueError(f"token id {int(values.min())} is negative")
    unit = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))
    top = int(values.max()) + 1
    counts = np.bincount(values, minlength=top)
    # The first unit holding each id: the smallest unit index over its occurrences (ufunc.at: unbuffered, so every
    # occurrence is compared, whatever the order).
    first = np.full(top, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, values, unit)
    ids = np.flatnonzero(counts)
    return ShardCounts(ids, counts[ids].astype(np.int64), first[ids])


class TokenFrequencies:
    """Counts per id and each id's rank of first appearance; integer counts unless a weight was not an integer."""

    def __init__(self) -> None:
        self.counts: np.ndarray = np.zeros(0, dtype=np.int64)
        self.rank = np.zeros(0, dtype=np.int64)  # -1: never seen
        self._next = 0

    def _grow(self, size: int) -> None:
        if size > self.counts.size:
            counts = np.zeros(size, dtype=self.counts.dtype)
            counts[:self.counts.size] = self.counts
            rank = np.full(size, -1, dtype=np.int64)
            rank[:self.rank.size] = self.rank
            self.counts, self.rank = counts, rank

    def _meet(self, ids: np.ndarray) -> None:
        """Rank the ids not seen yet, in the order given, after every id seen before."""
        new = ids[self.rank[ids] < 0]
        self.rank[new] = self._next + np.arange(new.size, dtype=np.int64)
        self._next += int(new.size)

    def add(self, shard: ShardCounts) -> None:
        """A shard's counts, its units after every unit added before."""
        if shard.ids.size == 0:
            return
        self._grow(int(shard.ids.max()) + 1)
        self.counts[shard.ids] += shard.counts
        order = np.lexsort((shard.ids, shard.first_unit))  # by first unit, then id
        self._meet(shard.ids[order])

    def merge(self, other: TokenFrequencies, weight: float = 1) -> None:
        """Another dataset's frequencies, times `weight`, its ids met after every id of this one."""
        if weight <= 0:
            raise ValueError(f"a weight must be positive, got {weight}")
        scaled = other.counts * weight if float(weight) != int(weight) else other.counts * int(weight)
        if scaled.dtype != self.counts.dtype and scaled.dtype.kind == "f":
            self.counts = self.counts.astype(np.float64)
        self._grow(other.counts.size)
        self.counts[:other.counts.size] += scaled
        seen = np.flatnonzero(other.rank >= 0)
        self._meet(seen[np.argsort(other.rank[seen], kind="stable")])

    @property
    def total(self) -> float:
        return self.counts.sum().item()  # type: ignore[no-any-return]

    @property
    def distinct(self) -> int:
        return int(np.count_nonzero(self.counts))

    def seen(self) -> np.ndarray:
        """Every id counted, in order of first appearance."""
        ids = np.flatnonzero(self.rank >= 0)
        return ids[np.argsort(self.rank[ids], kind="stable")]

    def by_count(self) -> np.ndarray:
        """Every id counted, most frequent first, ties by ascending id."""
        ids = np.flatnonzero(self.counts)
        ranked: np.ndarray = ids[np.lexsort((ids, -self.counts[ids]))]
        return ranked

    def covered(self, sizes: Iterable[int]) -> dict[int, float]:
        """{K: loss tokens the K most frequent ids cover} (what any tie order gives: ties have equal counts)."""
        cumulative = np.cumsum(np.sort(self.counts[self.counts > 0])[::-1])
        out: dict[int, float] = {}
        for size in sizes:
            out[size] = cumulative[min(size, cumulative.size) - 1].item() if cumulative.size and size > 0 else 0
        return out

    def ids_for(self, shares: Sequence[float]) -> dict[float, int]:
        """{share: the fewest ids whose counts cover at least that share of the loss tokens}."""
        cumulative = np.cumsum(np.sort(self.counts[self.counts > 0])[::-1])
        total = cumulative[-1] if cumulative.size else 0
        return {share: int(np.searchsorted(cumulative, share * total, side="left")) + 1 if total else 0
                for share in shares}

    def curve(self, points: int = 200) -> tuple[np.ndarray, np.ndarray]:
        """(K, share of loss tokens the top K ids cover) at about `points` K values spaced evenly on a log axis."""
        cumulative = np.cumsum(np.sort(self.counts[self.counts > 0])[::-1]).astype(np.float64)
        if not cumulative.size:
            return np.empty(0, dtype=np.int64), np.empty(0)
        sizes = np.unique(np.geomspace(1, cumulative.size, points).astype(np.int64))
        return sizes, cumulative[sizes - 1] / cumulative[-1]
