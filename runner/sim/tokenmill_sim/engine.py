"""The capacity model on an asyncio loop: simulated time runs `time_scale` times faster than the wall clock.

One background task advances the model and resolves each job's future when its last step ends. It sleeps until the
model's next event (or until a new arrival wakes it), so a thousand running requests cost one timer, not one per
token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .capacity import CapacityModel, Job

logger = logging.getLogger(__name__)

MIN_SLEEP_S = 0.0005  # real seconds; below the event loop's timer resolution anyway


class QueueFull(Exception):
    """The waiting queue holds max_queued_requests already (SGLang aborts the newcomer with 503)."""


class SimClock:
    def __init__(self, time_scale: float, now: Callable[[], float] = time.perf_counter) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.time_scale = time_scale
        self._now = now
        self._origin = now()

    def now(self) -> float:
        """Simulated seconds since the clock was made."""
        return (self._now() - self._origin) * self.time_scale

    def real_seconds(self, simulated: float) -> float:
        return simulated / self.time_scale


class Engine:
    def __init__(self, model: CapacityModel, clock: SimClock, max_queued_requests: int | None = None) -> None:
        self.model = model
        self.clock = clock
        self.max_queued_requests = max_queued_requests
        self._task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tokenmill-sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def sync(self) -> None:
        """Bring the model up to now and hand finished jobs to their waiters."""
        for job in self.model.advance_to(self.clock.now()):
            future = job.handle
            if isinstance(future, asyncio.Future) and not future.done():
                future.set_result(job)

    def submit(self, job: Job, *, enforce_queue_limit: bool = True) -> Job:
        """Queue a request now; await `job.handle` for the finished job. Raises QueueFull."""
        self.sync()
        limit = self.max_queued_requests
        if enforce_queue_limit and limit is not None and self.model.queued + 1 > limit:
            raise QueueFull()
        job.arrival = self.clock.now()
        job.handle = asyncio.get_running_loop().create_future()
        self.model.submit(job)
        self._wake()
        return job

    def cancel(self, job: Job) -> None:
        self.model.cancel(job)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.sync()
            except Exception:  # a bug here would hang every request: log it loudly and keep serving
                logger.exception("simulator engine step failed")
            next_event = self.model.next_event_time()
            self._waiter = loop.create_future()
            timer = None
            if next_event is not None:
                delay = max(MIN_SLEEP_S, self.clock.real_seconds(next_event - self.clock.now()))
                timer = loop.call_later(delay, self._wake)
            try:
                await self._waiter
            finally:
                if timer is not None:
                    timer.cancel()
