"""What a job asks of a server: the samples, their prompt and output lengths, and how long a server layout takes
to finish them, the draining tail included. Pure.

Prompt lengths come from a bounded sample of each dataset's rows, tokenized at plan time (`LengthSample`, built by
the plan's edge, operator/tokenmill_operator/observe/workload_sample.py); without one, PROMPT_TOKENS_ESTIMATE stands in.
Output lengths come from the sampled rows' earlier answers (the assistant turns being regenerated) when at least
MIN_ANSWERS of them carry one; otherwise, unless a fixed length is given, each dataset's outputs follow the seeds'
shape (DESIGN.md "Throughput: the tail decides the makespan": median ~470, p90 ~3,700, mean ~1,360 and 3 % at a
10,240 cap): a log-normal with that median and p90, cut at the dataset's maxNewTokens (the cut share finishes with
`length`). The tail matters twice: a long request holds its KV for a long time, so the requests running at any
moment are longer than the average one (the batch the KV cache holds is smaller), and the last minutes of a job
are a few long requests on an otherwise idle server.

The job's time comes from a small event simulation of continuous batching on representative requests: a server
keeps `slots` requests running, admits the next in input order (datasets longest-expected first, as the runner
sends them; within a dataset the runner also sends rows with longer earlier answers first, which the plan cannot
see before the run, so it assumes an order unrelated to length: the conservative side) when one finishes, and
spends a prefill forward on the admitted prompts. Steps between two events have the same length, so the cost is per
request, never per token.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from statistics import NormalDist

# The seeds' output lengths (DESIGN.md; seed 001): median ~470 tokens, p90 ~3,700.
SEEDS_MEDIAN_OUTPUT = 470
SEEDS_P90_OUTPUT = 3700
_Z90 = NormalDist().inv_cdf(0.9)
SEEDS_SIGMA = math.log(SEEDS_P90_OUTPUT / SEEDS_MEDIAN_OUTPUT) / _Z90

# Prompts are unknown before tokenizing: a flat estimate (the seeds' datasets averaged ~75 to ~1,130 tokens).
PROMPT_TOKENS_ESTIMATE = 512
# A dataset without `limit` has an unknown number of rows at plan time; ETAs assume this many.
SAMPLES_ASSUMED = 10_000
# Earlier answers a sample needs before their lengths stand for the dataset's outputs: fewer leave the seeds' shape.
MIN_ANSWERS = 50
# Headroom over the longest sampled prompt for --context-length: rows outside the sample may be longer. A row over
# the context is refused as prompt_too_long by the runner and named in the report; spec.server.contextLength wins.
CONTEXT_PROMPT_HEADROOM = 2.0
CONTEXT_ROUND = 1024
# Representative requests simulated per replica; a larger job is the simulated one scaled at the steady rate.
SIMULATED_REQUESTS = 4000
_QUANTILE_POINTS = 1000
_SEEDS_QUANTILES = tuple(
    math.exp(math.log(SEEDS_MEDIAN_OUTPUT) + SEEDS_SIGMA * NormalDist().inv_cdf((i + 0.5) / _QUANTILE_POINTS))
    for i in range(_QUANTILE_POINTS))


def quantiles(values: Sequence[int], points: int = _QUANTILE_POINTS) -> tuple[int, ...]:
    """`points` values at evenly spaced quantiles of a sample (nearest rank): the sample's distribution in a fixed
    number of values, whatever its size."""
    ordered = sorted(values)
    if not ordered:
        return ()
    return tuple(ordered[min(len(ordered) - 1, int((i + 0.5) / points * len(ordered)))] for i in range(points))


@dataclass(frozen=True)
class LengthSample:
    """What a bounded sample of one dataset's rows says: its rendered prompts' token counts and, for the rows that
    carry one, their earlier answers' token counts."""

    rows: int
    prompt_tokens: tuple[int, ...]
    answer_tokens: tuple[int, ...] = ()

    @property
    def mean_prompt(self) -> int:
        return round(sum(self.prompt_tokens) / len(self.prompt_tokens)) if self.prompt_tokens else 0

    @property
    def longest_prompt(self) -> int:
        return max(self.prompt_tokens, default=0)

    def describe(self) -> str:
        if not self.prompt_tokens:
            return f"{self.rows:,} rows read, none tokenized"
        q = quantiles(self.prompt_tokens, 100)
        answers = (f"; {len(self.answer_tokens):,} earlier answers, median {quantiles(self.answer_tokens, 100)[50]:,}"
                   if self.answer_tokens else "; no earlier answers")
        return (f"{len(self.prompt_tokens):,} rows tokenized: prompt mean {self.mean_prompt:,}, median {q[50]:,}, "
                f"p90 {q[90]:,}, max {self.longest_prompt:,}{answers}")


