"""SGLang's continuous-batching scheduler as a discrete-event model: pure arithmetic on simulated time, no I/O.

What it follows from SGLang (read in 0.5.9 and 0.5.23; the numbers are the same in every supported release):
- Admission (`PrefillAdder.add_one_req`, 0.5.9 managers/schedule_policy.py:719-813): first come, first served; the
  head of the queue joins while a slot is free (max_running_requests) and its prompt (after a retraction: prompt and
  what it generated so far, re-prefilled) plus min(max_new_tokens - generated, 4096) is less than the pool's free
  tokens minus what the running requests are expected to still need, min(their remaining max_new_tokens, 4096) x
  new_token_ratio (`rem_total_tokens`, 0.5.9 managers/schedule_policy.py:445-467); the first head that does not fit
  stops admission. At most max_prefill_tokens of prompt join per step, the first request always.
- new_token_ratio starts at 0.7 (x schedule_conservativeness), falls by (0.7 - 0.7 x 0.14) / 600 per decode step down
  to 0.7 x 0.14 (0.5.9 managers/scheduler.py:811-823, 2257-2260; environ.py:225-229), goes back to 0.7 when the
  server idles (0.5.9 managers/scheduler_runtime_checker_mixin.py:334), and after a retraction is set to
  min(1, (decoded + 20 x running) / (sum of max_new_tokens + 1)) over the requests that stay (0.5.9
  managers/schedule_batch.py:1893-1904).
- Decode: each running request gains one token per step. Before a step, if the pool cannot hold one more token per
  running request (`check_decode_mem`, 0.5.9 managers/schedule_batch.py:1834), requests are retracted, fewest
  generated tokens first and the longest prompt first among ties, at least one and never the last, until it can
  (`retract_decode`, 0.5.9 managers/schedule_batch.py:1847-1888); each frees its KV and goes to the back of the
  queue (0.5.9 managers/scheduler.py:2254-2255) to be re-prefilled, its retraction counted.
- A request admitted at step k with n output tokens to go finishes at the end of step k + n - 1 (the admitting step
  yields its first token). The step time is a parameter (`StepTime`): a decode step with `running` requests over
  `kv_tokens` of KV, plus the prefill of the prompt tokens admitted with it.

Between two changes of the batch every step has the same length, so `advance_to` jumps over stretches of steps at
once: the cost is per event (a completion, a retraction, an admission), never per token. Approximations, each
cheap and on the safe side: the step time is evaluated once per stretch (at most `max_stretch_steps` long when it
depends on the KV in use); a queue held back by the token budget, not by slots, is looked at again every
`admission_check_steps` steps rather than every step; a prefix shared by running requests is counted in full for
each of them (SGLang keeps one copy), so the pool fills a little sooner than SGLang's.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from .radix import PrefixCache

# SGLANG_INIT_NEW_TOKEN_RATIO, SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS,
# SGLANG_RETRACT_DECODE_STEPS, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION (0.5.9 environ.py:225-229; 0.5.23
# environ.py:646 and on); --max-prefill-tokens default 16384 (0.5.9 and 0.5.23 argparse defaults).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
CLIP_MAX_NEW_TOKENS = 4096
MAX_PREFILL_TOKENS = 16384


class StepTime(Protocol):
    """How long the server's steps take: the seam for a step-time model built from GPU and model facts."""

    @property
    def depends_on_kv(self) -> bool:  # True: the step time changes as the KV in use grows (stretches kept short)
        ...

    def decode_seconds(self, running: int, kv_tokens: int) -> float: ...

    def prefill_seconds(self, tokens: int) -> float: ...


@dataclass(frozen=True)
class LinearStepTime:
    """A decode step of `step_ms` plus `step_ms_per_request` per running request; prefill per 1000 prompt tokens."""

    step_ms: float = 20.0
    step_ms_per_request: float = 0.05
    prefill_ms_per_1k_tokens: float = 30.0
    depends_on_kv: ClassVar[bool] = False

    def decode_seconds(self, running: int, kv_tokens: int = 0) -> float:
        return (self.step_ms + self.step_ms_per_request * running) / 1000.0

    def prefill_seconds(self, tokens: int) -> float:
        return self.prefill_ms_per_1k_tokens * tokens / 1_000_000.0


