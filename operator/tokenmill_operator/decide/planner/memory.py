"""Memory arithmetic of one server replica: SGLang's own defaults for the release in use (mirrored so the plan
shows what the server will do), the KV cache per token by attention kind and dtype, and what fits beside the
weights in a layout. Pure.

The reserve SGLang keeps outside --mem-fraction-static changes by release (docs/sglang-release-facts.md §K):
0.5.10.post1 adds the prefill (piecewise) CUDA graphs, 0.5.20 the larger tier for small GPUs; DP attention adds
its own padding. For a multimodal model SGLang lowers the fraction by a factor from the vision tower's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill_runner.facts.model_facts import ModelFacts
from tokenmill_runner.facts.releases import Release, version_key
from tokenmill_runner.facts.throughput import Layout

from .plan import PlanError

MIB = 1024**2

# Bytes per cached element by --kv-cache-dtype. Block-scaled formats carry a 1-byte scale per block (32 for
# mxfp8, 16 for the fp4 ones); counting it keeps the estimate conservative.
KV_DTYPE_BYTES: dict[str, float] = {
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
AUTO_KV_BYTES = 2.0

# GPU memory in use before the weights load: the CUDA context and the NCCL communicators. SGLang's fraction is of
# the memory free then (0.5.23 mem_cache/kv_cache_configurator.py:2990-3038: KV budget = free after loading -
# free before x (1 - fraction)), so the static pool is fraction x (total - this). Not measured here: 0.5-1.5 GiB is
# typical for a CUDA 12/13 context with NCCL on 8 GPUs; the refit after a run's first minutes replaces it.
PRE_LOAD_USED_MIB = 1024
# SGLANG_VLM_CACHE_SIZE_MB's default: the multimodal embedding cache a model with a vision tower reserves.
MM_CACHE_MIB = 100.0
# req_to_token rows hold int32 token indices, one row per request slot plus SGLang's padding row, each
# context_length + 4 wide (0.5.23 mem_cache/memory_pool.py:400-406, mem_cache/allocation_sizing.py:96-105; 0.5.9
# mem_cache/memory_pool.py:144 and model_executor/model_runner_kv_cache_mixin.py:439-441, without the padding row).
REQ_TO_TOKEN_EXTRA = 4


def _since(release: Release, first: str) -> bool:
    return version_key(release.version) >= version_key(first)


# --------------------------------------------------------------------------------------------------------------
# SGLang's own arithmetic, mirrored so the plan shows what the server will do.


def chunk_and_graph_bs(gpu_memory_mib: int, tp: int, release: Release) -> tuple[int, int]:
    """(chunked_prefill_size, decode cuda_graph_max_bs) by GPU memory tier (0.5.6 server_args.py:726; 0.5.23
    arg_groups/memory_hook.py:90-170; the <35 GB tier grew in 0.5.20)."""
    small_tp = tp < 4
    if gpu_memory_mib < 20 * 1024:
        return 2048, 8
    if gpu_memory_mib < 35 * 1024:
        if _since(release, "0.5.20"):
            return 4096, 48 if small_tp else 160
        return 2048, 24 if small_tp else 80
    if gpu_memory_mib < 60 * 1024:
        return 4096, 32 if small_tp else 160
    if gpu_memory_mib < 160 * 1024:  # H100 (<90 GB) and H200/H20/RTX PRO 6000 (<160 GB) tiers have the same numbers
        return 8192, 256 if small_tp else 512
    return 16384, 512


def prefill_graph_sizes(max_tokens: int) -> int:
    """How many token counts SGLang captures prefill CUDA graphs for (0.5.23 arg_groups/cuda_graph_hook.py:480):
    steps of 4 to 32, 16 to 256, 32 to 512, 64 to 1024, 256 to 4096, then 512."""
    ranges = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256), (4608, max_tokens, 512))
    return sum(len([s for s in range(start, stop + 1, step) if s <= max_tokens]) for start, stop, step in ranges)


@dataclass(frozen=True)
class Reserve:
    """SGLang's default memory kept outside --mem-fraction-static, MiB, term by term."""

    chunk: int
    graph_bs: int
    activations: float
    decode_graphs: float
    parallel: float
    dp_attention: float
    prefill_graphs: float
    floor_applied: bool
    total: float


