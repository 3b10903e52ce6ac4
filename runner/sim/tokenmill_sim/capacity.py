"""A continuous-batching server as a discrete-event model: pure arithmetic on simulated time, no I/O, no clock.

The server runs decode steps back to back. At the start of a step, waiting requests join the running batch in
FIFO order while there is a free slot (max_running_requests) and KV room (prompt + output tokens reserved in a pool
of max_total_tokens). A step takes `step_ms + step_ms_per_request * running` plus `prefill_ms_per_1k_tokens` for the
prompt tokens admitted with it; every running request gains one token per step, and a request admitted at step k
with n output tokens finishes at the end of step k + n - 1 (the admitting step yields its first token).

Between two changes of the batch (a completion, or an arrival that can be admitted) every step has the same length,
so `advance_to` jumps over whole runs of steps at once: the cost is per event, never per token.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CapacityParams:
    max_running_requests: int = 256
    max_total_tokens: int = 4_000_000
    step_ms: float = 20.0
    step_ms_per_request: float = 0.05
    prefill_ms_per_1k_tokens: float = 30.0

    def step_seconds(self, running: int) -> float:
        return (self.step_ms + self.step_ms_per_request * running) / 1000.0

    def prefill_seconds(self, prompt_tokens: int) -> float:
        return self.prefill_ms_per_1k_tokens * prompt_tokens / 1_000_000.0


@dataclass(eq=False)
class Job:
    """One request inside the model. Times are simulated seconds."""

    prompt_tokens: int
    output_tokens: int  # tokens it will generate before finishing (at least one step is always run)
    arrival: float
    handle: Any = None  # the caller's object, handed back on completion
    admitted_at: float | None = None  # start of the step that admitted it
    first_token_at: float | None = None  # end of that step
    finished_at: float | None = None
    start_step: int = -1
    finish_step: int = -1
    cancelled: bool = False
    state: str = field(default="new")  # new | queued | running | done

    @property
    def steps(self) -> int:
        return max(1, self.output_tokens)

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_tokens + self.steps


class CapacityModel:
    def __init__(self, params: CapacityParams) -> None:
        self.params = params
        self.boundary = 0.0  # start time of the next step not yet begun
        self.step = 0  # index of that step
        self.queue: deque[Job] = deque()
        self.queued = 0  # queue length without cancelled jobs
        self._heap: list[tuple[int, int, Job]] = []  # (finish_step, tie-break, job) of running jobs
        self._order = itertools.count()
        self.running = 0
        self.reserved = 0  # KV tokens reserved by running jobs
        self._running_prompt = 0
        self._running_start_sum = 0  # sum of start_step over running jobs (for used-token accounting)
        self._pending: deque[Job] = deque()  # finished in a begun step, delivered once time passes its end
        self._prefill_pending = 0  # prompt tokens admitted at the current boundary, charged to its step
        self._just_admitted: list[Job] = []  # admitted at the current boundary; their first token ends its step
        self.generated_tokens = 0  # over the model's life
        self.completed = 0

    # ---- inputs -------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job that arrived at job.arrival; call advance_to(job.arrival) first."""
        if not self.running and not self.queued:
            # An idle server starts its next step the moment work arrives.
            self.boundary = max(self.boundary, job.arrival)
        job.state = "queued"
        self.queue.append(job)
        self.queued += 1

    def cancel(self, job: Job) -> None:
        """The client went away: free the job's slot and KV reservation now."""
        if job.state == "queued" and not job.cancelled:
            self.queued -= 1
        elif job.state == "running" and not job.cancelled:
            self._release(job)
        job.cancelled = True

    # ---- time ---------------------------------------------------------------------------------------------
    def advance_to(self, now: float) -> list[Job]:
        """Run every step that begins at or before `now`; return the jobs whose last step has ended by `now`."""
        while self.boundary <= now:
            self._admit()
            if not self.running:
                # Idle (everything admitted here was cancelled): the next step starts with the next arrival.
                self.boundary = now
                self._prefill_pending = 0
                self._just_admitted.clear()
                break
            self._run_steps(now)
        done = []
        while self._pending and self._pending[0].finished_at <= now:  # type: ignore[operator]
            done.append(self._pending.popleft())
        return done

    def next_event_time(self) -> float | None:
        """When advance_to would next have something to return, if nothing else arrives; None when idle."""
        if self._pending:
            return self._pending[0].finished_at
        if self.queued and self._can_admit_head():
            return self.boundary
        top = self._top()
        if top is None:
            return None
        steps = top.finish_step - self.step + 1
        return self.boundary + self.params.prefill_seconds(self._prefill_pending) \
            + steps * self.params.step_seconds(self.running)

    # ---- gauges -------------------------------------------------------------------------------------------
    def used_tokens(self) -> int:
        """KV tokens held now: running prompts plus the tokens generated so far."""
        return self._running_prompt + self.running * self.step - self._running_start_sum

    def decode_throughput(self) -> float:
        """Tokens per simulated second at the current batch size."""
        return self.running / self.params.step_seconds(self.running) if self.running else 0.0

    # ---- internals ----------------------------------------------------------------------------------------
    def _can_admit_head(self) -> bool:
        head = self._head()
        if head is None or self.running >= self.params.max_running_requests:
            return False
        # A job larger than the whole pool still runs alone, rather than blocking the queue forever.
        return self.running == 0 or self.reserved + head.reserved_tokens <= self.params.max_total_tokens

    def _head(self) -> Job | None:
        while self.queue and self.queue[0].cancelled:
            self.queue.popleft()
        return self.queue[0] if self.queue else None

    def _admit(self) -> None:
        while self._can_admit_head():
            job = self.queue.popleft()
            self.queued -= 1
            job.state = "running"
            job.admitted_at = self.boundary
            job.start_step = self.step
            job.finish_step = self.step + job.steps - 1
            heapq.heappush(self._heap, (job.finish_step, next(self._order), job))
            self.running += 1
            self.reserved += job.reserved_tokens
            self._running_prompt += job.prompt_tokens
            self._running_start_sum += job.start_step
            self._prefill_pending += job.prompt_tokens
            self._just_admitted.append(job)

    def _top(self) -> Job | None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][2] if self._heap else None

    def _run_steps(self, now: float) -> None:
        """Run steps from the boundary up to the next completion, or until the next step would begin after now."""
        top = self._top()
        assert top is not None
        dt = self.params.step_seconds(self.running)
        first = dt + self.params.prefill_seconds(self._prefill_pending)
        first_end = self.boundary + first
        for job in self._just_admitted:
            job.first_token_at = first_end
        self._just_admitted.clear()
        # Steps step..step+k all have length dt (the first one plus prefill); step+j begins at first_end + (j-1)*dt.
        last_possible = top.finish_step - self.step
        startable = 0 if now < first_end else 1 + math.floor((now - first_end) / dt)
        k = min(last_possible, startable)
        self.generated_tokens += self.running * (k + 1)
        self.boundary = first_end + k * dt
        self.step += k + 1
        self._prefill_pending = 0
        if k == last_possible:
            self._finish_step(self.step - 1)

    def _finish_step(self, step: int) -> None:
        while True:
            top = self._top()
            if top is None or top.finish_step != step:
                break
            heapq.heappop(self._heap)
            self._release(top)
            top.finished_at = self.boundary
            top.state = "done"
            self.completed += 1
            self._pending.append(top)

    def _release(self, job: Job) -> None:
        self.running -= 1
        self.reserved -= job.reserved_tokens
        self._running_prompt -= job.prompt_tokens
        self._running_start_sum -= job.start_step