@dataclass(frozen=True)
class SchedulerParams:
    max_running_requests: int = 256
    max_total_tokens: int = 4_000_000  # the KV pool in tokens
    max_prefill_tokens: int = MAX_PREFILL_TOKENS
    schedule_conservativeness: float = 1.0
    admission_check_steps: int = 8
    max_stretch_steps: int = 64

    def __post_init__(self) -> None:
        if self.max_running_requests < 1 or self.max_total_tokens < 2:
            raise ValueError("max_running_requests must be at least 1 and max_total_tokens at least 2")

    @property
    def init_ratio(self) -> float:
        return min(INIT_NEW_TOKEN_RATIO * self.schedule_conservativeness, 1.0)

    @property
    def min_ratio(self) -> float:
        return min(self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)

    @property
    def ratio_decay(self) -> float:
        return (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS


@dataclass(eq=False)
class Job:
    """One request inside the model. Times are simulated seconds."""

    prompt_tokens: int
    output_tokens: int  # tokens it will generate before finishing (at least one)
    arrival: float
    max_new_tokens: int | None = None  # what the request allows (the admission estimate uses it); None: output
    handle: Any = None  # the caller's object, handed back on completion
    prompt_ids: Sequence[int] | None = None  # for the prefix cache; None: no cache lookup
    # A request that asks input logprobs from a position (logprob_start_len) reuses no cached prefix past it
    # (0.5.23 managers/schedule_batch.py:1766-1785): a hidden-state capture (logprob_start_len 0) prefills in full.
    match_limit: int | None = None
    output_ids: Sequence[int] | None = None  # cached with the prompt when it finishes (the next turn's history)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first admitted
    generated: int = 0  # tokens generated before its current run (non-zero after a retraction)
    retractions: int = 0
    admitted_at: float | None = None  # start of the step that first admitted it
    first_token_at: float | None = None  # end of that step
    finished_at: float | None = None
    run_start: int = -1  # step index at which its current run began
    finish_step: int = -1
    cancelled: bool = False
    state: str = field(default="new")  # new | queued | running | done
    estimate_clipped: bool = False  # while running: its estimate is still the 4096 clip

    def __post_init__(self) -> None:
        self.output_tokens = max(1, self.output_tokens)
        if self.max_new_tokens is None:
            self.max_new_tokens = self.output_tokens

    @property
    def steps(self) -> int:
        return self.output_tokens

    def generated_at(self, step: int) -> int:
        """Tokens generated before step `step` begins (while running)."""
        return self.generated + step - self.run_start

    def estimate(self, generated: int) -> int:
        assert self.max_new_tokens is not None
        return min(max(self.max_new_tokens - generated, 0), CLIP_MAX_NEW_TOKENS)


class CapacityModel:
    def __init__(self, params: SchedulerParams, step_time: StepTime | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.params = params
        self.step_time = step_time or LinearStepTime()
        self.prefix_cache = prefix_cache
        self.boundary = 0.0  # start time of the next step not yet begun
        self.step = 0  # index of that step
        self.new_token_ratio = params.init_ratio
        self.queue: deque[Job] = deque()
        self.queued = 0  # queue length without cancelled jobs
        self._running: set[Job] = set()
        self._heap: list[tuple[int, int, Job]] = []  # (finish_step, tie-break, job) of running jobs
        self._order = itertools.count()
        self._kv_const = 0  # sum over running jobs of prompt + generated - run_start: KV in use = this + running x step
        self._pending: deque[Job] = deque()  # finished in a begun step, delivered once time passes its end
        self._prefill_pending = 0  # prompt tokens admitted at the current boundary, charged to its step
        self._just_admitted: list[Job] = []  # first admitted at the current boundary; first token at its step's end
        self._since_admission_check = 0
        # The running requests' admission estimates, kept as sums so an admission costs O(1), not O(running):
        # clipped ones count 4096 until `step` reaches their entry in the heap; the others count
        # max_new_tokens - generated, i.e. (max_new - generated + run_start) - step.
        self._clipped = 0
        self._clip_heap: list[tuple[int, int, int, Job]] = []  # (step it unclips, tie-break, run_start, job)
        self._unclipped = 0
        self._unclipped_const = 0
        self.generated_tokens = 0  # over the model's life
        self.completed = 0
        self.retracted_total = 0
        self.last_retracted = 0  # requests retracted by the last retraction (SGLang's num_retracted_reqs gauge)

    # ---- inputs -------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job that arrived at job.arrival; call advance_to(job.arrival) first."""
        if job.prompt_tokens + job.estimate(0) >= self.params.max_total_tokens:
            raise ValueError(f"a request of {job.prompt_tokens} prompt tokens and max_new_tokens "
                             f"{job.max_new_tokens} can never be admitted to a pool of {self.params.max_total_tokens}")
        if not self._running and not self.queued:
            # An idle server starts its next step the moment work arrives.
            self.boundary = max(self.boundary, job.arrival)
        job.state = "queued"
        self.queue.append(job)
        self.queued += 1

    def cancel(self, job: Job) -> None:
        """The client went away: free the job's slot and KV now."""
        if job.state == "queued" and not job.cancelled:
            self.queued -= 1
        elif job.state == "running" and not job.cancelled:
            self._release(job)
        job.cancelled = True

    # ---- time ---------------------------------------------------------------------------------------------
    def advance_to(self, now: float) -> list[Job]:
        """Run every step that begins at or before `now`; return the jobs whose last step has ended by `now`."""
        while self.boundary <= now:
            self._retract_if_full()
            self._admit()
            if not self._running:
                # Idle: the next step starts with the next arrival, and SGLang resets its estimate.
                self.boundary = now
                self._prefill_pending = 0
                self._just_admitted.clear()
                self.new_token_ratio = self.params.init_ratio
                break
            self._run_stretch(now)
        done = []
        while self._pending and self._pending[0].finished_at <= now:  # type: ignore[operator]
            done.append(self._pending.popleft())
        return done

    def next_event_time(self) -> float | None:
        """When advance_to may next change something, if nothing else arrives; None when idle."""
        if self._pending:
            return self._pending[0].finished_at
        if self._running:
            return self.boundary + self._stretch_seconds(self._stretch_length())
        if self.queued:
            return self.boundary
        return None

    # ---- gauges -------------------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    def used_tokens(self) -> int:
        """KV tokens held now: running prompts plus the tokens generated so far."""
        return self._kv_const + self.running * self.step

    def decode_throughput(self) -> float:
        """Tokens per simulated second at the current batch size."""
        if not self._running:
            return 0.0
        return self.running / self.step_time.decode_seconds(self.running, self.used_tokens())

    # ---- internals: retraction ----------------------------------------------------------------------------
    def _needed(self) -> int:
        """KV tokens the running requests need to run the next step."""
        return self.used_tokens() + self.running

    def _retract_if_full(self) -> None:
        if not self._running or self._needed() <= self.params.max_total_tokens:
            return
        step = self.step
        order = sorted(self._running, key=lambda j: (j.generated_at(step), -j.prompt_tokens), reverse=True)
        retracted: list[Job] = []
        while len(order) > 1 and (not retracted or self._needed() > self.params.max_total_tokens):
            job = order.pop()
            generated = job.generated_at(step)
            self._release(job)
            job.generated = generated
            job.retractions += 1
            job.state = "queued"
            self.queue.append(job)
            self.queued += 1
            retracted.append(job)
        # A single request always fits: the server never admits one that cannot (its max_new_tokens is clamped to
        # the pool), so SGLang's "Out of memory even after retracting all other requests" cannot happen here.
        assert self._needed() <= self.params.max_total_tokens, "one request alone outgrew the KV pool"
        self.retracted_total += len(retracted)
        self.last_retracted = len(retracted)
        decoded = sum(j.generated_at(step) for j in self._running)
        allowed = sum(j.max_new_tokens or 0 for j in self._running)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * self.running) / (allowed + 1))

    # ---- internals: admission -----------------------------------------------------------------------------
    def _head(self) -> Job | None:
        while self.queue and self.queue[0].cancelled:
            self.queue.popleft()
        return self.queue[0] if self.queue else None

    def _budget(self) -> float:
        return self.params.max_total_tokens - self.used_tokens() - self.new_token_ratio * self.expected_tokens()

    def expected_tokens(self) -> int:
        """The running requests' estimated remaining tokens, sum of min(max_new - generated, 4096)."""
        self._unclip(self.step)
        return self._clipped * CLIP_MAX_NEW_TOKENS + self._unclipped_const - self._unclipped * self.step

    def _unclip(self, step: int) -> None:
        while self._clip_heap and self._clip_heap[0][0] <= step:
            _, _, run_start, job = heapq.heappop(self._clip_heap)
            if job.state == "running" and job.run_start == run_start and job.estimate_clipped:
                self._track_estimate(job, clipped=False)

    def _track_estimate(self, job: Job, clipped: bool | None) -> None:
        """Move the job's estimate between the clipped count and the unclipped sums (None: remove it)."""
        assert job.max_new_tokens is not None
        if job.state == "running" and job.estimate_clipped:
            self._clipped -= 1
        elif job.state == "running":
            self._unclipped -= 1
            self._unclipped_const -= job.max_new_tokens - job.generated + job.run_start
        if clipped is True:
            self._clipped += 1
            unclips_at = job.run_start + job.max_new_tokens - job.generated - CLIP_MAX_NEW_TOKENS
            heapq.heappush(self._clip_heap, (unclips_at, next(self._order), job.run_start, job))
        elif clipped is False:
            self._unclipped += 1
            self._unclipped_const += job.max_new_tokens - job.generated + job.run_start
        job.estimate_clipped = bool(clipped)

    def _admit(self) -> None:
        self._since_admission_check = 0
        if self._head() is None or self.running >= self.params.max_running_requests:
            return
        budget = self._budget()
        prefill_left = self.params.max_prefill_tokens
        admitted = 0
        while (job := self._head()) is not None and self.running < self.params.max_running_requests:
            kv = job.prompt_tokens + job.generated
            total = kv + job.estimate(job.generated)
            if total >= budget:
                break
            first = job.admitted_at is None
            cached = self._lookup(job) if first else 0
            computed = kv - cached
            if computed >= prefill_left and admitted:
                break
            self.queue.popleft()
            self.queued -= 1
            self._start(job, first)
            budget -= total
            prefill_left -= computed
            self._prefill_pending += computed
            admitted += 1

    def _lookup(self, job: Job) -> int:
        """Prompt tokens already in the prefix cache (at most all but the last, which must be computed), then the
        prompt joins the cache (SGLang inserts it after its prefill)."""
        if self.prefix_cache is None or job.prompt_ids is None:
            return 0
        ids = job.prompt_ids
        end = len(ids) - 1 if job.match_limit is None else max(0, min(job.match_limit, len(ids) - 1))
        job.cached_tokens = self.prefix_cache.match(ids[:end])
        self.prefix_cache.insert(ids)
        return job.cached_tokens

    def _cache_finished(self, job: Job) -> None:
        """A finished request's prompt and output join the cache: SGLang inserts the whole sequence it computed
        (0.5.9 mem_cache/radix_cache.py:446-460 `origin_input_ids + output_ids`; 0.5.23 mem_cache/radix_cache.py:510-513
        `full_untruncated_fill_ids`), so a conversation's next turn, whose prompt extends this one's prompt and
        output, finds both cached."""
        if self.prefix_cache is not None and job.prompt_ids is not None and job.output_ids:
            self.prefix_cache.insert([*job.prompt_ids, *job.output_ids])

    def _start(self, job: Job, first: bool) -> None:
        job.state = "started"  # not yet counted in the estimate sums
        job.run_start = self.step
        self._track_estimate(job, clipped=(job.max_new_tokens or 0) - job.generated > CLIP_MAX_NEW_TOKENS)
        job.state = "running"
        job.finish_step = self.step + (job.output_tokens - job.generated) - 1
        if first:
            job.admitted_at = self.boundary
            self._just_admitted.append(job)
        heapq.heappush(self._heap, (job.finish_step, next(self._order), job))
        self._running.add(job)
        self._kv_const += job.prompt_tokens + job.generated - job.run_start

    def _release(self, job: Job) -> None:
        self._unclip(self.step)
        self._track_estimate(job, clipped=None)
        self._running.discard(job)
        self._kv_const -= job.prompt_tokens + job.generated - job.run_start
        job.state = "released"

    # ---- internals: running steps -------------------------------------------------------------------------
    def _top(self) -> Job | None:
        while self._heap:
            finish_step, _, job = self._heap[0]
            if job.state == "running" and job.finish_step == finish_step and not job.cancelled:
                return job
            heapq.heappop(self._heap)
        return None

    def _stretch_length(self) -> int:
        """Steps from the boundary until the next change: a completion, the pool filling up, an admission check."""
        top = self._top()
        assert top is not None
        steps = top.finish_step - self.step + 1
        room = self.params.max_total_tokens - self._kv_const
        steps = min(steps, room // self.running - self.step)  # the first step whose tokens would not fit
        if self.queued and self.running < self.params.max_running_requests:
            steps = min(steps, self.params.admission_check_steps - self._since_admission_check)
        if self.step_time.depends_on_kv:
            steps = min(steps, self.params.max_stretch_steps)
        return max(1, steps)

    def _stretch_seconds(self, steps: int) -> float:
        dt = self.step_time.decode_seconds(self.running, self.used_tokens())
        return self.step_time.prefill_seconds(self._prefill_pending) + steps * dt

    def _run_stretch(self, now: float) -> None:
        """Run the stretch from the boundary, or its steps that begin by `now`."""
        planned = self._stretch_length()
        dt = self.step_time.decode_seconds(self.running, self.used_tokens())
        first_end = self.boundary + dt + self.step_time.prefill_seconds(self._prefill_pending)
        for job in self._just_admitted:
            job.first_token_at = first_end
        self._just_admitted.clear()
        self._prefill_pending = 0
        # Step j of the stretch (j >= 1) begins at first_end + (j - 1) * dt; step 0 began at the boundary.
        startable = 0 if now < first_end else 1 + math.floor((now - first_end) / dt)
        steps = min(planned, 1 + startable)
        self.generated_tokens += self.running * steps
        self.boundary = first_end + (steps - 1) * dt
        self.step += steps
        self._since_admission_check += steps
        self.new_token_ratio = max(self.params.min_ratio, self.new_token_ratio - self.params.ratio_decay * steps)
        self._finish_step(self.step - 1)

    # ---- lockstep: a DP-attention group stepped by its replica (lockstep.py) --------------------------------
    def begin_step(self, now: float) -> None:
        """At a shared step boundary: retract if the pool is full, then admit (what advance_to does per stretch)."""
        self.boundary = now
        self._retract_if_full()
        self._admit()

    def steps_to_change(self) -> int | None:
        """Steps until this group's batch next changes; None when it runs nothing."""
        return self._stretch_length() if self._running else None

    def run_steps(self, steps: int, first_seconds: float, dt: float) -> None:
        """Run `steps` steps whose lengths the replica decides: the first `first_seconds` (the shared prefill
        included), each further one `dt`."""
        first_end = self.boundary + first_seconds
        for job in self._just_admitted:
            job.first_token_at = first_end
        self._just_admitted.clear()
        self._prefill_pending = 0
        self.generated_tokens += self.running * steps
        self.boundary = first_end + (steps - 1) * dt
        self.step += steps
        self._since_admission_check += steps
        self.new_token_ratio = max(self.params.min_ratio, self.new_token_ratio - self.params.ratio_decay * steps)
        self._finish_step(self.step - 1)

    def take_finished(self) -> list[Job]:
        done = list(self._pending)
        self._pending.clear()
        return done

    @property
    def prefill_pending(self) -> int:
        return self._prefill_pending

    def _finish_step(self, step: int) -> None:
        while (top := self._top()) is not None and top.finish_step == step:
            heapq.heappop(self._heap)
            self._release(top)
            top.finished_at = self.boundary
            top.state = "done"
            self._cache_finished(top)
            self.completed += 1
            self._pending.append(top)
