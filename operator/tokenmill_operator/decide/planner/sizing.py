"""The numbers of a server plan: the SGLang release and GPU, the job's lengths, every server layout that could run
on the GPUs the spec gives (tensor parallelism, DP attention, replicas, KV cache dtype), each with its memory
arithmetic (`memory.py`) and its predicted throughput and ETA (runner `throughput.py` + `workload.py`), and the
one chosen. Pure. `explain.py` renders the reasoning from a `Sizing`; nothing here writes prose except the errors,
which name the spec field to change.

The objective: finish the job soonest on the GPUs the spec gives. `spec.server.nodes` (auto: the fewest nodes one
replica needs) times gpusPerNode GPUs are held for the whole run whatever runs on them, so the layout with the
smallest ETA also spends the fewest GPU-hours; ties (within TIE) go to the layout with fewer GPU-hours, then the
simpler one. When the spec fixes `replicas`, layouts use different numbers of GPUs: the ETA still decides, and the
table shows the GPU-hours beside it. Anything set in the spec wins; the alternatives stay in the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tokenmill_runner.facts.hardware import Gpu
from tokenmill_runner.facts.hidden_states import StateShape, kinds_needed
from tokenmill_runner.facts.intervals import interval
from tokenmill_runner.facts.model_facts import ModelFacts
from tokenmill_runner.facts.throughput import CALIBRATION, Calibration, Layout, StepModel, serving_tokens_per_second
from tokenmill_runner.facts.workload import (
    PROMPT_TOKENS_ESTIMATE,
    SAMPLES_ASSUMED,
    DatasetLoad,
    JobTime,
    Workload,
    job_time,
)
from tokenmill_runner.spec.resource import DatasetGenerationSpec

from .attention import AttentionBackend, attention_backend
from .capture import EAGLE3_LAYERS, CaptureLoad, CaptureTime, capture_time
from .dp_attention import graph_capped_max_running, load_balance_method
from .memory import (
    Capacity,
    chunk_and_graph_bs,
    kv_dtype_bytes,
    mm_reserved_from_kv,
    replica_capacity,
    sglang_default_max_running_requests,
    sglang_default_mem_fraction,
    sglang_reserve,
)
from .memory_budget import MemorySplit, chunk_options, decided_split, graph_bs_for, known
from .plan import Candidate, DatasetEta, MemoryTerm, PlanError, Prediction, PredictionRange, ServerPlan
from .serving import (
    ServerImage,
    ServingRelease,
    check_architecture,
    check_hidden_states,
    check_image,
    check_kv_cache_dtype,
    context_length,
    gpu_memory_mib,
    gpu_product,
    server_image,
    serving_release,
)
from .units import gib

# --------------------------------------------------------------------------------------------------------------
# Rules. Each is a choice; the reasoning lines repeat them so a reader of a plan can check the arithmetic.

# Largest group of nodes one replica may span. Beyond this a second replica gives more than NCCL across many
# nodes does, and the operator's multi-node path is tested this far.
MAX_NODES_PER_REPLICA = 4

# Below this many running requests per replica the plan warns: decode throughput grows with the batch (DESIGN.md:
# keep the server's batch full), and a small batch spends most of each step on fixed cost. Without a known GPU
# product (only its memory) no throughput can be predicted, and the smallest TP that holds this many is chosen.
MIN_BATCH_REQUESTS = 32

# ETAs within this share of each other are a tie (the model's error is larger than that).
TIE = 0.02

# The KV dtype shown as an option when the spec leaves kvCacheDtype auto: half the bytes of the 16-bit cache, at
# some risk to output fidelity, so never chosen without the spec saying so.
FP8_OPTION = "fp8_e4m3"

# SGLang flags in spec.server.extraArgs that take the memory split out of the planner's hands: with any of them
# the plan keeps SGLang's default rule (extraArgs come last, so the user's value is what SGLang runs with).
MEMORY_FLAGS = ("--mem-fraction-static", "--chunked-prefill-size", "--cuda-graph-max-bs", "--max-total-tokens")


# --------------------------------------------------------------------------------------------------------------
# The job.


def workload(spec: DatasetGenerationSpec, prompt_tokens: int | None = None, output_tokens: int | None = None,
             concurrency: int | None = None) -> Workload:
    """The datasets as lengths and counts; fixed prompt/output lengths and concurrency override the estimates."""
    loads = []
    for dataset in spec.datasets:
        cap = spec.sampling_for(dataset).max_new_tokens or spec.sampling.max_new_tokens
        loads.append(DatasetLoad(
            # n samples per prompt are n requests each (the prompt's prefix is cached, the outputs are not).
            name=dataset.name, samples=(dataset.limit or SAMPLES_ASSUMED) * dataset.samples,
            samples_known=dataset.limit is not None,
            max_new_tokens=cap, prompt_tokens=prompt_tokens or PROMPT_TOKENS_ESTIMATE,
            output_tokens=output_tokens))
    runner = spec.runner.concurrency
    fixed = concurrency or (runner * spec.runner.parallelism if isinstance(runner, int) else None)
    return Workload(tuple(loads), concurrency=fixed)


# --------------------------------------------------------------------------------------------------------------
# The layout checks.


def tp_fits_model(model: ModelFacts, layout: Layout) -> str | None:
    """Why the model's heads cannot be split over an attention group (SGLang asserts on it), or None when they can."""
    a = layout.attention_tp
    if model.num_attention_heads % a:
        return f"{model.num_attention_heads} attention heads do not split into {a}"
    kv = model.num_kv_heads
    if not model.is_mla and (kv % a if kv >= a else a % kv):
        return f"{kv} KV heads do not split evenly over {a} ranks"
    return None


