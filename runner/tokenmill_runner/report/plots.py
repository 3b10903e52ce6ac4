"""One PNG per dataset: completion-length histogram (log axis over the data's range, the median and the cap
marked) and reasoning vs answer lengths.

Drawn from what the report accumulated (`stream.py`): the histogram from the exact length counts, the
scatter from every (reasoning, answer) pair up to 20,000 and a uniform sample of them above."""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display here or in pods

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..stats.histograms import IntHistogram  # noqa: E402
from .stream import DatasetSamples  # noqa: E402

WIDTH_PX, HEIGHT_PX, DPI = 1400, 560, 100


def _log_bins(values: np.ndarray) -> np.ndarray:
    """40 log-spaced bins over the data's own range: from 1 (10^0) the shortest demo output sits a third of the
    way across an empty panel."""
    low = max(float(values.min()) * 0.95, 1.0)
    top = max(float(values.max()) * 1.05, low * 10.0)
    return np.logspace(np.log10(low), np.log10(top), 40)


def _histogram(ax: Any, name: str, completions: IntHistogram, caps: list[int], turns: int) -> None:
    values, counts = completions.distinct()
    if not values.size:
        ax.text(0.5, 0.5, "no committed samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name}: completion length (n=0)")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    bins = _log_bins(values)
    ax.hist(np.maximum(values, 1), bins=bins, weights=counts, color="#4472c4", edgecolor="white")
    ax.set_xscale("log")
    median = float(completions.median() or 0)
    ax.axvline(median, color="#333333", linewidth=1, label=f"median {median:,.0f}")
    ax.annotate(f"{median:,.0f}", (median, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                textcoords="offset points", fontsize=9)
    high = bins[-1]
    if turns:
        # A conversation's total spans its turns, and maxNewTokens caps each turn: the cap is no line on totals.
        ax.set_title(f"{name}: tokens per conversation (n={completions.count})")
        ax.set_xlabel("completion tokens of a conversation, summed over its turns (log scale)")
        ax.plot([], [], " ", label=f"maxNewTokens {', '.join(f'{c:,}' for c in caps)}: per turn, not drawn")
    else:
        for cap in caps:
            ax.axvline(cap, color="#c00000", linestyle="--", linewidth=1.5, label=f"maxNewTokens {cap:,}")
            high = max(high, cap * 1.1)
        ax.set_title(f"{name}: completion length (n={completions.count})")
        ax.set_xlabel("completion tokens (log scale)")
    ax.set_xlim(bins[0], high)
    ax.set_ylabel("samples")
    ax.legend(loc="upper left", fontsize=9)


def _reasoning_scatter(ax: Any, samples: DatasetSamples) -> None:
    points = samples.points
    reasoning = np.asarray(points.reasoning, dtype=np.int64)
    answer = np.asarray(points.answer, dtype=np.int64)
    if not reasoning.size:
        ax.text(0.5, 0.5, "no output with the end token", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        ax.scatter(np.maximum(reasoning, 1), np.maximum(answer, 1), s=8, alpha=0.5, color="#ed7d31")
        ax.set_xscale("log")
        ax.set_yscale("log")
    shown = f", {reasoning.size:,} shown" if points.sampled else ""
    ax.set_title(f"reasoning vs answer ({points.seen} of {samples.samples} with the end token{shown})")
    ax.set_xlabel("reasoning tokens (before the end token, log)")
    ax.set_ylabel("answer tokens (after it, log)")


def _png(figure: Any) -> bytes:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def dataset_figure(name: str, samples: DatasetSamples, caps: list[int]) -> Any:
    """The figure of one dataset (the caller closes it): the length histogram, then the reasoning scatter."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    _histogram(left, name, samples.completions, caps, samples.turns.count)
    _reasoning_scatter(right, samples)
    figure.tight_layout()
    return figure


def dataset_png(name: str, samples: DatasetSamples, caps: list[int]) -> bytes:
    figure = dataset_figure(name, samples, caps)
    try:
        return _png(figure)
    finally:
        plt.close(figure)


def coverage_png(curves: dict[str, tuple[np.ndarray, np.ndarray]], sizes: list[int]) -> bytes:
    """The coverage curve: the share of loss tokens the K most frequent ids cover, one line per dataset and one for
    the mix, the draft vocabulary sizes marked."""
    figure, ax = plt.subplots(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    try:
        for name, (ks, shares) in curves.items():
            if ks.size:
                ax.plot(ks, shares, linewidth=2.5 if name == "mix" else 1.2, label=name,
                        color="#333333" if name == "mix" else None)
        for size in sizes:
            ax.axvline(size, color="#c00000", linestyle=":", linewidth=1)
            ax.text(size, 0.02, f" {size:,}", color="#c00000", fontsize=8, rotation=90, va="bottom")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.01)
        ax.set_title("draft vocabulary coverage: share of loss tokens the top K ids cover")
        ax.set_xlabel("K, the most frequent ids (log scale)")
        ax.set_ylabel("share of loss tokens")
        ax.grid(True, which="both", alpha=0.3)
        if any(ks.size for ks, _ in curves.values()):  # a run whose every sample failed has no curve to name
            ax.legend(loc="best", fontsize=9)
        return _png(figure)
    finally:
        plt.close(figure)