@dataclass(frozen=True)
class DatasetLoad:
    """One dataset as the planner sees it: how many samples, and how long their prompts and outputs are."""

    name: str
    samples: int
    samples_known: bool  # False: no `limit`, SAMPLES_ASSUMED stands in
    max_new_tokens: int
    prompt_tokens: int = PROMPT_TOKENS_ESTIMATE
    output_tokens: int | None = None  # a fixed output length (tokenmill plan --output-tokens), else the seeds' shape
    sample: LengthSample | None = None  # the dataset's tokenized sample, when the plan read one

    @property
    def prompt_sampled(self) -> bool:
        return self._sampled is not None

    @property
    def _sampled(self) -> LengthSample | None:
        """The sample when it holds prompt lengths."""
        return self.sample if self.sample is not None and self.sample.prompt_tokens else None

    @property
    def outputs_from_answers(self) -> bool:
        return self.output_tokens is None and self.sample is not None and len(self.sample.answer_tokens) >= MIN_ANSWERS

    @property
    def longest_prompt(self) -> int:
        sample = self._sampled
        return max(self.prompt_tokens, sample.longest_prompt if sample else 0)

    def prompt_lengths(self) -> tuple[int, ...]:
        """Prompt lengths at evenly spaced quantiles: the sample's, else the flat estimate."""
        return self._prompts

    @cached_property
    def _prompts(self) -> tuple[int, ...]:
        sample = self._sampled
        if sample is not None:
            return quantiles(sample.prompt_tokens)
        return (self.prompt_tokens,) * _QUANTILE_POINTS

    def output_lengths(self) -> tuple[int, ...]:
        """Output lengths at evenly spaced quantiles: the dataset's distribution in _QUANTILE_POINTS values."""
        return self._lengths

    @cached_property
    def _lengths(self) -> tuple[int, ...]:
        if self.output_tokens is not None:
            return (max(1, min(self.output_tokens, self.max_new_tokens)),) * _QUANTILE_POINTS
        if self.outputs_from_answers and self.sample is not None:
            return tuple(max(1, min(self.max_new_tokens, n)) for n in quantiles(self.sample.answer_tokens))
        return tuple(max(1, min(self.max_new_tokens, round(length))) for length in _SEEDS_QUANTILES)

    def mean_output(self) -> float:
        lengths = self.output_lengths()
        return sum(lengths) / len(lengths)

    def capped_share(self) -> float:
        lengths = self.output_lengths()
        return sum(length >= self.max_new_tokens for length in lengths) / len(lengths)


@dataclass(frozen=True)
class Workload:
    datasets: tuple[DatasetLoad, ...]
    concurrency: int | None = None  # the runner's requests in flight over all servers, when fixed

    @property
    def samples(self) -> int:
        return sum(d.samples for d in self.datasets)

    @property
    def samples_known(self) -> bool:
        return all(d.samples_known for d in self.datasets)

    def output_tokens(self) -> float:
        return sum(d.samples * d.mean_output() for d in self.datasets)

    def prompt_tokens(self) -> float:
        return sum(d.samples * d.prompt_tokens for d in self.datasets) / max(self.samples, 1)

    @cached_property
    def held(self) -> float:
        return self.held_tokens()

    def held_tokens(self) -> float:
        """KV tokens a running request holds on average over time. Requests are weighted by how long they run,
        so the long tail counts more than its share: prompt + E[o^2] / (2 E[o]) rather than prompt + E[o] / 2."""
        first = second = prompt = 0.0
        for dataset in self.datasets:
            lengths = dataset.output_lengths()
            n = dataset.samples / len(lengths)
            first += n * sum(lengths)
            second += n * sum(length * length for length in lengths)
            prompt += n * sum(lengths) * dataset.prompt_tokens
        return (prompt + second / 2) / max(first, 1.0)

    def longest_tokens(self) -> int:
        return max(d.longest_prompt + d.max_new_tokens for d in self.datasets)

    def needed_context(self) -> int | None:
        """The --context-length the job needs: the longest sampled prompt with CONTEXT_PROMPT_HEADROOM, plus the
        dataset's maxNewTokens, rounded up to CONTEXT_ROUND; None unless every dataset's prompts were sampled."""
        if not self.datasets or not all(d.prompt_sampled for d in self.datasets):
            return None
        need = max(math.ceil(d.longest_prompt * CONTEXT_PROMPT_HEADROOM) + d.max_new_tokens for d in self.datasets)
        return math.ceil(need / CONTEXT_ROUND) * CONTEXT_ROUND

    def requests(self, count: int) -> list[tuple[int, int]]:
        """`count` representative (prompt, output) pairs in the order the runner sends them: datasets with the
        longest expected outputs first, each in an order unrelated to length (a fixed stride over its
        quantiles)."""
        total = max(self.samples, 1)
        ordered = sorted(self.datasets, key=lambda d: -d.mean_output())
        result: list[tuple[int, int]] = []
        for dataset in ordered:
            result += self.dataset_requests(dataset, max(1, round(count * dataset.samples / total)))
        return result

    @staticmethod
    def dataset_requests(dataset: DatasetLoad, share: int) -> list[tuple[int, int]]:
        """`share` (prompt, output) pairs of one dataset, each length in an order unrelated to the other's."""
        lengths, prompts = dataset.output_lengths(), dataset.prompt_lengths()
        stride = _coprime_stride(len(lengths))
        return [(prompts[(i * 7919) % len(prompts)], lengths[(i * stride) % len(lengths)]) for i in range(share)]

    def dataset_shares(self, count: int) -> list[tuple[str, int]]:
        """(dataset, requests) in the order requests() lists them."""
        total = max(self.samples, 1)
        ordered = sorted(self.datasets, key=lambda d: -d.mean_output())
        return [(d.name, max(1, round(count * d.samples / total))) for d in ordered]


