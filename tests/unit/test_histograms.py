"""Distributions from histograms equal those from the values; the float sketch keeps its stated error bound."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill_runner.stats.distributions import distribution, length_shares, mann_whitney
from tokenmill_runner.stats.histograms import RELATIVE_ERROR, FloatSketch, IntHistogram, mann_whitney_histograms


@pytest.fixture
def lengths() -> np.ndarray:
    # The seeds' shape: median ~470, a long tail, some at a 10240 cap, a few zeros.
    rng = np.random.default_rng(3)
    return np.minimum(rng.lognormal(np.log(470), 1.5, 20_001).astype(np.int64), 10240)


def test_an_integer_histogram_gives_the_distribution_of_its_values(lengths):
    histogram, one_by_one = IntHistogram(), IntHistogram()
    for part in np.array_split(lengths, 7):  # added in pieces, as markers arrive
        histogram.add(part)
    for value in lengths[:500].tolist()[::-1]:  # one at a time, as the runner's samples finish
        one_by_one.add_one(value)
    assert histogram.distribution().as_dict() == pytest.approx(distribution(lengths).as_dict(), rel=1e-12)
    assert one_by_one.distribution().as_dict() == pytest.approx(distribution(lengths[:500]).as_dict(), rel=1e-12)
    assert histogram.total == int(lengths.sum()) and histogram.max == int(lengths.max())
    shares = length_shares(lengths)
    for n in (100, 300, 500):
        assert histogram.below(n) / histogram.count == shares[f"under_{n}"]
    for n in (1000, 5000):
        assert histogram.above(n) / histogram.count == shares[f"over_{n}"]


def test_negative_values_and_merges_are_counted_exactly():
    values = np.array([-3, 5, 0, -3, 12, 7])
    left, right = IntHistogram.of(values[:3].tolist()), IntHistogram.of(values[3:].tolist())
    left.merge(right)
    assert left.distribution().as_dict() == pytest.approx(distribution(values).as_dict())
    assert left.minus(right).distribution().as_dict() == pytest.approx(distribution(values[:3]).as_dict())


def test_the_rank_test_from_histograms_equals_the_one_from_values(lengths):
    first, rest = lengths[:100] // 2, lengths[100:]
    expected = mann_whitney(first, rest)
    whole = IntHistogram.of(np.concatenate([first, rest]).tolist())
    got = mann_whitney_histograms(IntHistogram.of(first.tolist()), whole.minus(IntHistogram.of(first.tolist())))
    assert got == pytest.approx(expected, rel=1e-12)


def test_floats_are_exact_below_the_limit_and_within_the_bound_above():
    rng = np.random.default_rng(5)
    latencies = np.concatenate([rng.lognormal(1.0, 1.2, 200_000), np.zeros(50)])
    exact = FloatSketch(exact_limit=len(latencies))
    exact.add(latencies)
    assert exact.exact and exact.distribution() == distribution(latencies)
    sketch = FloatSketch(exact_limit=1000)
    for part in np.array_split(latencies, 10):
        sketch.add(part)
    assert not sketch.exact
    got, want = sketch.distribution().as_dict(), distribution(latencies).as_dict()
    for key in ("count", "min", "max"):
        assert got[key] == want[key], key
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-9) and got["stdev"] == pytest.approx(want["stdev"], rel=1e-9)
    for key in ("p10", "p25", "median", "p75", "p90", "p95", "p99"):
        assert abs(got[key] - want[key]) <= RELATIVE_ERROR * want[key] * (1 + 1e-9), key
