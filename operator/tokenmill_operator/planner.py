"""Server planning: model config + weight size + GPU memory → how to run SGLang. Pure functions.

The plan and the arithmetic behind it are shown by `tokenmill plan` and stored in the resource's status.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from tokenmill_operator.gpus import MEMORY_FIELD, canonical_product
from tokenmill_operator.gpus import gpu_memory_mib as known_gpu_memory_mib
from tokenmill_runner.spec import DatasetGenerationSpec


class ServerPlan(BaseModel):
    """The server configuration actually used, with the numbers behind it (camelCase in status and JSON)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    tensor_parallel: int = Field(description="--tp-size: GPUs per replica (spans nodes when > GPUs per node).")
    nodes_per_replica: int = Field(description="Nodes one replica spans (--nnodes).")
    gpus_per_node: int = Field(description="GPUs requested per server pod.")
    replicas: int = Field(description="Independent server replicas.")
    mem_fraction_static: str = Field(description="--mem-fraction-static, as a decimal string.")
    context_length: int = Field(description="--context-length.")
    max_running_requests: int = Field(description="--max-running-requests.")
    kv_cache_dtype: str = Field(description="--kv-cache-dtype.")
    gpu_product: str | None = Field(None, description="GPU product the plan is for.")
    gpu_memory_mib: int = Field(description="Memory of one GPU, MiB.")
    weight_bytes: int = Field(description="Total weight size, bytes.")
    weight_bytes_per_gpu: int = Field(description="Weights held by one GPU at this tensor-parallel size, bytes.")
    kv_bytes_per_token: int = Field(description="KV-cache bytes per token for the whole replica (MLA-aware).")
    kv_capacity_tokens: int = Field(description="KV-cache capacity of one replica, tokens.")
    expected_tokens_per_request: int = Field(description="Prompt + output tokens a request is expected to hold.")
    concurrent_requests_at_expected_length: int = Field(
        description="Requests that fit the KV cache at the expected length."
    )
    overrides: list[str] = Field(default_factory=list, description="Fields taken from the spec as given.")
    reasoning: list[str] = Field(default_factory=list, description="The arithmetic, one line per step.")


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

MIB = 1024**2

# Bytes per cached element by --kv-cache-dtype. Block-scaled formats carry a 1-byte scale per block (32 for
# mxfp8, 16 for the fp4 ones); counting it keeps the estimate conservative.
_KV_DTYPE_BYTES: dict[str, float] = {
    "bf16": 2.0,
    "bfloat16": 2.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "mxfp8": 1.0 + 1 / 32,
    "nvfp4": 0.5 + 1 / 16,
    "fp4_mx_block16": 0.5 + 1 / 16,
    "fp4_e2m1": 0.5 + 1 / 16,
}

# SGLang's "auto" KV dtype is the served dtype: 16-bit, also for float32 checkpoints (served in 16 bit) and for
# INT4/FP8 weight-quantized ones (their activations and cache stay 16-bit).
_AUTO_KV_BYTES = 2.0

# Keys for the same quantity across config.json families (Llama/DeepSeek, GPT-2/Falcon, ChatGLM, ...).
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length")
# Multimodal wrappers keep the language model's config under one of these (Kimi-K2.5: text_config).
_LLM_SUBCONFIG_KEYS = ("text_config", "llm_config", "language_config")

logger = logging.getLogger(__name__)


class PlanError(ValueError):
    """No server plan fits; the message names the spec field to change and the numbers behind it."""


@dataclass(frozen=True)
class ModelFacts:
    """What planning needs from a model's config.json, plus its total weight size.

    Sliding-window and hybrid (Mamba/linear-attention) layers are counted as full attention, which
    over-estimates their cache: the plan errs towards more GPUs, never towards an out-of-memory server.
    """

    architecture: str | None
    model_type: str | None
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    torch_dtype: str | None
    weight_bytes: int
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    nested_under: str | None = None  # the sub-config the LLM facts came from, e.g. "text_config"

    @property
    def is_mla(self) -> bool:
        """DeepSeek-V3 / Kimi-K2 multi-head latent attention: one compressed latent per token and layer."""
        return self.kv_lora_rank is not None and self.qk_rope_head_dim is not None


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


def _required_int(config: dict[str, Any], keys: tuple[str, ...]) -> int:
    value = _first(config, keys)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        others = ", ".join(keys[1:]) or "no other key"
        raise PlanError(f"config.json has no usable {keys[0]} (also tried {others})")
    return value