def _coprime_stride(n: int) -> int:
    stride = max(1, round(n * 0.6180339887))
    while math.gcd(stride, n) != 1:
        stride += 1
    return stride


@dataclass(frozen=True)
class JobTime:
    seconds: float  # makespan of one replica's share
    output_tokens: float  # that share's output tokens
    steady_tokens_per_second: float  # full batch, prefill included
    # (dataset, seconds from the first request until its last sample is done), in the order the runner sends them
    datasets: tuple[tuple[str, float], ...] = ()


def simulate(requests: Sequence[tuple[int, int]], slots: int, step_seconds: Callable[[int], float],
             prefill_seconds: Callable[[float, float], float], finished: list[float] | None = None) -> float:
    """Seconds one server takes for `requests` (prompt, output) in order, keeping up to `slots` running; with
    `finished`, the clock at which each request finished is written there, by position.

    Each admission boundary costs one prefill forward over the admitted prompts; a request admitted at step k with
    n output tokens finishes at the end of step k + n - 1."""
    slots = max(1, slots)
    record: list[float] = finished if finished is not None else []
    record[:] = [0.0] * len(requests)
    owners: dict[int, list[int]] = {}  # finish step -> positions finishing then
    running: list[int] = []  # finish step of each running request (a heap)
    step = 0
    clock = 0.0
    position = 0
    while position < len(requests) or running:
        admitted_tokens = 0.0
        admitted = 0
        while position < len(requests) and len(running) < slots:
            prompt, output = requests[position]
            heapq.heappush(running, step + max(1, output))
            owners.setdefault(step + max(1, output), []).append(position)
            admitted_tokens += prompt
            admitted += 1
            position += 1
        if admitted:
            clock += prefill_seconds(admitted_tokens, admitted_tokens / admitted)
        next_finish = running[0]
        clock += (next_finish - step) * step_seconds(len(running))
        step = next_finish
        while running and running[0] <= step:
            done = heapq.heappop(running)
            for index in owners.pop(done, ()):
                record[index] = clock
    return clock


def job_time(workload: Workload, replicas: int, slots: int, step_seconds: Callable[[int], float],
             prefill_seconds: Callable[[float, float], float]) -> JobTime:
    """How long `replicas` servers, each keeping `slots` requests running, take for the workload.

    One replica's share is simulated on at most SIMULATED_REQUESTS representative requests; a larger share adds
    its remaining tokens at the steady full-batch rate (the drain at the end is in the simulated part)."""
    step_seconds, prefill_seconds = cache(step_seconds), cache(prefill_seconds)  # called once per event
    share = workload.samples / max(replicas, 1)
    mean_output = workload.output_tokens() / max(workload.samples, 1)
    prompt = workload.prompt_tokens()
    # At the full batch, slots / mean_output requests finish per step and as many prompts are prefilled, in one
    # forward per step at most.
    admitted = slots / max(mean_output, 1.0)
    forwards = min(1.0, admitted)
    prefill = forwards * prefill_seconds(admitted * prompt / forwards, prompt)
    steady = slots / (step_seconds(slots) + prefill)
    simulated = min(max(1, math.ceil(share)), SIMULATED_REQUESTS)
    requests = workload.requests(simulated)
    finished: list[float] = []
    simulated_seconds = simulate(requests, slots, step_seconds, prefill_seconds, finished)
    seconds = simulated_seconds
    simulated_tokens = float(sum(output for _, output in requests))
    tokens = share * mean_output
    if tokens > simulated_tokens:
        seconds += (tokens - simulated_tokens) / steady
    # A dataset is done when its last request is: its share of the simulated makespan, scaled to the whole job.
    scale = seconds / simulated_seconds if simulated_seconds else 0.0
    per_dataset, start = [], 0
    for name, count in workload.dataset_shares(simulated):
        part = finished[start:start + count]
        if part:
            per_dataset.append((name, max(part) * scale))
        start += count
    return JobTime(seconds=seconds, output_tokens=tokens, steady_tokens_per_second=steady,
                   datasets=tuple(per_dataset))
