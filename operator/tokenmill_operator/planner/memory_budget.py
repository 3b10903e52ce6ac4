"""The memory decision: --mem-fraction-static, --chunked-prefill-size and the decode CUDA-graph batch chosen
together from what each costs, instead of SGLang's one-size reserve. Pure.

SGLang's default (memory.py) reserves 512 + 1.5 MiB per prefill-chunk token + 2 MiB per graph batch, at least
10 GiB on a GPU over 60 GB, and takes another 5-14 % for a vision tower: the same for a 1-trillion-parameter MoE at
TP 8 as for an 8B dense model on one GPU. On 96 GB cards holding 70 GiB of Kimi-K2.5 weights that reserve is most
of what the KV cache could have. Here each use of the memory outside the static pool (weights + KV) is a term
derived from the release's own code for this model and layout, plus a stated margin; the fraction is what is left.

With --mem-fraction-static given, SGLang sizes the KV pool as the free memory after loading the weights minus
(1 - fraction) x the free memory before (0.5.23 mem_cache/kv_cache_configurator.py:2990-3040), and everything
allocated after that (activations, CUDA graphs, attention workspaces, multimodal caches) must fit in that slack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill_runner.facts.model_facts import ModelFacts
from tokenmill_runner.facts.releases import Release, version_key
from tokenmill_runner.facts.throughput import Layout

from .memory import chunk_and_graph_bs, prefill_graph_sizes

ACTIVATION_BYTES = 2  # bf16 activations, also for fp8/int4 checkpoints (they dequantize into 16-bit GEMMs)
LOGIT_BYTES = 4  # SGLang samples from float32 logits over the whole vocabulary on every rank
# The smallest chunk the plan proposes: below it a prompt of the seeds' datasets (up to ~1,100 tokens) would take
# several forwards, and SGLang's own activation term counts at least 2,048 tokens anyway
# (arg_groups/memory_hook.py:310).
MIN_CHUNK = 2048
# What the terms do not count: the CUDA context and NCCL communicators created before the weights load (the
# fraction is of the memory free then, kv_cache_configurator.py:3007, so they are outside it already, but the
# context grows with the first kernels), cuBLAS/cuDNN workspaces, and the caching allocator's fragmentation.
MARGIN_FIXED_MIB = 2048
MARGIN_SHARE = 0.02


@dataclass(frozen=True)
class Term:
    """One use of GPU memory outside the static pool, MiB per GPU, with where the number comes from."""

    name: str
    mib: float
    source: str


@dataclass(frozen=True)
class MemorySplit:
    """How one GPU's memory is split: the fraction SGLang gets, the chunk and decode-graph batch it assumes, and
    the terms outside the fraction. `decided` False: SGLang's own default rule (memory.py), terms not itemised."""

    mem_fraction: float
    chunk: int
    graph_bs: int
    terms: tuple[Term, ...]
    decided: bool

    @property
    def reserved_mib(self) -> float:
        return sum(term.mib for term in self.terms)

    @property
    def chunk_flag(self) -> int | None:
        """The --chunked-prefill-size the plan passes: its decided chunk, None under SGLang's default rule."""
        return self.chunk if self.decided else None


