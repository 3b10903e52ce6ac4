"""The numbers of a server plan: what the datasets ask of the KV cache, the tensor-parallel sizes tried (each with
its memory arithmetic from `memory.py`), and every value chosen. Pure. `explain.py` renders the reasoning from a
`Sizing`; nothing here writes prose except the errors, which name the spec field to change.

To add a consideration (a throughput estimate, interconnect limits), compute it per `TpCandidate` or on `Sizing`
here, and say it in `explain.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill_runner.spec import DatasetGenerationSpec

from ..gpus import MEMORY_FIELD, canonical_product
from ..gpus import gpu_memory_mib as known_gpu_memory_mib
from .memory import (
    MIB,
    Capacity,
    kv_dtype_bytes,
    replica_capacity,
    sglang_default_max_running_requests,
    sglang_default_mem_fraction,
)
from .model import ModelFacts
from .plan import PlanError, ServerPlan
from .units import gib

# --------------------------------------------------------------------------------------------------------------
# Rules. Each is a choice; the reasoning lines repeat them so a reader of a plan can check the arithmetic.

# Largest group of nodes one replica may span, for tensorParallel auto and as given. Beyond this a second
# replica gives more than NCCL across many nodes does, and the operator's multi-node path is tested this far.
MAX_NODES_PER_REPLICA = 4

# A tensor-parallel size is useful only when its KV cache holds at least this many requests of the expected
# length at once: decode throughput grows with the batch (DESIGN.md: keep the server's batch full), and below
# ~32 a continuous-batching server spends most of each step on fixed cost.
MIN_BATCH_REQUESTS = 32

# Expected tokens one request holds. Prompts are unknown before tokenizing, so: a flat prompt estimate (the
# seeds' datasets averaged ~75 to ~1,130 prompt tokens) plus a share of the output cap (the seeds' B1 run
# averaged 1,314-1,416 output tokens at maxNewTokens 10,240, ~0.13-0.14 of the cap; 0.15 rounds up).
PROMPT_TOKENS_ESTIMATE = 512
OUTPUT_FRACTION_ESTIMATE = 0.15

# Below this many concurrent requests the plan points at an fp8 KV cache (never switched on silently).
TIGHT_BATCH_REQUESTS = 4 * MIN_BATCH_REQUESTS


# --------------------------------------------------------------------------------------------------------------
# The layout checks.


def tp_fits_model(model: ModelFacts, tp: int) -> str | None:
    """Why the model's heads cannot be split tp ways (SGLang asserts on it), or None when they can."""
    if model.num_attention_heads % tp:
        return f"{model.num_attention_heads} attention heads do not split into {tp}"
    kv = model.num_kv_heads
    if not model.is_mla and (kv % tp if kv >= tp else tp % kv):
        return f"{kv} KV heads do not split evenly over {tp} ranks"
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
# What the datasets ask of the cache.


@dataclass(frozen=True)
class Demand:
    """Token lengths the datasets imply, from their maxNewTokens (prompts are unknown before tokenizing)."""

    max_new_tokens: int
    longest_dataset: str
    expected_tokens: int  # one request, the longest-expected dataset: the runner sends long work first
    longest_tokens: int  # one request at its output cap

    @property
    def required_tokens(self) -> int:
        """KV capacity for MIN_BATCH_REQUESTS at the expected length and at least one at the longest."""
        return max(MIN_BATCH_REQUESTS * self.expected_tokens, self.longest_tokens)


def dataset_demand(spec: DatasetGenerationSpec) -> Demand:
    caps = [(spec.sampling_for(d).max_new_tokens or 0, d.name) for d in spec.datasets]
    max_new, name = max(caps)
    return Demand(
        max_new_tokens=max_new,
        longest_dataset=name,
        expected_tokens=PROMPT_TOKENS_ESTIMATE + math.ceil(OUTPUT_FRACTION_ESTIMATE * max_new),
        longest_tokens=PROMPT_TOKENS_ESTIMATE + max_new,
    )


# --------------------------------------------------------------------------------------------------------------
# Choosing the tensor-parallel size.


@dataclass(frozen=True)
class TpCandidate:
    """One tensor-parallel size considered: why it cannot be laid out, or what one replica holds at it."""

    tp: int
    unusable: str | None = None  # why the heads or the nodes rule it out (then there is no capacity)
    capacity: Capacity | None = None

    def holds(self, demand: Demand) -> bool:
        return self.capacity is not None and self.capacity.tokens >= demand.required_tokens


def _mem_fraction(spec: DatasetGenerationSpec, gpu_memory_mib: int, tp: int) -> float:
    given = spec.server.mem_fraction_static
    return float(given) if given != "auto" else sglang_default_mem_fraction(gpu_memory_mib, tp)


def _unusable(model: ModelFacts, tp: int, gpus_per_node: int) -> str | None:
    return tp_fits_nodes(tp, gpus_per_node) or tp_fits_model(model, tp)