def tp_fits_nodes(tp: int, gpus_per_node: int) -> str | None:
    """Why tp GPUs cannot be laid out as whole nodes of gpus_per_node, or None when they can."""
    if tp < 1 or tp & (tp - 1):
        return f"{tp} is not a power of two"
    if tp > gpus_per_node and tp % gpus_per_node:
        return f"{tp} GPUs do not fill whole nodes of {gpus_per_node} (spec.server.gpusPerNode)"
    if tp > gpus_per_node * MAX_NODES_PER_REPLICA:
        return (f"{tp} GPUs need more than {MAX_NODES_PER_REPLICA} nodes of {gpus_per_node} "
                f"(spec.server.gpusPerNode), the most one replica may span")
    return None


# --------------------------------------------------------------------------------------------------------------
# One layout.


@dataclass(frozen=True)
class Option:
    """One server layout on the GPUs: its memory, its batch and (with a known GPU) its predicted job time."""

    layout: Layout
    kv_cache_dtype: str
    replicas: int
    nodes_per_replica: int
    eligible: bool  # False: shown as an option the spec would have to allow (an fp8 cache when it says auto)
    unusable: str | None = None
    not_allowed: str | None = None  # the spec field that rules this layout out (it fixes another value)
    mem_fraction: float = 0.0
    graph_bs: int | None = None
    memory: MemorySplit | None = None
    capacity: Capacity | None = None
    max_running: int = 0
    batch: int = 0
    job: JobTime | None = None
    capture: CaptureTime | None = None  # the hidden-state pass after the stream (spec.hiddenStates)
    bound: str = ""

    @property
    def gpus(self) -> int:
        return self.replicas * self.layout.tp

    @property
    def runs(self) -> bool:
        return self.unusable is None and self.capacity is not None

    @property
    def choosable(self) -> bool:
        return self.runs and self.eligible and self.not_allowed is None and self.batch > 0

    @property
    def eta(self) -> float:
        """Generation plus the capture pass: the GPUs are held through both, so both decide the layout."""
        if self.job is None:
            return math.inf
        return self.job.seconds + (self.capture.seconds if self.capture else 0.0)

    @property
    def gpu_hours(self) -> float:
        return self.eta * self.gpus / 3600

    def decode_tokens_per_second(self, step: StepModel | None, held: float) -> int:
        if step is None or not self.batch:
            return 0
        return round(self.replicas * step.decode_tokens_per_second(self.batch, held))

    def step_slope(self, step: StepModel | None, held: float) -> float | None:
        """d step / d context at the batch (seconds per KV token; the step is linear in it while memory-bound)."""
        if step is None or not self.batch:
            return None
        delta = max(held, 1.0) * 0.1
        slope = (step.step_seconds(self.batch, held + delta) - step.step_seconds(self.batch, held)) / delta
        return float(f"{slope:.6g}")

    def prediction(self, step: StepModel | None, held: float, work: Workload) -> Prediction | None:
        if self.job is None:
            return None
        by_name = {d.name: d for d in work.datasets}
        datasets = []
        for name, seconds in self.job.datasets:
            d = by_name[name]
            output = ("fixed" if d.output_tokens is not None else "earlier answers" if d.outputs_from_answers
                      else "seeds' shape")
            datasets.append(DatasetEta(
                name=name, samples=d.samples, prompt_tokens=d.prompt_tokens,
                prompt_source="sampled" if d.prompt_sampled else "assumed", mean_output_tokens=round(d.mean_output()),
                output_source=output, done_seconds=round(seconds)))
        return Prediction(
            datasets=datasets,
            decode_tokens_per_second=self.decode_tokens_per_second(step, held),
            output_tokens_per_second=round(self.replicas * self.job.output_tokens / self.job.seconds),
            eta_seconds=round(self.eta), gpu_hours=round(self.gpu_hours, 1),
            capture_seconds=round(self.capture.seconds) if self.capture else None,
            capture_bound=self.capture.bound if self.capture else None,
            batch_per_replica=self.batch, bound=self.bound, samples=work.samples,
            samples_assumed=not work.samples_known, held_kv_tokens=round(held) if step and self.batch else None,
            step_seconds_per_kv_token=self.step_slope(step, held))


