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

from .dp_attention import chunk_flag_for
from .memory import (
    MM_CACHE_MIB,
    PRE_LOAD_USED_MIB,
    chunk_and_graph_bs,
    mm_reserved_from_kv,
    prefill_graph_sizes,
    req_to_token_mib,
)

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
# The triton MLA decode kernel's split-KV count: triton_attention_num_kv_splits (8, 0.5.23
# arg_groups/fields/exec_.py:413) raised to min(next power of two of the SM count, of context / 32) (0.5.23
# layers/attention/triton_backend.py:83-90, :327-333). Every GPU the facts list with an MLA-capable triton path has
# 129-256 SMs, so the SM side is 256.
TRITON_KV_SPLITS = 8
TRITON_SM_CAP = 256
TRITON_MIN_BLOCK_KV = 32


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def triton_mla_kv_splits(context_length: int) -> int:
    """max_kv_splits of the triton MLA decode backend for a context length (triton_backend.py:83-90)."""
    context_cap = _next_power_of_two(math.ceil(max(context_length, 1) / TRITON_MIN_BLOCK_KV))
    return max(TRITON_KV_SPLITS, min(TRITON_SM_CAP, context_cap))


def mla_decode_backend(arch: str | None) -> str:
    """SGLang's default attention backend for an MLA model on a CUDA GPU: fa3 on Hopper, flashinfer on sm100,
    triton elsewhere (0.5.23 arg_groups/model_override_base.py:336-350)."""
    if arch == "sm90":
        return "fa3"
    if arch in ("sm100", "sm103"):
        return "flashinfer"
    return "triton"


def moe_kernel(model: ModelFacts) -> str:
    """The MoE kernel this checkpoint runs: int4 compressed-tensors experts (wNa16) run Marlin (0.5.23
    layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py:449-473, fused_marlin_moe), the
    others the Triton fused MoE."""
    if model.quant_method == "compressed-tensors" and model.routed_bits < 8:
        return "marlin"
    return "triton"


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
    groups: int = 1  # DP-attention groups: SGLang divides the chunk flag by them

    @property
    def reserved_mib(self) -> float:
        return sum(term.mib for term in self.terms)

    @property
    def chunk_flag(self) -> int | None:
        """The --chunked-prefill-size the plan passes: its decided per-group chunk times the groups (SGLang divides
        it by attn_dp_size, dp_attention.py), None under SGLang's default rule."""
        return chunk_flag_for(self.chunk, self.groups) if self.decided else None

    @property
    def group_chunk(self) -> int | None:
        """The chunk each group prefills per forward when the plan decides it; None: SGLang's tier chunk // groups."""
        return self.chunk if self.decided else None