def _no_fit_error(last: Capacity | None, demand: Demand, model: ModelFacts, gpus_per_node: int) -> PlanError:
    largest = gpus_per_node * MAX_NODES_PER_REPLICA
    if last is None:
        return PlanError(f"no tensor-parallel size up to {largest} splits this model's "
                         f"{model.num_attention_heads} attention heads into whole nodes of {gpus_per_node} GPUs: "
                         f"set spec.server.gpusPerNode or spec.server.tensorParallel")
    return PlanError(
        f"the model does not fit with a useful batch on up to {largest} GPUs: at TP {last.tp} the weights take "
        f"{gib(last.weight_bytes_per_gpu)} of {gib(last.usable_bytes)} usable per GPU, leaving "
        f"{last.tokens:,} KV tokens where {demand.required_tokens:,} are needed ({MIN_BATCH_REQUESTS} requests of "
        f"~{demand.expected_tokens:,} tokens). Use bigger GPUs (spec.server.gpuProduct / {MEMORY_FIELD}), more GPUs "
        f"per node (spec.server.gpusPerNode), fp8 or int4 weights, an fp8 KV cache (spec.server.kvCacheDtype: "
        f"fp8_e4m3), smaller maxNewTokens (dataset {demand.longest_dataset}: {demand.max_new_tokens:,}), or set "
        f"spec.server.tensorParallel to accept a small batch"
    )


def _auto_tp(spec: DatasetGenerationSpec, weight_bytes: int, model: ModelFacts, gpu_memory_mib: int,
             element_bytes: float, demand: Demand) -> list[TpCandidate]:
    """Powers of two from 1 up to the first whose KV cache holds demand.required_tokens (the last one)."""
    gpus_per_node = spec.server.gpus_per_node
    tried: list[TpCandidate] = []
    last: Capacity | None = None
    tp = 1
    while tp <= gpus_per_node * MAX_NODES_PER_REPLICA:
        why_not = _unusable(model, tp, gpus_per_node)
        if why_not:
            tried.append(TpCandidate(tp, unusable=why_not))
        else:
            last = replica_capacity(weight_bytes, model, gpu_memory_mib, tp, _mem_fraction(spec, gpu_memory_mib, tp),
                                    element_bytes)
            tried.append(TpCandidate(tp, capacity=last))
            if tried[-1].holds(demand):
                return tried
        tp *= 2
    raise _no_fit_error(last, demand, model, gpus_per_node)


def _given_tp(spec: DatasetGenerationSpec, weight_bytes: int, model: ModelFacts, gpu_memory_mib: int,
              element_bytes: float, demand: Demand) -> TpCandidate:
    """The spec's TP, checked: it must lay out on whole nodes, split the heads, and hold one longest request."""
    tp = spec.server.tensor_parallel
    why_not = _unusable(model, tp, spec.server.gpus_per_node)
    if why_not:
        raise PlanError(f"spec.server.tensorParallel {tp} cannot be used: {why_not}")
    fraction = _mem_fraction(spec, gpu_memory_mib, tp)
    cap = replica_capacity(weight_bytes, model, gpu_memory_mib, tp, fraction, element_bytes)
    if cap.tokens < demand.longest_tokens:
        raise PlanError(
            f"spec.server.tensorParallel {tp} does not fit: weights {gib(weight_bytes)} / {tp} = "
            f"{gib(cap.weight_bytes_per_gpu)} per GPU of {gib(cap.usable_bytes)} usable ({fraction:g} x "
            f"{gib(gpu_memory_mib * MIB)}) leave {cap.tokens:,} KV tokens, less than one request at the longest "
            f"length ({demand.longest_tokens:,} tokens); raise tensorParallel or set it to auto"
        )
    return TpCandidate(tp, capacity=cap)


# --------------------------------------------------------------------------------------------------------------
# The other settings.


def _gpu_memory(spec: DatasetGenerationSpec, given: int | None) -> int:
    server = spec.server
    if server.gpu_memory_mib is None and given is not None:
        return given
    try:
        return known_gpu_memory_mib(server.gpu_product, server.gpu_memory_mib)
    except ValueError as error:
        raise PlanError(str(error)) from None


def _context_length(spec: DatasetGenerationSpec, model: ModelFacts, demand: Demand) -> int:
    given = spec.server.context_length
    if given == "auto":
        length = model.max_position_embeddings
    elif given <= 0:
        raise PlanError(f"spec.server.contextLength must be positive; got {given}")
    else:
        length = given
    if demand.max_new_tokens >= length:
        raise PlanError(f"dataset {demand.longest_dataset} maxNewTokens {demand.max_new_tokens:,} leaves no room "
                        f"for a prompt in context length {length:,}: lower its maxNewTokens or raise "
                        f"spec.server.contextLength")
    return length