@dataclass(frozen=True)
class Context:
    """What every option shares."""

    spec: DatasetGenerationSpec
    model: ModelFacts
    gpu: Gpu | None
    gpu_memory_mib: int
    serving: ServingRelease
    work: Workload
    context_length: int
    attention_backend: str | None = None  # the backend the plan passes; None: SGLang picks by GPU and model
    calibration: Calibration = CALIBRATION  # the published fit, or the cluster's refitted constants (verify.py)

    @property
    def held(self) -> float:
        return self.work.held

    @property
    def aux_layers(self) -> int:
        """Hidden-state layers the server captures (0 without spec.hiddenStates)."""
        states = self.spec.hidden_states
        if states is None:
            return 0
        return len(states.layer_ids) if states.layer_ids is not None else EAGLE3_LAYERS

    @property
    def capture_bytes_per_token(self) -> int:
        """Bytes of one token's hidden states as served (0 without spec.hiddenStates): the capture pass moves them as
        JSON, whatever spec.hiddenStates.storage keeps of them (fp8 is quantized after the parse)."""
        states = self.spec.hidden_states
        if states is None:
            return 0
        return StateShape(self.aux_layers, self.model.hidden_size, states.dtype).bytes_per_token

    def capture(self, step: StepModel) -> CaptureTime | None:
        per_token = self.capture_bytes_per_token
        if not per_token:
            return None
        loads = [CaptureLoad(d.name, d.samples, d.prompt_tokens + d.mean_output()) for d in self.work.datasets]
        aux = capture_time(loads, per_token, self.spec.runner.parallelism, step.chunk_tokens, step.step_seconds,
                           step.chunked_prefill_seconds)
        states = self.spec.hidden_states
        if states is None or "final" not in kinds_needed(list(states.layouts)):
            return aux
        final_per_token = StateShape(1, self.model.hidden_size, states.dtype).bytes_per_token
        # The server's restart between the passes is a start-up, added with the others (planner/__init__.py).
        return replace(aux, final=capture_time(loads, final_per_token, self.spec.runner.parallelism,
                                               step.chunk_tokens, step.step_seconds, step.chunked_prefill_seconds))

    @property
    def decides_memory(self) -> bool:
        """Whether the plan splits the memory itself: nothing in the spec fixes it and the model is known."""
        server = self.spec.server
        flagged = any(arg.split("=")[0].startswith(MEMORY_FLAGS) for arg in server.extra_args)
        return server.mem_fraction_static == "auto" and not flagged and known(self.model)

    @property
    def kv_reserved_mib(self) -> float:
        return mm_reserved_from_kv(self.model, self.serving.release)

    def capacity(self, layout: Layout, fraction: float, element: float) -> Capacity:
        return replica_capacity(self.model, self.gpu_memory_mib, layout, fraction, element, self.kv_reserved_mib)

    def step_model(self, layout: Layout, kv_dtype: str, nodes: int, chunk: int | None = None) -> StepModel | None:
        """The step model; `chunk` is the per-group prefill chunk (None: SGLang's tier chunk // groups)."""
        if self.gpu is None:
            return None
        return StepModel(self.model, self.gpu, layout, kv_dtype_bytes(kv_dtype), self.calibration, nodes=nodes,
                         chunk=chunk)


def _mem_fraction(ctx: Context, layout: Layout, graph_bs: int | None) -> float:
    given = ctx.spec.server.mem_fraction_static
    if given != "auto":
        return float(given)
    # Rounded as the plan passes it to SGLang, so the capacity shown is the one the server gets.
    return round(sglang_default_mem_fraction(ctx.gpu_memory_mib, layout, ctx.model, ctx.serving.release, graph_bs), 3)


