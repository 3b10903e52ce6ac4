"""Distributions in memory bounded by the values' range, not by their number. Pure.

- `IntHistogram`: exact counts of integer values (token lengths), so every quantile, mean, standard deviation,
  threshold share and rank test computed from it equals what the list of values gives: memory is 8 bytes per
  distinct value up to the largest (a 32k-token cap: 256 KiB), whatever the number of samples.
- `FloatSketch`: floats (latencies). Every value is kept, exactly, up to `exact_limit` values; past it the sketch
  keeps logarithmic buckets (the DDSketch scheme) and a quantile it returns is within `relative_error` (0.5 %) of
  the true one, while count, mean, standard deviation, min and max stay exact. Both use numpy's default
  quantile definition (linear interpolation between closest ranks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from .distributions import PERCENTILES, Distribution

QUANTILES = (10, 25, 50, 75, 90, 95, 99)
EXACT_LIMIT = 1 << 20  # floats kept exactly up to this many values (8 MiB)
RELATIVE_ERROR = 0.005


def _interpolate(low: float, high: float, fraction: float) -> float:
    return low + (high - low) * fraction


class IntHistogram:
    """counts[v - offset] is how many times the integer v was added."""

    def __init__(self) -> None:
        self.counts = np.zeros(0, dtype=np.int64)
        self.offset = 0
        self.count = 0
        self.total = 0  # exact sum (Python int)
        self.squares = 0  # exact sum of squares

    @classmethod
    def of(cls, values: Iterable[int]) -> IntHistogram:
        histogram = cls()
        histogram.add(np.fromiter(values, dtype=np.int64))
        return histogram

    def add(self, values: np.ndarray | Sequence[int]) -> None:
        data = np.asarray(values, dtype=np.int64)
        if data.size == 0:
            return
        low, high = int(data.min()), int(data.max())
        self._cover(low, high)
        self.counts += np.bincount(data - self.offset, minlength=self.counts.size)
        self.count += int(data.size)
        self.total += int(data.sum())
        self.squares += int(np.dot(data, data)) if high < 1 << 31 and -low < 1 << 31 else sum(v * v for v in data.tolist())

    def add_one(self, value: int) -> None:
        """One value: a count, without the array pass `add` makes (it runs once per sample on the runner's loop)."""
        at = value - self.offset
        if self.counts.size == 0 or not 0 <= at < self.counts.size:
            self._cover(value, value)
            at = value - self.offset
        self.counts[at] += 1
        self.count += 1
        self.total += value
        self.squares += value * value

    def _cover(self, low: int, high: int) -> None:
        if self.counts.size == 0:
            self.offset, self.counts = low, np.zeros(high - low + 1, dtype=np.int64)
            return
        start, end = min(low, self.offset), max(high, self.offset + self.counts.size - 1)
        if start == self.offset and end == self.offset + self.counts.size - 1:
            return
        grown = np.zeros(end - start + 1, dtype=np.int64)
        grown[self.offset - start:self.offset - start + self.counts.size] = self.counts
        self.offset, self.counts = start, grown

    def merge(self, other: IntHistogram) -> None:
        if other.count == 0:
            return
        self._cover(other.offset, other.offset + other.counts.size - 1)
        at = other.offset - self.offset
        self.counts[at:at + other.counts.size] += other.counts
        self.count += other.count
        self.total += other.total
        self.squares += other.squares

    def minus(self, other: IntHistogram) -> IntHistogram:
        """The values of this histogram that are not in `other` (which must be part of it)."""
        rest = IntHistogram()
        rest.offset, rest.counts = self.offset, self.counts.copy()
        at = other.offset - self.offset
        rest.counts[at:at + other.counts.size] -= other.counts
        if at < 0 or (rest.counts < 0).any():
            raise ValueError("the histogram subtracted is not part of this one")
        rest.count, rest.total, rest.squares = self.count - other.count, self.total - other.total, \
            self.squares - other.squares
        return rest

    # -- questions -------------------------------------------------------------------------------------------
    @property
    def min(self) -> int | None:
        return self.offset + int(np.flatnonzero(self.counts)[0]) if self.count else None

    @property
    def max(self) -> int | None:
        return self.offset + int(np.flatnonzero(self.counts)[-1]) if self.count else None

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def stdev(self) -> float | None:
        """Sample standard deviation, from exact integer sums."""
        if not self.count:
            return None
        if self.count == 1:
            return 0.0
        return math.sqrt((self.count * self.squares - self.total ** 2) / (self.count * (self.count - 1)))

    def values_at(self, ranks: np.ndarray) -> np.ndarray:
        """The value at each 0-based rank of the sorted data."""
        cumulative = np.cumsum(self.counts)
        return self.offset + np.searchsorted(cumulative, ranks, side="right")

    def quantiles(self, percents: Sequence[float]) -> list[float]:
        """numpy.percentile's default (linear) on the data this histogram counts."""
        positions = (self.count - 1) * np.asarray(percents, dtype=np.float64) / 100.0
        low = np.floor(positions).astype(np.int64)
        high = np.minimum(low + 1, self.count - 1)
        low_values, high_values = self.values_at(low), self.values_at(high)
        return [_interpolate(float(a), float(b), float(p - lo))
                for a, b, p, lo in zip(low_values, high_values, positions, low, strict=True)]

    def median(self) -> float | None:
        return self.quantiles([50])[0] if self.count else None

    def below(self, threshold: int) -> int:
        """How many values are < threshold."""
        return int(self.counts[:max(min(threshold - self.offset, self.counts.size), 0)].sum())

    def above(self, threshold: int) -> int:
        """How many values are > threshold."""
        return int(self.counts[max(threshold - self.offset + 1, 0):].sum())

    def distinct(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, counts) of the values present."""
        present = np.flatnonzero(self.counts)
        return present + self.offset, self.counts[present]

    def distribution(self) -> Distribution:
        if not self.count:
            return Distribution(0, *([None] * 11))
        p10, p25, p50, p75, p90, p95, p99 = self.quantiles(QUANTILES)
        return Distribution(count=self.count, mean=self.mean(), median=p50, stdev=self.stdev(),
                            min=float(self.min), max=float(self.max),  # type: ignore[arg-type]
                            p10=p10, p25=p25, p75=p75, p90=p90, p95=p95, p99=p99)


class FloatSketch:
    """Floats: exact while there are at most `exact_limit`, then logarithmic buckets with `relative_error`."""

    def __init__(self, exact_limit: int | None = None, relative_error: float = RELATIVE_ERROR) -> None:
        self.exact_limit = EXACT_LIMIT if exact_limit is None else exact_limit
        self.relative_error = relative_error
        self._gamma = (1 + relative_error) / (1 - relative_error)
        self._log_gamma = math.log(self._gamma)
        self._values: list[np.ndarray] | None = []  # every value while exact; None once past the limit
        self._positive: dict[int, int] = {}  # bucket -> count: bucket k holds (gamma^(k-1), gamma^k]
        self._negative: dict[int, int] = {}  # the same for -value
        self._zeros = 0
        self.count = 0
        self._mean = 0.0
        self._m2 = 0.0  # sum of squared deviations from the mean (Chan et al.'s pairwise update)
        self.min = math.inf
        self.max = -math.inf

    @property
    def exact(self) -> bool:
        return self._values is not None

    def add(self, values: np.ndarray | Sequence[float]) -> None:
        data = np.asarray(values, dtype=np.float64)
        data = data[~np.isnan(data)]
        if data.size == 0:
            return
        mean = float(data.mean())
        self._combine(int(data.size), mean, float(((data - mean) ** 2).sum()))
        self.min, self.max = min(self.min, float(data.min())), max(self.max, float(data.max()))
        self._zeros += int((data == 0).sum())
        _count_buckets(self._positive, data[data > 0], self._log_gamma)
        _count_buckets(self._negative, -data[data < 0], self._log_gamma)
        if self._values is not None:
            self._values.append(data)
            if self.count > self.exact_limit:
                self._values = None

    def _combine(self, count: int, mean: float, m2: float) -> None:
        total = self.count + count
        delta = mean - self._mean
        self._m2 += m2 + delta * delta * self.count * count / total
        self._mean += delta * count / total
        self.count = total

    def merge(self, other: FloatSketch) -> None:
        if other.count == 0:
            return
        self._combine(other.count, other._mean, other._m2)
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        self._zeros += other._zeros
        for mine, theirs in ((self._positive, other._positive), (self._negative, other._negative)):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count
        if self._values is not None and other._values is not None and self.count <= self.exact_limit:
            self._values.extend(other._values)
        else:
            self._values = None

    def _value_at(self, rank: int) -> float:
        """The value at a 0-based rank from the buckets: the representative of the bucket that holds it, within
        relative_error of every value in that bucket."""
        buckets = [(-key, count, -1.0) for key, count in sorted(self._negative.items(), reverse=True)]
        buckets += [(0, self._zeros, 0.0)] if self._zeros else []
        buckets += [(key, count, 1.0) for key, count in sorted(self._positive.items())]
        for key, count, sign in buckets:
            if rank < count:
                return 0.0 if sign == 0 else sign * 2 * self._gamma ** (sign * key) / (self._gamma + 1)
            rank -= count
        return self.max

    def distribution(self) -> Distribution:
        if not self.count:
            return Distribution(0, *([None] * 11))
        if self._values is not None:
            return _exact(np.concatenate(self._values))
        positions = (self.count - 1) * np.asarray(QUANTILES, dtype=np.float64) / 100.0
        quantiles = []
        for position in positions.tolist():
            low = math.floor(position)
            value = _interpolate(self._value_at(low), self._value_at(min(low + 1, self.count - 1)), position - low)
            quantiles.append(min(max(value, self.min), self.max))
        p10, p25, p50, p75, p90, p95, p99 = quantiles
        stdev = math.sqrt(self._m2 / (self.count - 1)) if self.count > 1 else 0.0
        return Distribution(count=self.count, mean=self._mean, median=p50, stdev=stdev, min=self.min, max=self.max,
                            p10=p10, p25=p25, p75=p75, p90=p90, p95=p95, p99=p99)


def _count_buckets(buckets: dict[int, int], positive: np.ndarray, log_gamma: float) -> None:
    if positive.size:
        keys, counts = np.unique(np.ceil(np.log(positive) / log_gamma).astype(np.int64), return_counts=True)
        for key, count in zip(keys.tolist(), counts.tolist(), strict=True):
            buckets[key] = buckets.get(key, 0) + count


def _exact(data: np.ndarray) -> Distribution:
    from .distributions import distribution

    return distribution(data)


def mann_whitney_histograms(first: IntHistogram, rest: IntHistogram) -> tuple[float, float]:
    """`stats.mann_whitney(first values, rest values)` computed from the two samples' histograms: each distinct value
    gets the average rank of its ties in the combined sample. Exact: the same U, tie correction, z and p."""
    n1, n2 = first.count, rest.count
    combined = IntHistogram()
    combined.merge(first)
    combined.merge(rest)
    values, counts = combined.distinct()
    below = np.cumsum(counts) - counts
    average_rank = below + (counts + 1) / 2.0
    firsts = np.zeros(values.size, dtype=np.int64)
    present, first_counts = first.distinct()
    firsts[np.searchsorted(values, present)] = first_counts
    u1 = float((firsts * average_rank).sum()) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    tie_term = float((counts.astype(np.float64) ** 3 - counts).sum()) / (n * (n - 1)) if n > 1 else 0.0
    variance = n1 * n2 / 12.0 * ((n + 1) - tie_term)
    if variance <= 0:
        return 0.0, 1.0
    z = float((u1 - n1 * n2 / 2.0) / math.sqrt(variance))
    return z, math.erfc(abs(z) / math.sqrt(2.0))


__all__ = ["EXACT_LIMIT", "PERCENTILES", "RELATIVE_ERROR", "FloatSketch", "IntHistogram", "mann_whitney_histograms"]
