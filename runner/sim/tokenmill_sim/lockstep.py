"""One SGLang server with DP attention: `groups` schedulers (one CapacityModel each) stepped in lockstep. Pure.

What it follows from SGLang 0.5.23:
- Every group runs the same forward at the same time (the MoE between the attention layers gathers all groups'
  tokens, layers/dp_attention.py:661-755), so a step lasts as long as the replica's batch takes, and an idle group
  runs it too.
- The decode CUDA graph replays only when the largest group's batch fits the captured batch and no group is
  prefilling (model_executor/runner/decode_cuda_graph_runner.py:871-895); otherwise every group runs eager, at
  `eager_factor` x the graph step (a parameter: the eager penalty has to be measured on the GPUs).
- Each group admits with schedule_conservativeness x 0.3 (arg_groups/parallel_hook.py:318); the caller passes the
  per-group SchedulerParams with it applied.
- Dispatch: round_robin by default (arg_groups/serving_hook.py:222-233), or total_tokens: the group with the fewest
  tokens, ties to the fewest requests, counting the new prompt at once (managers/data_parallel_controller.py:139-155,
  :918-925).

The runner side is closed-loop: `inflight` requests are outstanding, and each completion sends the next (tokenmill's
runner keeps its concurrency full). Observations are what a /metrics scrape sees: running requests, KV tokens in
use and the step time of each stretch, with whether it ran eager.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from .capacity import CapacityModel, Job, SchedulerParams


@dataclass(frozen=True)
class Observation:
    """One stretch of equal steps: the replica's batch, its mean KV tokens per request and the step time."""

    clock: float
    running: int
    context_tokens: float
    step_seconds: float
    steps: int
    eager: bool
    max_group_batch: int


@dataclass
class LockstepResult:
    seconds: float = 0.0
    steps: int = 0
    eager_steps: int = 0
    completed: int = 0
    retracted: int = 0
    generated_tokens: int = 0
    batch_steps: float = 0.0  # sum over steps of the running requests
    observations: list[Observation] = field(default_factory=list)

    @property
    def eager_share(self) -> float:
        return self.eager_steps / self.steps if self.steps else 0.0

    @property
    def mean_batch(self) -> float:
        return self.batch_steps / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


class LockstepReplica:
    def __init__(self, groups: int, params: SchedulerParams, decode_seconds: Callable[[int, float], float],
                 prefill_seconds: Callable[[int], float], graph_bs: int, eager_factor: float = 1.3,
                 dispatch: str = "round_robin") -> None:
        if dispatch not in ("round_robin", "total_tokens"):
            raise ValueError(f"dispatch {dispatch!r}: round_robin or total_tokens")
        self.groups = [CapacityModel(params) for _ in range(groups)]
        self.decode_seconds = decode_seconds  # (replica batch, mean KV tokens per request) -> graph step seconds
        self.prefill_seconds = prefill_seconds  # prompt tokens of one shared extend forward -> seconds
        self.graph_bs = graph_bs
        self.eager_factor = eager_factor
        self.dispatch = dispatch
        self._next = 0
        self.clock = 0.0
        self.outstanding = 0

    def _target(self, job: Job) -> CapacityModel:
        if self.dispatch == "round_robin":
            group = self.groups[self._next % len(self.groups)]
            self._next += 1
            return group

        def load(g: CapacityModel) -> tuple[int, int]:
            queued = sum(j.prompt_tokens + j.generated for j in g.queue if not j.cancelled)
            return g.used_tokens() + queued, g.running + g.queued

        return min(self.groups, key=load)

    def submit(self, job: Job) -> None:
        job.arrival = self.clock
        self.outstanding += 1
        self._target(job).submit(job)

    def run(self, jobs: Iterable[Job] | Iterator[Job], inflight: int, until: float | None = None,
            result: LockstepResult | None = None) -> LockstepResult:
        """Run `jobs` closed-loop with up to `inflight` outstanding, to the end or until the clock passes `until`.
        Called again with the same iterator and a larger `inflight`, it continues (a concurrency ramp)."""
        result = result or LockstepResult()
        source: Iterator[Job] = iter(jobs)
        while self.outstanding < inflight:
            job = next(source, None)
            if job is None:
                break
            self.submit(job)
        while until is None or self.clock < until:
            for group in self.groups:
                group.begin_step(self.clock)
            active = [g for g in self.groups if g.running]
            if not active:
                break
            steps = min(s for g in active if (s := g.steps_to_change()) is not None)
            prefill = sum(g.prefill_pending for g in self.groups)
            running = sum(g.running for g in self.groups)
            kv = sum(g.used_tokens() for g in self.groups)
            largest = max(g.running for g in self.groups)
            eager = largest > self.graph_bs
            graph_dt = self.decode_seconds(running, kv / running)
            dt = graph_dt * (self.eager_factor if eager else 1.0)
            # The extend forward of a prefill runs eager too; it is its own cost, then the decode steps follow.
            first = dt + (self.prefill_seconds(prefill) if prefill else 0.0)
            for group in self.groups:
                if group.running:
                    group.run_steps(steps, first, dt)
            elapsed = first + (steps - 1) * dt
            result.observations.append(Observation(self.clock, running, kv / running, dt, steps, eager, largest))
            self.clock += elapsed
            result.steps += steps
            result.eager_steps += steps if eager else 0
            result.batch_steps += running * steps
            result.generated_tokens += running * steps
            for group in self.groups:
                group.boundary = self.clock
                for _ in group.take_finished():
                    result.completed += 1
                    self.outstanding -= 1
                    follow = next(source, None) if self.outstanding < inflight else None
                    if follow is not None:
                        self.submit(follow)
        result.seconds = self.clock
        result.retracted = sum(g.retracted_total for g in self.groups)
        return result