def sglang_reserve(gpu_memory_mib: int, layout: Layout, model: ModelFacts, release: Release,
                   graph_bs: int | None = None) -> Reserve:
    """MiB SGLang keeps outside --mem-fraction-static by default for this release, GPU and layout (no speculative
    decoding, one pipeline stage, no DeepEP): activations for a prefill chunk, CUDA graphs, NCCL, DP attention."""
    chunk, tier_bs = chunk_and_graph_bs(gpu_memory_mib, layout.tp, release)
    bs = graph_bs or tier_bs
    activations = 512 + max(chunk, 2048) * 1.5
    decode_graphs = bs * 2.0
    parallel = layout.tp / 8 * 1024
    dp = 0.0
    if layout.attention_dp > 1:
        dp = bs * layout.attention_dp * 3.0 + (bs * layout.attention_dp * 1.5 if bs > 300 else 0.0)
    prefill = 0.0
    if _since(release, "0.5.10.post1"):  # piecewise / prefill CUDA graphs are on by default from here
        prefill = 1536.0 if model.is_mla else prefill_graph_sizes(min(8192, chunk) if model.is_mla else chunk) * 8.0
    total = activations + decode_graphs + parallel + dp + prefill
    floored = gpu_memory_mib > 60 * 1024 and total < 10 * 1024
    return Reserve(chunk, bs, activations, decode_graphs, parallel, dp, prefill, floored,
                   max(total, 10 * 1024) if gpu_memory_mib > 60 * 1024 else total)


def vlm_factor(model: ModelFacts) -> float:
    """SGLang's reduction of the default fraction for a model with a vision tower (adjust_mem_fraction_for_vlm,
    0.5.6 server_args.py:4278; 0.5.23 arg_groups/memory_hook.py:417): 0.95 x clamp(1 - 0.1 x (L x H^2 /
    (24 x 1024^2) - 1), 0.8, 1.05), L and H the tower's layers and width. Kimi-K2.5's tower (27 x 1152) gives 0.910."""
    if not model.is_multimodal:
        return 1.0
    ratio = model.vision_layers * model.vision_hidden**2 / (24 * 1024**2)
    return 0.95 * max(0.8, min(1.05, 1.0 - 0.1 * (ratio - 1.0)))


def sglang_default_mem_fraction(gpu_memory_mib: int, layout: Layout, model: ModelFacts, release: Release,
                                graph_bs: int | None = None) -> float:
    """SGLang's default --mem-fraction-static: round((gpu_mem - reserved) / gpu_mem, 3), times the VLM factor."""
    reserve = sglang_reserve(gpu_memory_mib, layout, model, release, graph_bs)
    return round((gpu_memory_mib - reserve.total) / gpu_memory_mib, 3) * vlm_factor(model)