def _max_running(ctx: Context, cap: Capacity, graph_bs: int | None = None) -> int:
    """--max-running-requests: the spec's, else SGLang's derived value per group x groups, under DP attention
    capped at the decode graph batch x groups so that no group's batch sends the lockstep replica eager
    (dp_attention.py)."""
    given = ctx.spec.server.max_running_requests
    if given != "auto":
        return given
    groups = cap.layout.attention_dp
    derived = sglang_default_max_running_requests(cap.tokens_per_group, ctx.context_length) * groups
    return graph_capped_max_running(derived, graph_bs, groups) if graph_bs and groups > 1 else derived


def _batch(ctx: Context, cap: Capacity, max_running: int, replicas: int) -> int:
    per_group = int(cap.tokens_per_group // ctx.held)
    batch = min(max_running, per_group * cap.layout.attention_dp)
    if ctx.work.concurrency:
        batch = min(batch, math.ceil(ctx.work.concurrency / replicas))
    return max(batch, 1 if cap.tokens_per_group >= ctx.work.longest_tokens() else 0)


def _graph_bs(ctx: Context, layout: Layout, cap: Capacity) -> int | None:
    """For DP attention, a decode CUDA-graph batch sized to a group's expected batch: SGLang reserves
    graph batch x groups x 3-4.5 MiB for it (0.5.23 arg_groups/memory_hook.py:370-378), 18 GiB per GPU at its
    default 512 x 8 groups, which the KV cache needs more."""
    if layout.attention_dp == 1:
        return None
    tier = sglang_reserve(ctx.gpu_memory_mib, layout, ctx.model, ctx.serving.release).graph_bs
    per_group = cap.tokens_per_group / ctx.held if cap.tokens_per_group else 16
    return int(min(tier, max(16, math.ceil(per_group * 1.25 / 16) * 16)))


def _default_split(ctx: Context, layout: Layout, element: float) -> tuple[MemorySplit, Capacity]:
    """SGLang's own rule (or the spec's fraction), with the DP-attention graph batch sized to a group's batch."""
    fraction = _mem_fraction(ctx, layout, None)
    cap = ctx.capacity(layout, fraction, element)
    graph_bs = _graph_bs(ctx, layout, cap) if ctx.spec.server.mem_fraction_static == "auto" else None
    if graph_bs is not None:
        fraction = _mem_fraction(ctx, layout, graph_bs)
        cap = ctx.capacity(layout, fraction, element)
    chunk, _ = chunk_and_graph_bs(ctx.gpu_memory_mib, layout.tp, ctx.serving.release)
    return MemorySplit(fraction, chunk, graph_bs or 0, (), decided=False, groups=layout.attention_dp), cap


def _group_batch(ctx: Context, cap: Capacity, replicas: int) -> float:
    return _batch(ctx, cap, _max_running(ctx, cap), replicas) / cap.layout.attention_dp


def _request_rows(ctx: Context, layout: Layout, cap: Capacity | None, graph_bs: int) -> int:
    """req_to_token rows of one scheduler: its share of --max-running-requests (kv_cache_configurator.py:3128)."""
    given = ctx.spec.server.max_running_requests
    groups = layout.attention_dp
    if given != "auto":
        return max(1, given // groups)
    if cap is None:  # no pool yet: SGLang's smallest derived value
        return graph_bs if groups > 1 else 2048
    derived = sglang_default_max_running_requests(cap.tokens_per_group, ctx.context_length)
    return min(derived, graph_bs) if groups > 1 else derived


def _decided_splits(ctx: Context, layout: Layout, element: float, replicas: int) -> list[tuple[MemorySplit,
                                                                                                 Capacity]]:
    """Per prefill chunk, the split whose terms this model and layout need. The graph batch comes from the batch
    the smallest graph (16) would leave room for: any larger graph leaves less KV, so that batch is an upper bound
    and the graph sized from it covers the batch the split really holds."""
    release, mib = ctx.serving.release, ctx.gpu_memory_mib
    tier_bs = chunk_and_graph_bs(mib, layout.tp, release)[1]

    arch = ctx.gpu.arch if ctx.gpu else None

    def at(chunk: int, graph_bs: int, rows: int) -> tuple[MemorySplit, Capacity] | None:
        deterministic = ctx.spec.server.deterministic_inference
        split = decided_split(mib, layout, ctx.model, release, chunk, graph_bs, deterministic, ctx.context_length,
                              rows, arch, ctx.attention_backend, aux_layers=ctx.aux_layers)
        if split is None:
            return None
        cap = ctx.capacity(layout, split.mem_fraction, element)
        return (split, cap) if cap.fits else None

    found = []
    for chunk in chunk_options(mib, layout, release):
        # The widest split's pool bounds the requests SGLang derives, hence the req_to_token rows counted.
        smallest = min(16, tier_bs)
        widest = at(chunk, smallest, _request_rows(ctx, layout, None, smallest))
        if widest is None:
            continue
        graph_bs = graph_bs_for(_group_batch(ctx, widest[1], replicas), tier_bs)
        choice = at(chunk, graph_bs, _request_rows(ctx, layout, widest[1], graph_bs))
        if choice is not None:
            found.append(choice)
    return found


@dataclass(frozen=True)
class MemoryChoice:
    """One memory split weighed for a layout: its KV capacity, the batch that holds, and the tokens/s served at it
    with its prefill chunk (without a GPU product: the KV tokens, the only measure left)."""

    split: MemorySplit
    capacity: Capacity
    batch: int
    served: float


def memory_choices(ctx: Context, layout: Layout, kv_dtype: str, nodes: int, replicas: int) -> list[MemoryChoice]:
    """The memory splits weighed for a layout: SGLang's default (or the spec's fraction) alone, or, when the plan
    decides, the default and a decided split per prefill chunk, each that holds a request at its cap."""
    element = kv_dtype_bytes(kv_dtype)
    default = _default_split(ctx, layout, element)
    splits = [default, *_decided_splits(ctx, layout, element, replicas)] if ctx.decides_memory else [default]
    longest = ctx.work.longest_tokens()
    mean_output = ctx.work.output_tokens() / max(ctx.work.samples, 1)
    choices = []
    for split, cap in splits:
        if split is not default[0] and cap.tokens_per_group < longest:
            continue
        batch = _batch(ctx, cap, _max_running(ctx, cap, split.graph_bs or None), replicas) if cap.fits else 0
        step = ctx.step_model(layout, kv_dtype, nodes, split.group_chunk)
        served = (float(cap.tokens) if step is None or not batch
                  else serving_tokens_per_second(step, batch, ctx.work.prompt_tokens(), mean_output))
        choices.append(MemoryChoice(split, cap, batch, served))
    return choices


def evaluate(ctx: Context, layout: Layout, kv_dtype: str, replicas: int, eligible: bool) -> Option:
    gpn = ctx.spec.server.gpus_per_node
    nodes = math.ceil(layout.tp / gpn)
    option = Option(layout, kv_dtype, replicas, nodes, eligible)
    why_not = tp_fits_nodes(layout.tp, gpn) or tp_fits_model(ctx.model, layout)
    if why_not:
        return replace(option, unusable=why_not)
    best = max(memory_choices(ctx, layout, kv_dtype, nodes, replicas), key=lambda c: (c.batch > 0, c.served))
    split, cap = best.split, best.capacity
    option = replace(option, mem_fraction=split.mem_fraction, graph_bs=split.graph_bs or None, memory=split,
                     capacity=cap)
    if not cap.fits:
        return replace(option, unusable=f"weights {gib(cap.weight_bytes_per_gpu)} per GPU do not fit in "
                                      f"{gib(cap.usable_bytes)} usable")
    longest = ctx.work.longest_tokens()
    if cap.tokens_per_group < longest:
        return replace(option, unusable=f"{cap.tokens_per_group:,} KV tokens per group hold no request at its cap "
                                      f"({longest:,} tokens)")
    max_running = _max_running(ctx, cap, split.graph_bs or None)
    batch = _batch(ctx, cap, max_running, replicas)
    option = replace(option, max_running=max_running, batch=batch)
    step = ctx.step_model(layout, kv_dtype, nodes, split.group_chunk)
    if step is None:
        return option
    job = job_time(ctx.work, replicas, batch, lambda b: step.step_seconds(b, ctx.held),
                   step.chunked_prefill_seconds)
    return replace(option, job=job, capture=ctx.capture(step), bound=step.bound(batch, ctx.held))


# --------------------------------------------------------------------------------------------------------------
# Every layout, and the choice.


def _tp_sizes(ctx: Context, budget: int) -> list[int]:
    """Tensor-parallel sizes to try: powers of two that fit the budget (and MAX_NODES_PER_REPLICA) with the spec's
    replicas when it fixes them, and the spec's own size."""
    server = ctx.spec.server
    replicas = server.replicas if server.replicas != "auto" else 1
    largest = min(server.gpus_per_node * MAX_NODES_PER_REPLICA, budget // replicas)
    sizes = [2**i for i in range(0, int(math.log2(largest)) + 1)] if largest >= 1 else []
    if server.tensor_parallel != "auto" and server.tensor_parallel not in sizes:
        sizes.append(server.tensor_parallel)
    return sizes


def _dp_sizes(ctx: Context, tp: int) -> list[int]:
    """DP attention group counts to try: for MLA models every power of two up to TP (TP copies an MLA cache to every
    rank); for others none, unless the spec asks for it."""
    sizes = [2**i for i in range(0, int(math.log2(tp)) + 1) if tp % 2**i == 0] if ctx.model.is_mla else [1]
    given = ctx.spec.server.attention_data_parallel
    if given != "auto" and given not in sizes and tp % given == 0:
        sizes.append(given)
    return sizes


def _kv_dtypes(ctx: Context) -> list[tuple[str, bool]]:
    given = ctx.spec.server.kv_cache_dtype
    if given != "auto":
        return [(given, True)]
    options = [("auto", True)]
    if FP8_OPTION in ctx.serving.release.kv_cache_dtypes:
        options.append((FP8_OPTION, False))
    return options


def _replicas(ctx: Context, tp: int, budget: int) -> int:
    given = ctx.spec.server.replicas
    return given if given != "auto" else max(1, budget // tp)


def _not_allowed(ctx: Context, layout: Layout) -> str | None:
    server = ctx.spec.server
    if server.tensor_parallel != "auto" and layout.tp != server.tensor_parallel:
        return f"spec.server.tensorParallel is {server.tensor_parallel}"
    if server.attention_data_parallel != "auto" and layout.attention_dp != server.attention_data_parallel:
        return f"spec.server.attentionDataParallel is {server.attention_data_parallel}"
    return None


def _options(ctx: Context, budget: int) -> list[Option]:
    found = []
    for tp in _tp_sizes(ctx, budget):
        for dp in _dp_sizes(ctx, tp):
            for kv_dtype, eligible in _kv_dtypes(ctx):
                option = evaluate(ctx, Layout(tp, dp), kv_dtype, _replicas(ctx, tp, budget), eligible)
                option = replace(option, not_allowed=_not_allowed(ctx, option.layout))
                if (eligible and option.not_allowed is None) or option.runs:  # the rest only where it would run
                    found.append(option)
    return found


def _budget(ctx: Context) -> tuple[int, str]:
    """GPUs the spec gives: nodes x gpusPerNode; with nodes auto, the fewest nodes on which a layout runs (with the
    spec's replicas and tensorParallel when it fixes them)."""
    server = ctx.spec.server
    gpn = server.gpus_per_node
    if server.nodes != "auto":
        return server.nodes * gpn, f"spec.server.nodes {server.nodes} x gpusPerNode {gpn}"
    if server.replicas != "auto" and server.tensor_parallel != "auto":
        return server.replicas * server.tensor_parallel, "spec.server.replicas x tensorParallel"
    replicas = server.replicas if server.replicas != "auto" else 1
    for nodes in range(1, MAX_NODES_PER_REPLICA * replicas + 1):
        if any(o.choosable for o in _options(ctx, nodes * gpn)):
            label = "1 node" if nodes == 1 else f"{nodes} nodes"
            return nodes * gpn, f"{label} of {gpn} GPUs, the fewest the replicas fit on (spec.server.nodes auto)"
    return MAX_NODES_PER_REPLICA * replicas * gpn, f"{MAX_NODES_PER_REPLICA * replicas} nodes of {gpn} GPUs"


def choose(options: list[Option], predicted: bool) -> Option | None:
    runnable = [o for o in options if o.choosable]
    if not runnable:
        return None
    if not predicted:  # no GPU product to predict with: the smallest TP whose cache holds a useful batch
        holding = [o for o in runnable if o.batch >= MIN_BATCH_REQUESTS and o.layout.attention_dp == 1]
        if holding:
            return min(holding, key=lambda o: o.layout.tp)
        return max(runnable, key=lambda o: (o.batch, -o.layout.tp))
    best = min(runnable, key=lambda o: o.eta)
    ties = [o for o in runnable if o.eta <= best.eta * (1 + TIE)]
    return min(ties, key=lambda o: (o.gpu_hours, o.layout.tp, o.layout.attention_dp))


# --------------------------------------------------------------------------------------------------------------
# The plan's numbers.


@dataclass(frozen=True)
class Sizing:
    """Every number behind a plan, with the spec it answers (which says what was given and what was chosen)."""

    ctx: Context
    budget_gpus: int
    budget_source: str
    context_source: str
    options: tuple[Option, ...]
    chosen: Option
    warnings: tuple[str, ...] = field(default=())
    attention: AttentionBackend | None = None
    image: ServerImage | None = None

    @property
    def spec(self) -> DatasetGenerationSpec:
        return self.ctx.spec

    @property
    def model(self) -> ModelFacts:
        return self.ctx.model

    @property
    def capacity(self) -> Capacity:
        assert self.chosen.capacity is not None, "the chosen layout always has a capacity"
        return self.chosen.capacity

    @property
    def predicted(self) -> bool:
        return self.ctx.gpu is not None

    @property
    def concurrent_requests(self) -> int:
        return int(self.capacity.tokens // self.ctx.held)

    def step_model(self, option: Option) -> StepModel | None:
        chunk = option.memory.group_chunk if option.memory else None
        return self.ctx.step_model(option.layout, option.kv_cache_dtype, option.nodes_per_replica, chunk)

    def ranged(self, option: Option) -> Prediction | None:
        """The option's prediction with its interval (facts/intervals.py)."""
        prediction = option.prediction(self.step_model(option), self.ctx.held, self.ctx.work)
        if prediction is None or self.ctx.gpu is None:
            return prediction
        found = interval(self.ctx.gpu, option.layout)
        rate = prediction.output_tokens_per_second
        # The interval is the throughput model's error on generation; the capture pass is added as predicted.
        capture = prediction.capture_seconds or 0
        generation = prediction.eta_seconds - capture
        return prediction.model_copy(update={"interval": PredictionRange(
            output_tokens_per_second_low=round(rate * found.low), output_tokens_per_second_high=round(rate * found.high),
            eta_seconds_low=round(generation / found.high) + capture,
            eta_seconds_high=round(generation / found.low) + capture, basis=found.basis)})

    def candidate(self, option: Option, note: str) -> Candidate:
        prediction = self.ranged(option)
        if prediction is not None and option is not self.chosen:  # per-dataset finish times: the chosen layout's
            prediction = prediction.model_copy(update={"datasets": []})
        return Candidate(
            replicas=option.replicas, tensor_parallel=option.layout.tp,
            attention_data_parallel=option.layout.attention_dp, kv_cache_dtype=option.kv_cache_dtype,
            gpus=option.gpus, kv_capacity_tokens=option.capacity.tokens if option.capacity else 0,
            prediction=prediction, chosen=option is self.chosen, choosable=option.choosable, note=note)

    def to_plan(self, reasoning: list[str], notes: list[str]) -> ServerPlan:
        server, cap, chosen = self.spec.server, self.capacity, self.chosen
        gpu = self.ctx.gpu
        step = self.step_model(chosen)
        return ServerPlan(
            tensor_parallel=cap.tp,
            nodes_per_replica=chosen.nodes_per_replica,
            gpus_per_node=min(cap.tp, server.gpus_per_node),
            replicas=chosen.replicas,
            attention_data_parallel=chosen.layout.attention_dp,
            mem_fraction_static=(server.mem_fraction_static if server.mem_fraction_static != "auto"
                                 else f"{chosen.mem_fraction:.3f}"),
            context_length=self.ctx.context_length,
            max_running_requests=chosen.max_running,
            cuda_graph_max_bs=chosen.graph_bs,
            chunked_prefill_size=chosen.memory.chunk_flag if chosen.memory else None,
            load_balance_method=load_balance_method(chosen.layout.attention_dp),
            memory_split=[MemoryTerm(name=t.name, mib=round(t.mib), source=t.source)
                          for t in (chosen.memory.terms if chosen.memory else ())],
            kv_cache_dtype=chosen.kv_cache_dtype,
            attention_backend=self.attention.backend if self.attention else None,
            image=self.image.image if self.image else server.image,
            cuda_driver_major=self.image.driver_major if self.image else None,
            sglang_version=self.ctx.serving.release.version,
            gpu_product=gpu.label if gpu else server.gpu_product,
            gpu_vendor=gpu.vendor if gpu else "nvidia",
            gpu_memory_mib=self.ctx.gpu_memory_mib,
            interconnect=step.link.kind if step and cap.tp > 1 else "",
            weight_bytes=self.model.weight_bytes,
            weight_bytes_per_gpu=cap.weight_bytes_per_gpu,
            kv_bytes_per_token=cap.kv_bytes_per_rank * cap.tp,
            kv_capacity_tokens=cap.tokens,
            expected_tokens_per_request=round(self.ctx.held),
            concurrent_requests_at_expected_length=self.concurrent_requests,
            prediction=self.ranged(chosen),
            candidates=[self.candidate(o, n) for o, n in zip(self.options, notes, strict=True)],
            overrides=_overrides(self.spec),
            reasoning=reasoning,
        )


def _overrides(spec: DatasetGenerationSpec) -> list[str]:
    """Spec fields that were set rather than left to the planner."""
    server = spec.server
    auto_fields = {
        "nodes": server.nodes,
        "replicas": server.replicas,
        "tensorParallel": server.tensor_parallel,
        "attentionDataParallel": server.attention_data_parallel,
        "memFractionStatic": server.mem_fraction_static,
        "contextLength": server.context_length,
        "maxRunningRequests": server.max_running_requests,
        "kvCacheDtype": server.kv_cache_dtype,
    }
    names = [name for name, value in auto_fields.items() if value != "auto"]
    if server.gpu_memory_mib is not None:
        names.append("gpuMemoryMib")
    if spec.model.weight_bytes is not None:
        names.append("weightBytes")
    return names


def _no_fit_error(ctx: Context, options: list[Option], budget: int) -> PlanError:
    eligible = [o for o in options if o.eligible]
    if not any(o.capacity for o in eligible):
        reasons = "; ".join(sorted({f"TP {o.layout.tp}: {o.unusable}" for o in eligible if o.unusable}))
        return PlanError(f"no layout of this model fits the GPUs ({reasons}): set spec.server.gpusPerNode, "
                         f"spec.server.tensorParallel or spec.server.nodes")
    largest = max((o for o in eligible if o.capacity), key=lambda o: o.capacity.tokens)  # type: ignore[union-attr]
    cap = largest.capacity
    assert cap is not None
    work = ctx.work
    worst = max(work.datasets, key=lambda d: d.prompt_tokens + d.max_new_tokens)
    return PlanError(
        f"the model does not fit with room for a request on {budget} GPUs: at TP {cap.tp} the weights take "
        f"{gib(cap.weight_bytes_per_gpu)} of {gib(cap.usable_bytes)} usable per GPU, leaving {cap.tokens_per_group:,} "
        f"KV tokens where one request at its cap needs {work.longest_tokens():,}. Use bigger GPUs "
        f"(spec.server.gpuProduct / gpuMemoryMib), more GPUs (spec.server.gpusPerNode, spec.server.nodes), an fp8 KV "
        f"cache (spec.server.kvCacheDtype: fp8_e4m3), fp8 or int4 weights, or a smaller maxNewTokens (dataset "
        f"{worst.name}: {worst.max_new_tokens:,})")


def size_server(spec: DatasetGenerationSpec, model: ModelFacts, gpu_memory: int | None = None,
                work: Workload | None = None, node_driver_major: int | None = None,
                calibration: Calibration = CALIBRATION) -> Sizing:
    """Every number of the plan for this spec's model. Anything set in the spec wins; errors name the field.

    gpu_memory is the memory of one GPU; when None it comes from the spec (its memory field, else gpuProduct).
    node_driver_major is the GPU nodes' NVIDIA driver branch as the operator read it from their labels.
    """
    server = spec.server
    gpu = gpu_product(server)
    image = server_image(server, gpu, node_driver_major)
    serving = serving_release(server.model_copy(update={"image": image.image}))
    check_image(server, gpu, serving)
    check_architecture(model, serving)
    check_hidden_states(spec.hidden_states, model)
    check_kv_cache_dtype(server, serving)
    attention = attention_backend(server, gpu, model, serving)
    memory = gpu_memory if gpu_memory is not None and server.gpu_memory_mib is None else gpu_memory_mib(server, gpu)
    work = work or workload(spec)
    length, context_source = context_length(server, model, work.needed_context())
    worst = max(work.datasets, key=lambda d: d.max_new_tokens)
    if worst.max_new_tokens >= length:
        raise PlanError(f"dataset {worst.name} maxNewTokens {worst.max_new_tokens:,} leaves no room for a prompt in "
                        f"context length {length:,}: lower its maxNewTokens or raise spec.server.contextLength")
    ctx = Context(spec, model, gpu, memory, serving, work, length, attention.backend, calibration)
    budget, budget_source = _budget(ctx)
    options = _options(ctx, budget)
    chosen = choose(options, predicted=gpu is not None)
    if chosen is None:
        given = [o for o in options if o.eligible and o.unusable and o.not_allowed is None
                 and spec.server.tensor_parallel != "auto"]
        if given:
            raise PlanError(f"spec.server.tensorParallel {spec.server.tensor_parallel} cannot be used: "
                            f"{given[0].unusable}")
        raise _no_fit_error(ctx, options, budget)
    return Sizing(ctx=ctx, budget_gpus=budget, budget_source=budget_source, context_source=context_source,
                  options=tuple(options), chosen=chosen, warnings=serving.warnings + attention.warnings,
                  attention=attention, image=image)
