"""Memory arithmetic of one server replica: SGLang's own defaults (mirrored so the plan shows what the server will
do), the KV cache per token by attention kind and dtype, and what fits beside the weights. Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .model import ModelFacts
from .plan import PlanError

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


# --------------------------------------------------------------------------------------------------------------
# SGLang's own arithmetic, mirrored so the plan shows what the server will do (reference/sglang.md §5).


def chunk_and_graph_bs(gpu_memory_mib: int, tp: int) -> tuple[int, int]:
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
    chunk, graph_bs = chunk_and_graph_bs(gpu_memory_mib, tp)
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
# The KV cache.


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