def sglang_default_max_running_requests(capacity_tokens: int, context_length: int) -> int:
    """SGLang's derived --max-running-requests for one scheduler, capped at half its token capacity (0.5.9+
    mem_cache/kv_cache_configurator.py; 0.5.6 model_runner.py:1680 + tp_worker)."""
    derived = min(max(int(capacity_tokens / context_length * 512), 2048), 4096)
    return max(1, min(derived, capacity_tokens // 2))


# --------------------------------------------------------------------------------------------------------------
# The KV cache and what fits.


def mm_reserved_from_kv(model: ModelFacts, release: Release) -> float:
    """MiB a multimodal model's cache takes out of the KV budget rather than the slack: from 0.5.20 SGLang subtracts
    it from the KV pool (0.5.23 mem_cache/kv_cache_configurator.py:202-219, :3034-3038; present in 0.5.20, absent in
    0.5.16; 0.5.17-0.5.19 not read and treated as before, the slack side, which over-reserves 100 MiB at most)."""
    return MM_CACHE_MIB if model.is_multimodal and _since(release, "0.5.20") else 0.0


def req_to_token_mib(rows: int, context_length: int) -> float:
    """MiB of one scheduler's req_to_token pool: (rows + 1) x (context_length + 4) int32 (memory_pool.py:406),
    allocated after the KV budget is fixed (model_executor/pool_configurator.py:637-647 subtracts no such pool), so
    it lives in the slack outside --mem-fraction-static."""
    return (rows + 1) * (context_length + REQ_TO_TOKEN_EXTRA) * 4 / MIB


def kv_dtype_bytes(kv_cache_dtype: str) -> float:
    """Bytes per cached element for a --kv-cache-dtype value."""
    if kv_cache_dtype == "auto":
        return AUTO_KV_BYTES
    if kv_cache_dtype not in KV_DTYPE_BYTES:
        known = ", ".join(["auto", *KV_DTYPE_BYTES])
        raise PlanError(f"spec.server.kvCacheDtype {kv_cache_dtype!r} is not one SGLang knows; use one of {known}")
    return KV_DTYPE_BYTES[kv_cache_dtype]


def kv_heads_per_rank(model: ModelFacts, tp: int) -> int:
    """KV heads one rank holds: split across ranks, replicated when there are fewer heads than ranks."""
    return max(1, model.num_kv_heads // tp)


def kv_bytes_per_token_per_rank(model: ModelFacts, tp: int, element_bytes: float) -> int:
    """KV-cache bytes one token takes on each rank of an attention group of `tp` GPUs."""
    if model.is_mla:
        # All heads share the latent, so every rank caches all of it: TP does not split an MLA cache.
        width = (model.kv_lora_rank or 0) + (model.qk_rope_head_dim or 0)
    else:
        width = 2 * kv_heads_per_rank(model, tp) * model.head_dim  # K and V
    return math.ceil(width * element_bytes * model.num_layers)


def weight_bytes_per_gpu(model: ModelFacts, layout: Layout) -> int:
    """Weights one GPU holds: attention and the token embedding are split over the attention group (whole on each
    GPU with DP attention over every rank), the vision tower is replicated on every rank (its MLP and projector are
    plain or ReplicatedLinear layers: 0.5.9 models/kimi_vl_moonvit.py:399, 0.5.23 models/kimi_k25.py:603), and
    the rest (MLPs, experts, LM head) is split over all TP ranks."""
    w = model.weights()
    split_by_group = w.attention + w.embedding
    rest = w.served - split_by_group - w.vision
    return math.ceil(split_by_group / layout.attention_tp + rest / layout.tp + w.vision)


@dataclass(frozen=True)
class Capacity:
    """Memory arithmetic of one replica in one layout, seen from one rank (all ranks are alike)."""

    layout: Layout
    mem_fraction: float
    usable_bytes: int  # per GPU: mem_fraction x the memory free before loading holds weights + KV pool
    weight_bytes_per_gpu: int
    kv_room_bytes: int  # per GPU; negative when the weights alone do not fit
    kv_bytes_per_rank: int  # per token
    tokens_per_group: int  # KV tokens one attention group holds

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def tokens(self) -> int:
        """KV tokens of the whole replica: every attention group has its own pool."""
        return self.tokens_per_group * self.layout.attention_dp

    @property
    def fits(self) -> bool:
        return self.kv_room_bytes > 0


def replica_capacity(model: ModelFacts, gpu_memory_mib: int, layout: Layout, mem_fraction: float,
                     element_bytes: float, kv_reserved_mib: float = 0.0,
                     pre_load_mib: float = PRE_LOAD_USED_MIB) -> Capacity:
    """Weights per GPU, KV room per GPU and KV capacity in tokens of one replica in `layout`, as SGLang sizes it:
    the fraction of the memory free before loading, less the weights and what it reserves out of the KV budget
    (kv_cache_configurator.py:2990-3038)."""
    usable = int(mem_fraction * max(gpu_memory_mib - pre_load_mib, 0) * MIB)
    per_gpu = weight_bytes_per_gpu(model, layout)
    room = usable - per_gpu - int(kv_reserved_mib * MIB)
    per_rank = kv_bytes_per_token_per_rank(model, layout.attention_tp, element_bytes)
    return Capacity(layout, mem_fraction, usable, per_gpu, room, per_rank, max(0, room // per_rank))
