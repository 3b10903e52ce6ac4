"""A fake monotonic clock for the lease's tests: advanced by the code's own sleeps, so nothing really waits."""

from __future__ import annotations

from collections.abc import Callable


class FakeClock:
    """The observer's monotonic clock, advanced by the code's own sleeps (no real waiting)."""

    def __init__(self, on_sleep: Callable[[], object] | None = None) -> None:
        self.now = 1000.0
        self.on_sleep = on_sleep
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds
        if self.on_sleep is not None:
            self.on_sleep()
