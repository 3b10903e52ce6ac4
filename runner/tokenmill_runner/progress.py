"""Throughput, ETA and the progress line. The meter is pure (the caller passes the clock)."""

from __future__ import annotations

import logging
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

logger = logging.getLogger(__name__)


# The window's resolution: events that close together are added into one entry, so the meter holds at most this many
# (+1) whatever the pace (one entry a sample was 120,000 tuples at 1,000 samples/s, each summed again per rate read).
WINDOW_BUCKETS = 120


@dataclass
class ThroughputMeter:
    """Samples/s and tokens/s over a sliding window, so the ETA follows the current pace, not the run's average."""

    window_s: float = 120.0
    samples: int = 0
    tokens: int = 0
    _buckets: deque[list[float]] = field(default_factory=deque)  # [start, samples, tokens], oldest first
    _window_samples: float = 0  # the buckets' sums
    _window_tokens: float = 0

    def record(self, now: float, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        self._window_samples += samples
        self._window_tokens += tokens
        if self._buckets and now - self._buckets[-1][0] < self.window_s / WINDOW_BUCKETS:
            last = self._buckets[-1]
            last[1] += samples
            last[2] += tokens
        else:
            self._buckets.append([now, samples, tokens])
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._buckets and now - self._buckets[0][0] > self.window_s:
            _, samples, tokens = self._buckets.popleft()
            self._window_samples -= samples
            self._window_tokens -= tokens

    def rates(self, now: float, started: float) -> tuple[float, float]:
        """(samples/s, tokens/s) over the window, or since the start while the run is younger than the window."""
        self._trim(now)
        span = min(self.window_s, max(now - started, 1e-9))
        return self._window_samples / span, self._window_tokens / span


def eta_seconds(remaining: int, samples_per_s: float) -> float | None:
    if remaining <= 0:
        return 0.0
    return remaining / samples_per_s if samples_per_s > 0 else None


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "--:--:--"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}d {text}" if days else text


@dataclass(frozen=True)
class Snapshot:
    done: int
    total: int
    failed: int
    samples_per_s: float
    tokens_per_s: float
    in_flight: int
    elapsed_s: float
    tokens_left: float | None = None  # output tokens the unsettled slots are expected to take (None: unknown)

    @property
    def eta_s(self) -> float | None:
        """The tokens left at the recent token rate: datasets run one after another and their outputs differ by
        10x and more, so samples/s measured on one times the next wrongly (the operator projects the same way)."""
        if self.tokens_left is not None and self.tokens_per_s > 0:
            return self.tokens_left / self.tokens_per_s if self.total > self.done else 0.0
        return eta_seconds(self.total - self.done, self.samples_per_s)


def render_line(snapshot: Snapshot, width: int = 24) -> str:
    total = max(snapshot.total, 1)
    share = min(snapshot.done / total, 1.0)
    filled = int(share * width)
    bar = "#" * filled + "-" * (width - filled)
    return (
        f"[{bar}] {snapshot.done}/{snapshot.total} ({share:6.1%}) | failed {snapshot.failed} | "
        f"{snapshot.tokens_per_s:,.0f} tok/s | {snapshot.samples_per_s:.2f} samples/s | "
        f"in flight {snapshot.in_flight} | elapsed {format_duration(snapshot.elapsed_s)} | "
        f"ETA {format_duration(snapshot.eta_s)}"
    )


class ProgressDisplay:
    """A redrawn line on a terminal; a log line every `log_every_s` otherwise (CI logs, pods)."""

    def __init__(self, stream: TextIO | None = None, log_every_s: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.log_every_s = log_every_s
        self._last_log = float("-inf")

    def show(self, snapshot: Snapshot, now: float) -> None:
        if self.interactive:
            self.stream.write("\r" + render_line(snapshot) + "\x1b[K")
            self.stream.flush()
        elif now - self._last_log >= self.log_every_s:
            self._last_log = now
            logger.info("progress %s", render_line(snapshot))

    def close(self, snapshot: Snapshot) -> None:
        if self.interactive:
            self.stream.write("\r" + render_line(snapshot) + "\x1b[K\n")
            self.stream.flush()
        else:
            logger.info("progress %s", render_line(snapshot))