def activation_bytes_per_token(model: ModelFacts, layout: Layout) -> float:
    """Peak activation bytes per prefill token on one rank: the hidden states a layer keeps (input, residual,
    output) plus the larger of its attention and MLP working sets.

    MoE: the fused MoE holds (tokens x top-k, N) for gate/up with N = 2 x moe_intermediate / TP, then the
    activated half, then (tokens, top-k, hidden) for the down projection: the Triton kernel frees the gate/up buffer
    before the last (0.5.23 layers/moe/moe_runner/triton_utils/fused_moe.py:665, :713, :872-878), Marlin shares one
    buffer for the first and last (0.5.23 layers/moe/fused_moe_triton/fused_marlin_moe.py:295-308), the same peak.
    With DP attention every group's chunk meets in the MoE, so its working set is the groups' chunks together. Dense MLP: gate/up and the
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


def _moe_source(model: ModelFacts) -> str:
    if not model.is_moe:
        return "the MLP"
    if moe_kernel(model) == "marlin":
        return "the Marlin MoE buffers (compressed_tensors_wNa16_moe.py:449-473, fused_marlin_moe.py:295-308)"
    return "the fused MoE buffers (fused_moe.py:665-878)"


# Architectures whose 0.5.23 model collects the aux captures into one preallocated [tokens, K x hidden] buffer
# (layers/aux_hidden_states.py:29-95, AuxHiddenStatePacker; models/deepseek_v2.py:3175, which Kimi-K2.5's language
# model is); the others clone each capture and concatenate them (aux_hidden_states.py:26, :97-102; models/llama.py:485,
# qwen2.py:455, qwen3.py:523, gpt_oss.py:710, glm4_moe.py:948).
PACKED_AUX_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                            "KimiK25ForConditionalGeneration")
# Input-logprob rows per logits chunk (SGLANG_LOGPROB_CHUNK_SIZE, environ.py:1513), and SGLang's own bound on the
# float32 vocabulary matrices one chunk holds with a TP gather (layers/logprob_processor.py:560-564).
LOGPROB_CHUNK_ROWS = 2048
LOGPROB_MATRICES = 3


def aux_capture_terms(model: ModelFacts, layout: Layout, chunk: int, graph_bs: int, aux_layers: int) -> list[Term]:
    """What --enable-return-aux-hidden-states and the capture requests (generate/hidden_capture.py) add on one GPU,
    0.5.23: the captured layers of every token of a prefill chunk, held in up to three copies, the same for each
    token of the decode graphs, and the input-logprob logits the requests ask for (return_logprob from position
    0, so no prefix is taken from the cache). `chunk` is the per-group chunk."""
    row = aux_layers * model.hidden_size * ACTIVATION_BYTES  # one token's captured layers, bf16, on every rank
    packed = model.architecture in PACKED_AUX_ARCHITECTURES
    # Packed: the buffer, then the cat of its logprob rows (layers/logits_processor.py:821-826). Cloned: the K
    # clones, that cat, and the cat returned as the request's states (logits_processor.py:866-869).
    copies = 2 if packed else 3
    # Every decode graph is captured in return_hidden_states_mode full (forward_batch_info.py:324-331,
    # decode_cuda_graph_runner.py:357), its captures in the graphs' shared pool; no shared buffer for EAGLE3
    # (model_runner_components/misc_utils.py:122-131). The states then go to the host, per chunk
    # (managers/scheduler_components/batch_result_processor.py:659): no GPU copy.
    capture = (chunk + graph_bs) * row * copies / 2**20
    # Under DP attention the logits stay one chunk (logprob_processor.py:515-522, skip_chunking_for_dp_attn).
    rows = chunk if layout.attention_dp > 1 else min(chunk, LOGPROB_CHUNK_ROWS)
    logprobs = rows * LOGPROB_MATRICES * model.vocab_size * LOGIT_BYTES / 2**20
    how = "one buffer, then its logprob rows' cat" if packed else "the clones, their cat and the logprob rows' cat"
    return [
        Term("aux hidden-state capture", capture,
             f"({chunk:,} chunk + {graph_bs} graph tokens) x {aux_layers} layers x {model.hidden_size:,} hidden x 2 B"
             f" x {copies} copies ({how}: layers/aux_hidden_states.py, logits_processor.py:821-869; decode graphs "
             f"capture in full mode, decode_cuda_graph_runner.py:357)"),
        Term("capture input logprobs", logprobs,
             f"{rows:,} rows x {LOGPROB_MATRICES} x {model.vocab_size:,} vocabulary x 4 B: the capture requests' "
             f"logprobs from position 0 (logprob_processor.py:515-564, SGLANG_LOGPROB_CHUNK_SIZE "
             f"{LOGPROB_CHUNK_ROWS:,})"),
    ]


def _attention_term(model: ModelFacts, layout: Layout, graph_bs: int, context_length: int, deterministic: bool,
                    arch: str | None, backend: str | None) -> Term:
    chosen = backend or (mla_decode_backend(arch) if model.is_mla else "flashinfer")
    if model.is_mla and chosen == "triton":
        splits = triton_mla_kv_splits(context_length)
        heads = max(1, model.num_attention_heads // layout.attention_tp)
        width = model.kv_lora_rank or 512
        mib = graph_bs * heads * splits * (width + 1) * 4 / 2**20
        return Term("attention workspace", mib,
                    f"triton MLA decode logits: {graph_bs} graph batch x {heads} heads x {splits} KV splits x "
                    f"({width} + 1) x 4 B (triton_backend.py:83-90, :1169-1190; MLA off Hopper/sm100 runs triton, "
                    f"model_override_base.py:336-350)")
    return Term("attention workspace", 2048.0 if deterministic else 384.0,
                f"{chosen} workspace, 2 GiB with deterministic inference (environ.py:1221, "
                f"flashinfer_backend.py:451)")


def terms(gpu_memory_mib: int, layout: Layout, model: ModelFacts, release: Release, chunk: int, graph_bs: int,
          deterministic: bool = False, context_length: int = 0, request_rows: int = 0, arch: str | None = None,
          backend: str | None = None, aux_layers: int = 0) -> tuple[Term, ...]:
    """Every use of one GPU's memory outside the static pool for this model, layout, per-group chunk and graph
    batch: `request_rows` is one scheduler's --max-running-requests share (its req_to_token rows); `aux_layers`
    the hidden-state layers captured (spec.hiddenStates; 0: off)."""
    groups = layout.attention_dp
    per_token = activation_bytes_per_token(model, layout)
    found = [
        Term("prefill activations", chunk * per_token / 2**20,
             f"{chunk:,} chunk tokens per group x {per_token / 1024:,.1f} KiB: hidden states + "
             f"the larger of attention and {_moe_source(model)}"),
        Term("sampling logits", graph_bs * model.vocab_size * LOGIT_BYTES / 2**20,
             f"{graph_bs} running x {model.vocab_size:,} vocabulary x 4 B float32 (layers/logits_processor.py:1368)"),
        _attention_term(model, layout, graph_bs, context_length, deterministic, arch, backend),
        Term("decode CUDA graphs", graph_bs * 2.0,
             f"{graph_bs} captured batch x 2 MiB, SGLang's own estimate (arg_groups/memory_hook.py:368)"),
    ]
    if request_rows and context_length:
        found.append(Term("req_to_token pool", req_to_token_mib(request_rows, context_length),
                          f"({request_rows:,} request slots + 1) x ({context_length:,} context + 4) x 4 B "
                          f"(mem_cache/memory_pool.py:406, kv_cache_configurator.py:3128), allocated after the KV "
                          f"budget"))
    if aux_layers:
        found += aux_capture_terms(model, layout, chunk, graph_bs, aux_layers)
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
    if model.is_multimodal and not mm_reserved_from_kv(model, release):
        found.append(Term("multimodal cache", MM_CACHE_MIB,
                          "SGLANG_VLM_CACHE_SIZE_MB, allocated after the KV pool before 0.5.20 (0.5.16 takes it "
                          "from the slack); the vision tower never runs: tokenmill sends token ids only"))
    margin = MARGIN_FIXED_MIB + MARGIN_SHARE * gpu_memory_mib
    found.append(Term("safety margin", margin,
                      f"{MARGIN_FIXED_MIB:,} MiB + {MARGIN_SHARE:.0%} of the GPU: CUDA context growth, cuBLAS "
                      f"workspaces, allocator fragmentation"))
    return tuple(found)


def decided_split(gpu_memory_mib: int, layout: Layout, model: ModelFacts, release: Release, chunk: int,
                  graph_bs: int, deterministic: bool = False, context_length: int = 0, request_rows: int = 0,
                  arch: str | None = None, backend: str | None = None,
                  pre_load_mib: float | None = None, aux_layers: int = 0) -> MemorySplit | None:
    """The fraction that leaves room for every term, rounded down to SGLang's 3 decimals; None when the terms
    alone take the GPU. The fraction is of the memory free before loading (kv_cache_configurator.py:3007), so the
    slack SGLang leaves is (1 - fraction) x that, and it must hold the terms."""
    found = terms(gpu_memory_mib, layout, model, release, chunk, graph_bs, deterministic, context_length,
                  request_rows, arch, backend, aux_layers)
    before = gpu_memory_mib - (PRE_LOAD_USED_MIB if pre_load_mib is None else pre_load_mib)
    free = before - sum(term.mib for term in found)
    if free <= 0 or before <= 0:
        return None
    return MemorySplit(math.floor(free / before * 1000) / 1000, chunk, graph_bs, found, decided=True,
                       groups=layout.attention_dp)


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