def activation_bytes_per_token(model: ModelFacts, layout: Layout) -> float:
    """Peak activation bytes per prefill token on one rank: the hidden states a layer keeps (input, residual,
    output) plus the larger of its attention and MLP working sets.

    MoE: the fused Triton MoE holds (tokens x top-k, N) for gate/up with N = 2 x moe_intermediate / TP, then the
    activated half, then (tokens, top-k, hidden) for the down projection, the gate/up buffer freed before the last
    (0.5.23 layers/moe/moe_runner/triton_utils/fused_moe.py:665, :713, :872-878). With DP attention every group's
    tokens meet in the MoE, so its working set is the groups' chunks together. Dense MLP: gate/up and the
    activated half. Attention: MLA expands the latent into per-head keys and values for prefill; grouped heads
    project q, k and v. Logits are computed only for each prompt's last token in prefill."""
    tp, atp = layout.tp, layout.attention_tp
    hidden = 3 * model.hidden_size
    heads = max(1, model.num_attention_heads // atp)
    if model.is_mla:
        qk = (model.qk_nope_head_dim or 128) + (model.qk_rope_head_dim or 64)
        attention = heads * (qk + (model.qk_nope_head_dim or 128) + (model.v_head_dim or 128)) + (
            (model.kv_lora_rank or 0) + (model.qk_rope_head_dim or 0))
    else:
        kv_heads = max(1, model.num_kv_heads // atp)
        attention = (2 * heads + 2 * kv_heads) * model.head_dim
    dense_mlp = 3 * model.intermediate_size / tp
    if model.is_moe:
        n = 2 * model.moe_intermediate_size / tp
        routed = model.experts_per_token * max(n + n / 2, n / 2 + model.hidden_size) * layout.attention_dp
        mlp = max(dense_mlp, routed + 3 * model.shared_expert_intermediate / tp)
    else:
        mlp = dense_mlp
    return ACTIVATION_BYTES * (hidden + max(attention, mlp))


def known(model: ModelFacts) -> bool:
    """Whether config.json says enough for the activation and logit terms; otherwise SGLang's default rule."""
    mlp = model.moe_intermediate_size if model.is_moe else model.intermediate_size
    return bool(model.hidden_size and model.vocab_size and mlp)


def _since(release: Release, first: str) -> bool:
    return version_key(release.version) >= version_key(first)


def terms(gpu_memory_mib: int, layout: Layout, model: ModelFacts, release: Release, chunk: int, graph_bs: int,
          deterministic: bool = False) -> tuple[Term, ...]:
    """Every use of one GPU's memory outside the static pool for this model, layout, chunk and graph batch."""
    groups = layout.attention_dp
    found = [
        Term("prefill activations", chunk * activation_bytes_per_token(model, layout) / 2**20,
             f"{chunk:,} chunk tokens x {activation_bytes_per_token(model, layout) / 1024:,.1f} KiB: hidden states + "
             f"the larger of attention and the {'fused MoE buffers' if model.is_moe else 'MLP'} "
             f"(fused_moe.py:665-878)"),
        Term("sampling logits", graph_bs * model.vocab_size * LOGIT_BYTES / 2**20,
             f"{graph_bs} running x {model.vocab_size:,} vocabulary x 4 B float32 (layers/logits_processor.py:1368)"),
        Term("attention workspace", 2048.0 if deterministic else 384.0,
             "FlashInfer workspace, 2 GiB with deterministic inference (environ.py:1221, "
             "flashinfer_backend.py:451)"),
        Term("decode CUDA graphs", graph_bs * 2.0,
             f"{graph_bs} captured batch x 2 MiB, SGLang's own estimate (arg_groups/memory_hook.py:368)"),
    ]
    if groups > 1:
        padding = graph_bs * groups * 3.0 + (graph_bs * groups * 1.5 if graph_bs > 300 else 0.0)
        found.append(Term("DP-attention padding", padding,
                          f"{graph_bs} x {groups} groups x {'4.5' if graph_bs > 300 else '3'} MiB "
                          f"(memory_hook.py:376-378)"))
    if _since(release, "0.5.10.post1"):
        prefill = 1536.0 if model.is_mla else prefill_graph_sizes(chunk) * 8.0
        found.append(Term("prefill CUDA graphs", prefill,
                          "MLA backend 1.5 GiB (memory_hook.py:389)" if model.is_mla else
                          f"{prefill_graph_sizes(chunk)} captured sizes x 8 MiB (memory_hook.py:386)"))
    if layout.tp > 1:
        found.append(Term("NCCL and all-reduce buffers", layout.tp / 8 * 1024,
                          f"TP {layout.tp} / 8 x 1 GiB (memory_hook.py:312)"))
    if model.is_multimodal:
        found.append(Term("multimodal cache", 100.0,
                          "SGLANG_VLM_CACHE_SIZE_MB, taken from the KV budget (kv_cache_configurator.py:202-219, "
                          ":3034); the vision tower never runs: tokenmill sends token ids only"))
    margin = MARGIN_FIXED_MIB + MARGIN_SHARE * gpu_memory_mib
    found.append(Term("safety margin", margin,
                      f"{MARGIN_FIXED_MIB:,} MiB + {MARGIN_SHARE:.0%} of the GPU: CUDA context growth, cuBLAS "
                      f"workspaces, allocator fragmentation"))
    return tuple(found)


def decided_split(gpu_memory_mib: int, layout: Layout, model: ModelFacts, release: Release, chunk: int,
                  graph_bs: int, deterministic: bool = False) -> MemorySplit | None:
    """The fraction that leaves room for every term, rounded down to SGLang's 3 decimals; None when the terms
    alone take the GPU."""
    found = terms(gpu_memory_mib, layout, model, release, chunk, graph_bs, deterministic)
    free = gpu_memory_mib - sum(term.mib for term in found)
    if free <= 0:
        return None
    return MemorySplit(math.floor(free / gpu_memory_mib * 1000) / 1000, chunk, graph_bs, found, decided=True)


def chunk_options(gpu_memory_mib: int, layout: Layout, release: Release) -> list[int]:
    """Prefill chunks to weigh: SGLang's tier chunk and its halves down to MIN_CHUNK."""
    tier, _ = chunk_and_graph_bs(gpu_memory_mib, layout.tp, release)
    options = [tier]
    while options[-1] // 2 >= MIN_CHUNK:
        options.append(options[-1] // 2)
    return options


def graph_bs_for(batch_per_group: float, tier_bs: int) -> int:
    """The decode CUDA-graph batch for a group expected to run `batch_per_group`: a quarter above it for the
    ups and downs of a long-tailed job, rounded up to 16 (SGLang captures every 8 up to 256 and always its
    max, cuda_graph_hook.py:511-530), at most the release's tier value."""
    return int(min(tier_bs, max(16, math.ceil(batch_per_group * 1.25 / 16) * 16)))