def _max_running(spec: DatasetGenerationSpec, cap: Capacity, context_length: int) -> int:
    given = spec.server.max_running_requests
    if given == "auto":
        return sglang_default_max_running_requests(cap.tokens, context_length)
    if given <= 0:
        raise PlanError(f"spec.server.maxRunningRequests must be positive; got {given}")
    return given


def _overrides(spec: DatasetGenerationSpec) -> list[str]:
    """Spec fields that were set rather than left to the planner."""
    server = spec.server
    auto_fields = {
        "tensorParallel": server.tensor_parallel,
        "memFractionStatic": server.mem_fraction_static,
        "contextLength": server.context_length,
        "maxRunningRequests": server.max_running_requests,
        "kvCacheDtype": server.kv_cache_dtype,
    }
    names = [name for name, value in auto_fields.items() if value != "auto"]
    if server.gpu_memory_mib is not None:
        names.append(MEMORY_FIELD.removeprefix("spec.server."))
    if spec.model.weight_bytes is not None:
        names.append("weightBytes")
    return names


def product_label(product: str | None) -> str | None:
    """The node label value for the product (an alias such as "H100" becomes NVIDIA-H100-80GB-HBM3)."""
    return (canonical_product(product) or product) if product else None


# --------------------------------------------------------------------------------------------------------------
# The plan's numbers.


@dataclass(frozen=True)
class Sizing:
    """Every number behind a plan, with the spec it answers (which says what was given and what was chosen)."""

    spec: DatasetGenerationSpec
    model: ModelFacts
    gpu_memory_mib: int
    weight_bytes: int
    kv_element_bytes: float
    demand: Demand
    context_length: int
    candidates: tuple[TpCandidate, ...]  # tensorParallel auto: every size tried, the chosen one last; else the spec's
    max_running_requests: int

    @property
    def auto_tp(self) -> bool:
        return self.spec.server.tensor_parallel == "auto"

    @property
    def capacity(self) -> Capacity:
        chosen = self.candidates[-1].capacity
        assert chosen is not None, "the chosen tensor-parallel size always has a capacity"
        return chosen

    @property
    def tp(self) -> int:
        return self.capacity.tp

    @property
    def nodes_per_replica(self) -> int:
        return math.ceil(self.tp / self.spec.server.gpus_per_node)

    @property
    def gpus_per_node(self) -> int:
        return min(self.tp, self.spec.server.gpus_per_node)

    @property
    def concurrent_requests(self) -> int:
        """Requests of the expected length one replica's KV cache holds at once."""
        return self.capacity.tokens // self.demand.expected_tokens

    def to_plan(self, reasoning: list[str]) -> ServerPlan:
        server, cap = self.spec.server, self.capacity
        return ServerPlan(
            tensor_parallel=cap.tp,
            nodes_per_replica=self.nodes_per_replica,
            gpus_per_node=self.gpus_per_node,
            replicas=server.replicas,
            mem_fraction_static=(server.mem_fraction_static if server.mem_fraction_static != "auto"
                                 else f"{cap.mem_fraction:.3f}"),
            context_length=self.context_length,
            max_running_requests=self.max_running_requests,
            kv_cache_dtype=server.kv_cache_dtype,
            gpu_product=product_label(server.gpu_product),
            gpu_memory_mib=self.gpu_memory_mib,
            weight_bytes=self.weight_bytes,
            weight_bytes_per_gpu=cap.weight_bytes_per_gpu,
            kv_bytes_per_token=cap.kv_bytes_per_rank * cap.tp,
            kv_capacity_tokens=cap.tokens,
            expected_tokens_per_request=self.demand.expected_tokens,
            concurrent_requests_at_expected_length=self.concurrent_requests,
            overrides=_overrides(self.spec),
            reasoning=reasoning,
        )


def size_server(spec: DatasetGenerationSpec, model: ModelFacts, gpu_memory_mib: int | None = None) -> Sizing:
    """Every number of the plan for this spec's model. Anything set in the spec wins; errors name the field.

    gpu_memory_mib is the memory of one GPU; when None it comes from the spec (its memory field, else gpuProduct).
    """
    gpu_mib = _gpu_memory(spec, gpu_memory_mib)
    weight_bytes = spec.model.weight_bytes or model.weight_bytes
    element_bytes = kv_dtype_bytes(spec.server.kv_cache_dtype)
    demand = dataset_demand(spec)
    context_length = _context_length(spec, model, demand)
    if spec.server.tensor_parallel == "auto":
        candidates = _auto_tp(spec, weight_bytes, model, gpu_mib, element_bytes, demand)
    else:
        candidates = [_given_tp(spec, weight_bytes, model, gpu_mib, element_bytes, demand)]
    chosen = candidates[-1].capacity
    assert chosen is not None
    return Sizing(
        spec=spec, model=model, gpu_memory_mib=gpu_mib, weight_bytes=weight_bytes, kv_element_bytes=element_bytes,
        demand=demand, context_length=context_length, candidates=tuple(candidates),
        max_running_requests=_max_running(spec, chosen, context_length),
    )