def _llm_config(config: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The language model's own config: a multimodal wrapper's sub-config merged over the top level."""
    if _first(config, _LAYER_KEYS) is not None:
        return config, None
    for key in _LLM_SUBCONFIG_KEYS:
        sub = config.get(key)
        if isinstance(sub, dict) and _first(sub, _LAYER_KEYS) is not None:
            outer = {k: v for k, v in config.items() if k not in _LLM_SUBCONFIG_KEYS}
            return {**outer, **sub}, key
    return config, None


def model_facts(config: dict[str, Any], weight_bytes: int) -> ModelFacts:
    """Parse a config.json dict (multimodal wrappers included) and the total weight size into ModelFacts."""
    if weight_bytes <= 0:
        raise PlanError(f"weight size must be positive; got {weight_bytes} (set spec.model.weightBytes)")
    llm, nested_under = _llm_config(config)
    hidden = _required_int(llm, _HIDDEN_KEYS)
    heads = _required_int(llm, _HEAD_KEYS)
    architectures = config.get("architectures") or llm.get("architectures") or [None]
    return ModelFacts(
        architecture=architectures[0],
        model_type=llm.get("model_type"),
        num_layers=_required_int(llm, _LAYER_KEYS),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(_first(llm, _KV_HEAD_KEYS) or heads),  # absent: plain multi-head attention
        head_dim=int(llm.get("head_dim") or hidden // heads),
        max_position_embeddings=_required_int(llm, _CONTEXT_KEYS),
        # transformers 5 writes "dtype", older versions "torch_dtype".
        torch_dtype=llm.get("torch_dtype") or llm.get("dtype"),
        weight_bytes=weight_bytes,
        kv_lora_rank=llm.get("kv_lora_rank"),
        qk_rope_head_dim=llm.get("qk_rope_head_dim"),
        nested_under=nested_under,
    )


# --------------------------------------------------------------------------------------------------------------
# SGLang's own arithmetic, mirrored so the plan shows what the server will do (reference/sglang.md §5).


def _chunk_and_graph_bs(gpu_memory_mib: int, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) by GPU memory tier, as ServerArgs._handle_gpu_memory_settings."""
    small_tp = tp < 4
    if gpu_memory_mib < 20 * 1024:
        return 2048, 8
    if gpu_memory_mib < 35 * 1024:
        return 2048, 24 if small_tp else 80
    if gpu_memory_mib < 60 * 1024:
        return 4096, 32 if small_tp else 160
    if gpu_memory_mib < 160 * 1024:  # H100 (<90 GB) and H200/H20 (<160 GB) tiers have the same numbers
        return 8192, 256 if small_tp else 512
    return 16384, 512


def sglang_reserved_mib(gpu_memory_mib: int, tp: int) -> float:
    """MiB SGLang v0.5.6 keeps outside --mem-fraction-static by default (activations, CUDA graphs, NCCL)."""
    chunk, graph_bs = _chunk_and_graph_bs(gpu_memory_mib, tp)
    reserved = 512 + max(chunk, 2048) * 1.5 + graph_bs * 2 + tp / 8 * 1024
    if gpu_memory_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return reserved


def sglang_default_mem_fraction(gpu_memory_mib: int, tp: int) -> float:
    """SGLang's default --mem-fraction-static: round((gpu_mem - reserved) / gpu_mem, 3)."""
    reserved = sglang_reserved_mib(gpu_memory_mib, tp)
    return round((gpu_memory_mib - reserved) / gpu_memory_mib, 3)


def sglang_default_max_running_requests(capacity_tokens: int, context_length: int) -> int:
    """SGLang's derived --max-running-requests, capped at half the token capacity."""
    derived = min(max(int(capacity_tokens / context_length * 512), 2048), 4096)
    return max(1, min(derived, capacity_tokens // 2))


# --------------------------------------------------------------------------------------------------------------
# KV cache and the layout checks.


def kv_dtype_bytes(kv_cache_dtype: str) -> float:
    """Bytes per cached element for a --kv-cache-dtype value."""
    if kv_cache_dtype == "auto":
        return _AUTO_KV_BYTES
    if kv_cache_dtype not in _KV_DTYPE_BYTES:
        known = ", ".join(["auto", *_KV_DTYPE_BYTES])
        raise PlanError(f"spec.server.kvCacheDtype {kv_cache_dtype!r} is not one SGLang knows; use one of {known}")
    return _KV_DTYPE_BYTES[kv_cache_dtype]


def kv_heads_per_rank(model: ModelFacts, tp: int) -> int:
    """KV heads one rank holds: split across ranks, replicated when there are fewer heads than ranks."""
    return max(1, model.num_kv_heads // tp)


def kv_bytes_per_token_per_rank(model: ModelFacts, tp: int, element_bytes: float) -> int:
    """KV-cache bytes one token takes on each tensor-parallel rank."""
    if model.is_mla:
        # All heads share the latent, so every rank caches all of it: TP does not split an MLA cache.
        width = model.kv_lora_rank + model.qk_rope_head_dim
    else:
        width = 2 * kv_heads_per_rank(model, tp) * model.head_dim  # K and V
    return math.ceil(width * element_bytes * model.num_layers)


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


@dataclass(frozen=True)
class Capacity:
    """Memory arithmetic of one replica at one tensor-parallel size, seen from one rank (all ranks are alike)."""

    tp: int
    mem_fraction: float
    usable_bytes: int  # per GPU: mem_fraction x GPU memory holds weights + KV pool
    weight_bytes_per_gpu: int
    kv_room_bytes: int  # per GPU; negative when the weights alone do not fit
    kv_bytes_per_rank: int  # per token
    tokens: int  # per replica: every rank holds its share of every token, so one rank's room bounds the replica


def replica_capacity(weight_bytes: int, model: ModelFacts, gpu_memory_mib: int, tp: int, mem_fraction: float,
                     element_bytes: float) -> Capacity:
    """Weights per GPU, KV room per GPU and KV capacity in tokens of one replica at tensor-parallel size tp."""
    usable = int(mem_fraction * gpu_memory_mib * MIB)
    per_gpu = math.ceil(weight_bytes / tp)
    room = usable - per_gpu
    per_rank = kv_bytes_per_token_per_rank(model, tp, element_bytes)
    return Capacity(tp, mem_fraction, usable, per_gpu, room, per_rank, max(0, room // per_rank))


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
# Formatting numbers for people.


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _per_token(n: int) -> str:
    return f"{n:,} B ({n / 1024:,.1f} KiB)"


def _elements(element_bytes: float) -> str:
    return f"{element_bytes:.3g} B"


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


# --------------------------------------------------------------------------------------------------------------
# Choosing the tensor-parallel size.


def _rejection(cap: Capacity, demand: Demand, gpu_memory_mib: int) -> str:
    if cap.kv_room_bytes <= 0:
        return (f"TP {cap.tp}: weights {_gib(cap.weight_bytes_per_gpu)} per GPU do not fit in "
                f"{_gib(cap.usable_bytes)} usable ({cap.mem_fraction:g} x {_gib(gpu_memory_mib * MIB)}): rejected")
    return (f"TP {cap.tp}: weights {_gib(cap.weight_bytes_per_gpu)} per GPU leave {_gib(cap.kv_room_bytes)} "
            f"for the KV cache = {cap.tokens:,} tokens = {cap.tokens // demand.expected_tokens:,} requests of "
            f"~{demand.expected_tokens:,} tokens: too small a batch (need room for {MIN_BATCH_REQUESTS} "
            f"requests, {demand.required_tokens:,} tokens): rejected")


def _no_fit_error(last: Capacity | None, demand: Demand, model: ModelFacts, gpus_per_node: int) -> PlanError:
    largest = gpus_per_node * MAX_NODES_PER_REPLICA
    if last is None:
        return PlanError(f"no tensor-parallel size up to {largest} splits this model's "
                         f"{model.num_attention_heads} attention heads into whole nodes of {gpus_per_node} GPUs: "
                         f"set spec.server.gpusPerNode or spec.server.tensorParallel")
    return PlanError(
        f"the model does not fit with a useful batch on up to {largest} GPUs: at TP {last.tp} the weights take "
        f"{_gib(last.weight_bytes_per_gpu)} of {_gib(last.usable_bytes)} usable per GPU, leaving "
        f"{last.tokens:,} KV tokens where {demand.required_tokens:,} are needed ({MIN_BATCH_REQUESTS} requests of "
        f"~{demand.expected_tokens:,} tokens). Use bigger GPUs (spec.server.gpuProduct / {MEMORY_FIELD}), more GPUs "
        f"per node (spec.server.gpusPerNode), fp8 or int4 weights, an fp8 KV cache (spec.server.kvCacheDtype: "
        f"fp8_e4m3), smaller maxNewTokens (dataset {demand.longest_dataset}: {demand.max_new_tokens:,}), or set "
        f"spec.server.tensorParallel to accept a small batch"
    )


def _auto_tp(weight_bytes: int, model: ModelFacts, gpu_memory_mib: int, gpus_per_node: int,
             fraction_for: Callable[[int], float], element_bytes: float,
             demand: Demand) -> tuple[Capacity, list[str]]:
    """The smallest power-of-two TP whose KV cache holds demand.required_tokens, with the rejected ones."""
    lines: list[str] = []
    last: Capacity | None = None
    tp = 1
    while tp <= gpus_per_node * MAX_NODES_PER_REPLICA:
        why_not = tp_fits_nodes(tp, gpus_per_node) or tp_fits_model(model, tp)
        if why_not:
            lines.append(f"TP {tp}: {why_not}: skipped")
        else:
            last = replica_capacity(weight_bytes, model, gpu_memory_mib, tp, fraction_for(tp), element_bytes)
            if last.tokens >= demand.required_tokens:
                return last, lines
            lines.append(_rejection(last, demand, gpu_memory_mib))
        tp *= 2
    raise _no_fit_error(last, demand, model, gpus_per_node)


def _given_tp(tp: int, weight_bytes: int, model: ModelFacts, gpu_memory_mib: int, gpus_per_node: int,
              fraction: float, element_bytes: float, demand: Demand) -> tuple[Capacity, list[str]]:
    """The spec's TP, checked: it must lay out on whole nodes, split the heads, and hold one longest request."""
    why_not = tp_fits_nodes(tp, gpus_per_node) or tp_fits_model(model, tp)
    if why_not:
        raise PlanError(f"spec.server.tensorParallel {tp} cannot be used: {why_not}")
    cap = replica_capacity(weight_bytes, model, gpu_memory_mib, tp, fraction, element_bytes)
    if cap.tokens < demand.longest_tokens:
        raise PlanError(
            f"spec.server.tensorParallel {tp} does not fit: weights {_gib(weight_bytes)} / {tp} = "
            f"{_gib(cap.weight_bytes_per_gpu)} per GPU of {_gib(cap.usable_bytes)} usable ({fraction:g} x "
            f"{_gib(gpu_memory_mib * MIB)}) leave {cap.tokens:,} KV tokens, less than one request at the longest "
            f"length ({demand.longest_tokens:,} tokens); raise tensorParallel or set it to auto"
        )
    lines = [f"TP {tp} from spec.server.tensorParallel"]
    if cap.tokens < demand.required_tokens:
        lines.append(f"warning: {_rejection(cap, demand, gpu_memory_mib).removesuffix(': rejected')}; "
                     f"kept because the spec sets it")
    return cap, lines


# --------------------------------------------------------------------------------------------------------------
# The other settings, each with the line that explains it.


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


def _product_label(product: str | None) -> str | None:
    """The node label value for the product (an alias such as "H100" becomes NVIDIA-H100-80GB-HBM3)."""
    return (canonical_product(product) or product) if product else None


def _product_text(product: str | None) -> str:
    label = _product_label(product)
    if label is None:
        return "product not named"
    return label if label == product else f"{product} (node label {label})"


def _gpu_memory(spec: DatasetGenerationSpec, given: int | None) -> int:
    server = spec.server
    if server.gpu_memory_mib is None and given is not None:
        return given
    try:
        return known_gpu_memory_mib(server.gpu_product, server.gpu_memory_mib)
    except ValueError as error:
        raise PlanError(str(error)) from None


def _context_length(spec: DatasetGenerationSpec, model: ModelFacts, demand: Demand) -> tuple[int, list[str]]:
    given = spec.server.context_length
    if given == "auto":
        length = model.max_position_embeddings
        lines = [f"context length {length:,}: the model's max_position_embeddings (SGLang's default too), kept "
                 f"whole because prompt lengths are unknown before tokenizing; lower it with "
                 f"spec.server.contextLength"]
    else:
        if given <= 0:
            raise PlanError(f"spec.server.contextLength must be positive; got {given}")
        length = given
        lines = [f"context length {length:,} from spec.server.contextLength"]
        if length > model.max_position_embeddings:
            lines.append(f"warning: above the model's max_position_embeddings {model.max_position_embeddings:,}; "
                         f"SGLang refuses it unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
    if demand.max_new_tokens >= length:
        raise PlanError(f"dataset {demand.longest_dataset} maxNewTokens {demand.max_new_tokens:,} leaves no room "
                        f"for a prompt in context length {length:,}: lower its maxNewTokens or raise "
                        f"spec.server.contextLength")
    if demand.longest_tokens > length:
        lines.append(f"warning: dataset {demand.longest_dataset} maxNewTokens {demand.max_new_tokens:,} leaves "
                     f"{length - demand.max_new_tokens:,} tokens for its prompts")
    return length, lines


def _max_running(spec: DatasetGenerationSpec, cap: Capacity, context_length: int,
                 concurrent: int) -> tuple[int, str]:
    given = spec.server.max_running_requests
    if given != "auto":
        if given <= 0:
            raise PlanError(f"spec.server.maxRunningRequests must be positive; got {given}")
        note = (f"; the KV cache holds ~{concurrent:,} at the expected length, SGLang queues the rest"
                if given > concurrent else "")
        return given, f"max running requests {given:,} from spec.server.maxRunningRequests{note}"
    value = sglang_default_max_running_requests(cap.tokens, context_length)
    return value, (f"max running requests {value:,}: SGLang's own rule, min(max(int({cap.tokens:,} / "
                   f"{context_length:,} x 512), 2048), 4096) capped at {cap.tokens // 2:,} (half the capacity); "
                   f"SGLang admits only what free KV allows, ~{concurrent:,} at the expected length")


def _kv_dtype_lines(spec: DatasetGenerationSpec, model: ModelFacts, element_bytes: float, concurrent: int,
                    demand: Demand) -> list[str]:
    dtype = spec.server.kv_cache_dtype
    if dtype != "auto":
        return [f"KV cache dtype {dtype} from spec.server.kvCacheDtype ({_elements(element_bytes)} per element)"]
    lines = [f"KV cache dtype auto: the served 16-bit dtype ({model.torch_dtype or 'dtype not in config'} "
             f"checkpoint), {_elements(element_bytes)} per element"]
    if concurrent < TIGHT_BATCH_REQUESTS:
        lines.append(f"option: kvCacheDtype fp8_e4m3 would halve the cache per token (~{2 * concurrent:,} "
                     f"requests of ~{demand.expected_tokens:,} tokens) at some risk to output fidelity; not "
                     f"applied, set spec.server.kvCacheDtype to use it")
    return lines


def _mem_fraction_line(spec: DatasetGenerationSpec, gpu_memory_mib: int, tp: int, fraction: float) -> str:
    if spec.server.mem_fraction_static != "auto":
        return f"mem-fraction-static {spec.server.mem_fraction_static} from spec.server.memFractionStatic"
    chunk, graph_bs = _chunk_and_graph_bs(gpu_memory_mib, tp)
    reserved = sglang_reserved_mib(gpu_memory_mib, tp)
    formula = f"512 + 1.5 x {chunk} (chunked prefill) + 2 x {graph_bs} (CUDA-graph batch) + {tp}/8 x 1024"
    if gpu_memory_mib > 60 * 1024:
        formula = f"max({formula}, 10240)"
    return (f"mem-fraction-static {fraction:.3f}: SGLang v0.5.6's default for this GPU and TP, "
            f"round(({gpu_memory_mib:,} - {reserved:,.0f}) / {gpu_memory_mib:,}, 3) with {formula} MiB reserved "
            f"for activations and CUDA graphs")


def _model_line(model: ModelFacts, weight_bytes: int, weight_from_spec: bool) -> str:
    nested = f" (language model under {model.nested_under})" if model.nested_under else ""
    if model.is_mla:
        attention = f"MLA (kv_lora_rank {model.kv_lora_rank}, qk_rope_head_dim {model.qk_rope_head_dim})"
    else:
        kind = "MHA" if model.num_kv_heads == model.num_attention_heads else "GQA"
        attention = f"{kind}, {model.num_kv_heads} KV heads x {model.head_dim} head dim"
    source = " (spec.model.weightBytes)" if weight_from_spec else ""
    return (f"model: {model.architecture or model.model_type or 'unknown architecture'}{nested}, "
            f"{model.num_layers} layers, {model.num_attention_heads} attention heads, {attention}; "
            f"weights {_gib(weight_bytes)}{source}")


def _kv_line(model: ModelFacts, tp: int, element_bytes: float, per_rank: int) -> str:
    layers = f"{_elements(element_bytes)} x {model.num_layers} layers = {_per_token(per_rank)} per token"
    replica = f"{per_rank * tp:,} B per token for the replica"
    if model.is_mla:
        return (f"KV cache: MLA, ({model.kv_lora_rank} + {model.qk_rope_head_dim}) x {layers} on every rank: "
                f"SGLang keeps the whole latent on each of the {tp} TP ranks (no DP attention), so TP does not "
                f"split it and adds room only by splitting the weights ({replica})")
    heads = kv_heads_per_rank(model, tp)
    split = "replicated" if model.num_kv_heads < tp else "split"
    return (f"KV cache: 2 (K, V) x {heads} KV heads per rank ({model.num_kv_heads} {split} over TP {tp}) x "
            f"{model.head_dim} head dim x {layers} per rank ({replica})")


def _capacity_lines(cap: Capacity, model: ModelFacts, weight_bytes: int, gpu_memory_mib: int,
                    element_bytes: float, demand: Demand, replicas: int) -> list[str]:
    concurrent = cap.tokens // demand.expected_tokens
    total = f"; x {replicas} replicas = {concurrent * replicas:,} requests" if replicas > 1 else ""
    return [
        f"weights {_gib(weight_bytes)} / TP {cap.tp} = {_gib(cap.weight_bytes_per_gpu)} per GPU of "
        f"{_gib(cap.usable_bytes)} usable ({cap.mem_fraction:g} x {_gib(gpu_memory_mib * MIB)}), leaving "
        f"{_gib(cap.kv_room_bytes)} per GPU for the KV cache",
        _kv_line(model, cap.tp, element_bytes, cap.kv_bytes_per_rank),
        f"capacity: {_gib(cap.kv_room_bytes)} / {cap.kv_bytes_per_rank:,} B = {cap.tokens:,} tokens per replica "
        f"(each rank holds its share of every token, so one rank's room bounds the replica) = {concurrent:,} "
        f"requests of ~{demand.expected_tokens:,} tokens at once{total}",
    ]


def _demand_lines(demand: Demand, auto_tp: bool) -> list[str]:
    lines = [
        f"expected request: {PROMPT_TOKENS_ESTIMATE} prompt tokens + {OUTPUT_FRACTION_ESTIMATE:g} x maxNewTokens "
        f"{demand.max_new_tokens:,} (dataset {demand.longest_dataset}, the largest cap) = "
        f"{demand.expected_tokens:,} tokens (prompts are unknown before tokenizing; the seeds' run averaged "
        f"1,314-1,416 output tokens at a 10,240 cap)"
    ]
    if auto_tp:
        lines.append(f"rule: the smallest power-of-two TP whose KV cache holds {MIN_BATCH_REQUESTS} requests of "
                     f"that length and one at its cap ({PROMPT_TOKENS_ESTIMATE} + {demand.max_new_tokens:,}): "
                     f">= {demand.required_tokens:,} tokens")
    return lines


# --------------------------------------------------------------------------------------------------------------
# The plan.


def plan_server(spec: DatasetGenerationSpec, model: ModelFacts, gpu_memory_mib: int | None = None) -> ServerPlan:
    """Choose how SGLang runs this spec's model, with the arithmetic. Anything set in the spec wins.

    gpu_memory_mib is the memory of one GPU; when None it comes from the spec (its memory field, else gpuProduct).
    """
    server = spec.server
    gpu_mib = _gpu_memory(spec, gpu_memory_mib)
    weight_bytes = spec.model.weight_bytes or model.weight_bytes
    element_bytes = kv_dtype_bytes(server.kv_cache_dtype)
    demand = dataset_demand(spec)
    context_length, context_lines = _context_length(spec, model, demand)

    def fraction_for(tp: int) -> float:
        if server.mem_fraction_static != "auto":
            return float(server.mem_fraction_static)
        return sglang_default_mem_fraction(gpu_mib, tp)

    auto_tp = server.tensor_parallel == "auto"
    if auto_tp:
        cap, tp_lines = _auto_tp(weight_bytes, model, gpu_mib, server.gpus_per_node, fraction_for,
                                 element_bytes, demand)
        tp_lines.append(f"TP {cap.tp}: chosen, the smallest that holds the batch")
    else:
        cap, tp_lines = _given_tp(server.tensor_parallel, weight_bytes, model, gpu_mib, server.gpus_per_node,
                                  fraction_for(server.tensor_parallel), element_bytes, demand)
    nodes = math.ceil(cap.tp / server.gpus_per_node)
    gpus_per_node = min(cap.tp, server.gpus_per_node)
    concurrent = cap.tokens // demand.expected_tokens
    max_running, max_running_line = _max_running(spec, cap, context_length, concurrent)

    reasoning = [
        _model_line(model, weight_bytes, spec.model.weight_bytes is not None),
        f"GPU: {_product_text(server.gpu_product)}, {gpu_mib:,} MiB ({_gib(gpu_mib * MIB)}) each"
        f"{f' ({MEMORY_FIELD})' if server.gpu_memory_mib is not None else ''}; "
        f"{server.gpus_per_node} per node, at most {MAX_NODES_PER_REPLICA} nodes per replica",
        *_demand_lines(demand, auto_tp),
        *tp_lines,
        f"layout: TP {cap.tp} = {_count(nodes, 'node')} x {_count(gpus_per_node, 'GPU')} per replica "
        f"(gpusPerNode {server.gpus_per_node}), {_count(server.replicas, 'replica')}, "
        f"{_count(cap.tp * server.replicas, 'GPU')} in all",
        _mem_fraction_line(spec, gpu_mib, cap.tp, cap.mem_fraction),
        *_capacity_lines(cap, model, weight_bytes, gpu_mib, element_bytes, demand, server.replicas),
        *context_lines,
        max_running_line,
        *_kv_dtype_lines(spec, model, element_bytes, concurrent, demand),
    ]
    plan = ServerPlan(
        tensor_parallel=cap.tp,
        nodes_per_replica=nodes,
        gpus_per_node=gpus_per_node,
        replicas=server.replicas,
        mem_fraction_static=(server.mem_fraction_static if server.mem_fraction_static != "auto"
                             else f"{cap.mem_fraction:.3f}"),
        context_length=context_length,
        max_running_requests=max_running,
        kv_cache_dtype=server.kv_cache_dtype,
        gpu_product=_product_label(server.gpu_product),
        gpu_memory_mib=gpu_mib,
        weight_bytes=weight_bytes,
        weight_bytes_per_gpu=cap.weight_bytes_per_gpu,
        kv_bytes_per_token=cap.kv_bytes_per_rank * cap.tp,
        kv_capacity_tokens=cap.tokens,
        expected_tokens_per_request=demand.expected_tokens,
        concurrent_requests_at_expected_length=concurrent,
        overrides=_overrides(spec),
        reasoning=reasoning,
    )
    logger.debug("server plan: TP %d on %d node(s), %d KV tokens, %d concurrent requests",
                 plan.tensor_parallel, plan.nodes_per_replica, plan.kv_capacity_tokens,
                 plan.concurrent_requests_at_expected_length)
    return plan


def render_plan(plan: ServerPlan) -> str:
    """The plan for people: a short table of the settings, then the arithmetic behind them."""
    rows = [
        ("tensor parallel", f"{plan.tensor_parallel} = {_count(plan.nodes_per_replica, 'node')} x "
                            f"{_count(plan.gpus_per_node, 'GPU')}, {_count(plan.replicas, 'replica')}"),
        ("mem-fraction-static", plan.mem_fraction_static),
        ("context length", f"{plan.context_length:,}"),
        ("max running requests", f"{plan.max_running_requests:,}"),
        ("KV cache dtype", plan.kv_cache_dtype),
        ("GPU", f"{plan.gpu_product or '-'}, {plan.gpu_memory_mib:,} MiB"),
        ("weights", f"{_gib(plan.weight_bytes)}, {_gib(plan.weight_bytes_per_gpu)} per GPU"),
        ("KV per token", f"{plan.kv_bytes_per_token:,} B per replica"),
        ("KV capacity", f"{plan.kv_capacity_tokens:,} tokens = {plan.concurrent_requests_at_expected_length:,} "
                        f"requests of ~{plan.expected_tokens_per_request:,} tokens"),
        ("set in the spec", ", ".join(plan.overrides) or "nothing (all auto)"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    return "\n".join([*lines, "", "why:", *(f"  - {line}" for line in plan.reasoning)])
