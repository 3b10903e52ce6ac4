"""One PNG per dataset: completion-length histogram (log axis, cap marked) and reasoning vs answer lengths."""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display here or in pods

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .stats import reasoning_and_answer  # noqa: E402

WIDTH_PX, HEIGHT_PX, DPI = 1400, 560, 100


def _log_bins(values: np.ndarray) -> np.ndarray:
    top = max(float(values.max()), 10.0)
    return np.logspace(0, np.log10(top * 1.05), 40)


def _histogram(ax: Any, name: str, completions: np.ndarray, caps: list[int]) -> None:
    if completions.size:
        ax.hist(np.maximum(completions, 1), bins=_log_bins(completions), color="#4472c4", edgecolor="white")
    ax.set_xscale("log")
    for cap in caps:
        ax.axvline(cap, color="#c00000", linestyle="--", linewidth=1.5, label=f"maxNewTokens {cap}")
    if completions.size:
        ax.axvline(float(np.median(completions)), color="#333333", linewidth=1, label="median")
    ax.set_title(f"{name}: completion length (n={completions.size})")
    ax.set_xlabel("completion tokens (log scale)")
    ax.set_ylabel("samples")
    ax.legend(loc="upper left", fontsize=9)


def _reasoning_scatter(ax: Any, reasoning: np.ndarray, answer: np.ndarray, total: int) -> None:
    if reasoning.size:
        ax.scatter(np.maximum(reasoning, 1), np.maximum(answer, 1), s=8, alpha=0.5, color="#ed7d31")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"reasoning vs answer ({reasoning.size} of {total} with the end token)")
    ax.set_xlabel("reasoning tokens (before the end token, log)")
    ax.set_ylabel("answer tokens (after it, log)")


def dataset_png(name: str, samples: dict[str, list[Any]], caps: list[int]) -> bytes:
    completions = np.asarray(samples["completion_tokens"], dtype=np.int64)
    reasoning_lengths, answer_lengths = reasoning_and_answer(samples)
    reasoning = np.asarray(reasoning_lengths, dtype=np.int64)
    answer = np.asarray(answer_lengths, dtype=np.int64)
    figure, (left, right) = plt.subplots(1, 2, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    try:
        _histogram(left, name, completions, caps)
        _reasoning_scatter(right, reasoning, answer, completions.size)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=DPI)
        return buffer.getvalue()
    finally:
        plt.close(figure)
