"""Statistics on lists of values: distributions (not means), threshold shares and the Mann-Whitney rank test. Pure.

These are the definitions; the report computes the same figures from histograms (`histograms.py`), in memory
that does not grow with the number of samples, and its tests check one against the other."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

PERCENTILES = (10, 25, 75, 90, 95, 99)
UNDER = (100, 300, 500)
OVER = (1000, 5000)


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float | None
    median: float | None
    stdev: float | None
    min: float | None
    max: float | None
    p10: float | None
    p25: float | None
    p75: float | None
    p90: float | None
    p95: float | None
    p99: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def distribution(values: Sequence[float] | npt.NDArray[Any]) -> Distribution:
    """Percentiles by linear interpolation between closest ranks (numpy's default, `statistics.quantiles`'
    'inclusive' method); stdev is the sample standard deviation."""
    if len(values) == 0:
        return Distribution(0, *([None] * 11))
    data = np.asarray(values, dtype=np.float64)
    p10, p25, p50, p75, p90, p95, p99 = np.percentile(data, (10, 25, 50, 75, 90, 95, 99)).tolist()
    return Distribution(
        count=int(data.size), mean=float(data.mean()), median=p50,
        stdev=float(data.std(ddof=1)) if data.size > 1 else 0.0,
        min=float(data.min()), max=float(data.max()),
        p10=p10, p25=p25, p75=p75, p90=p90, p95=p95, p99=p99,
    )


def length_shares(values: Sequence[int]) -> dict[str, float | None]:
    """Share of samples under 100/300/500 tokens and over 1000/5000 tokens (strict inequalities)."""
    if len(values) == 0:
        return {**{f"under_{n}": None for n in UNDER}, **{f"over_{n}": None for n in OVER}}
    data = np.asarray(values)
    shares: dict[str, float | None] = {f"under_{n}": float((data < n).mean()) for n in UNDER}
    shares.update({f"over_{n}": float((data > n).mean()) for n in OVER})
    return shares


@dataclass(frozen=True)
class DriftResult:
    first_n: int
    first_mean: float
    first_median: float
    rest_n: int
    rest_mean: float
    rest_median: float
    z: float
    p_value: float
    significant: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _average_ranks(data: np.ndarray) -> np.ndarray:
    order = np.argsort(data, kind="mergesort")
    sorted_data = data[order]
    ranks = np.empty(data.size, dtype=np.float64)
    # Ties share the mean of the ranks they span.
    boundaries = np.flatnonzero(np.diff(sorted_data)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [data.size]))
    for start, end in zip(starts, ends, strict=True):
        ranks[order[start:end]] = (start + end + 1) / 2.0
    return ranks


def mann_whitney(first: Sequence[float], rest: Sequence[float]) -> tuple[float, float]:
    """Two-sided Mann-Whitney U test, normal approximation with tie correction: (z, p). Rank-based, so one
    10k-token outlier cannot fake a difference the way it moves a mean."""
    a, b = np.asarray(first, dtype=np.float64), np.asarray(rest, dtype=np.float64)
    n1, n2 = a.size, b.size
    ranks = _average_ranks(np.concatenate((a, b)))
    u1 = float(ranks[:n1].sum()) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    _, counts = np.unique(np.concatenate((a, b)), return_counts=True)
    tie_term = float((counts ** 3 - counts).sum()) / (n * (n - 1)) if n > 1 else 0.0
    variance = n1 * n2 / 12.0 * ((n + 1) - tie_term)
    if variance <= 0:
        return 0.0, 1.0
    z = float((u1 - n1 * n2 / 2.0) / math.sqrt(variance))
    return z, math.erfc(abs(z) / math.sqrt(2.0))
