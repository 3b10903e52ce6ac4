"""What planning and throughput prediction need from a model: its config.json (multimodal wrappers included) and
its total weight size, split into the parts that are read differently in a decode step. Pure.

The split matters because the parts scale differently: attention weights are replicated under DP attention, the
routed experts of a mixture-of-experts model are read only where a token goes, a vision tower is replicated on
every rank. Parameter counts come from the config's shapes; the bytes of the routed experts are what the
checkpoint's total (model.safetensors.index.json) leaves after the other parts, so a quantization the parser
does not know still adds up to the real size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, TypedDict

# Keys for the same quantity across config.json families (Llama/DeepSeek, GPT-2/Falcon, ChatGLM, ...).
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
# SGLang's own order (utils/hf_transformers/common.py:668 CONTEXT_LENGTH_KEYS in 0.5.23, same list in 0.5.6
# utils/hf_transformers_utils.py:327): the first key present wins.
SGLANG_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")
_GPT2_CONTEXT_KEYS = ("n_positions",)
# Multimodal wrappers keep the language model's config under one of these (Kimi-K2.5: text_config); SGLang's
# get_hf_text_config reads the same (0.5.23 utils/hf_transformers/common.py:566).
_LLM_SUBCONFIG_KEYS = ("text_config", "llm_config", "language_config", "thinker_config")

BF16_BYTES = 2.0


class ModelConfigError(ValueError):
    """config.json lacks something planning needs; the message names the key."""


@dataclass(frozen=True)
class WeightSplit:
    """Bytes of each part of the weights (their sum is the checkpoint's total)."""

    attention: int  # per layer q/k/v/o (or MLA) projections, all layers
    dense: int  # dense MLPs, shared experts, routers, norms: split by TP, read whole every step
    embedding: int  # token embedding (a lookup: read only for the batch's tokens)
    lm_head: int  # read whole every step
    routed: int  # routed experts of MoE layers: read only where tokens go
    vision: int  # a multimodal model's vision tower and projector: replicated on every rank, idle for text
    extra: int  # weights SGLang does not load for serving (multi-token-prediction layers)

    @property
    def total(self) -> int:
        return self.attention + self.dense + self.embedding + self.lm_head + self.routed + self.vision + self.extra

    @property
    def served(self) -> int:
        return self.total - self.extra


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
    # The context length SGLang derives from the config (first of SGLANG_CONTEXT_KEYS, times the rope factor
    # unless the rope scaling says the positions are already extended); it refuses a longer --context-length.
    sglang_context_length: int | None = None
    context_key: str | None = None
    rope_factor: float = 1.0
    vocab_size: int = 0
    intermediate_size: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    routed_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate: int = 0  # all shared experts of one MoE layer together
    moe_layers: int = 0
    tied_embeddings: bool = False
    vision_layers: int = 0
    vision_hidden: int = 0
    vision_intermediate: int = 0
    vision_projector_params: int = 0
    mtp_layers: int = 0  # DeepSeek-style multi-token-prediction layers in the checkpoint (not served)
    quant_method: str | None = None  # quantization_config.quant_method
    routed_bits: float = 16.0  # bits per routed-expert weight, scales included
    other_bits: float = 16.0  # bits per weight of the other linear layers
    compute_dtype: str = "bf16"  # dtype the GEMMs run in: fp8 for fp8 checkpoints, bf16 for weight-only int4
    # DeepSeek sparse attention (DSA, DeepSeek-V3.2 / GLM-5): config.json has the indexer's index_topk, the test
    # SGLang itself makes (0.5.9 configs/model_config.py:54-67; 0.5.23 configs/model_config.py:191).
    sparse_attention: bool = False

    @property
    def is_mla(self) -> bool:
        """DeepSeek-V3 / Kimi-K2 multi-head latent attention: one compressed latent per token and layer."""
        return self.kv_lora_rank is not None and self.qk_rope_head_dim is not None

    @property
    def is_moe(self) -> bool:
        return self.routed_experts > 0 and self.experts_per_token > 0 and self.moe_layers > 0

    @property
    def is_multimodal(self) -> bool:
        return self.vision_layers > 0

    # ------------------------------------------------------------------------------------------------------------
    # Parameter counts from the shapes.

    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.is_mla:
            nope = self.qk_nope_head_dim or 128
            v = self.v_head_dim or 128
            rope = self.qk_rope_head_dim or 0
            q_head = nope + rope
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank * self.num_attention_heads * q_head
            else:
                q = h * self.num_attention_heads * q_head
            kv = h * ((self.kv_lora_rank or 0) + rope) + (self.kv_lora_rank or 0) * self.num_attention_heads * (nope + v)
            return q + kv + self.num_attention_heads * v * h
        q = h * self.num_attention_heads * self.head_dim
        kv = 2 * h * self.num_kv_heads * self.head_dim
        return q + kv + self.num_attention_heads * self.head_dim * h

    def routed_params(self) -> int:
        return self.moe_layers * self.routed_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def dense_params(self) -> int:
        dense_layers = self.num_layers - self.moe_layers
        mlp = dense_layers * 3 * self.hidden_size * self.intermediate_size
        shared = self.moe_layers * 3 * self.hidden_size * self.shared_expert_intermediate
        router = self.moe_layers * self.hidden_size * self.routed_experts
        return mlp + shared + router

    def vision_params(self) -> int:
        if not self.vision_layers:
            return 0
        h, inner = self.vision_hidden, self.vision_intermediate
        return self.vision_layers * (4 * h * h + 2 * h * inner) + self.vision_projector_params

    def active_params_per_token(self) -> int:
        return _active(self)

    def _active(self) -> int:
        """Weights one token multiplies through in a decode step (the routed experts it goes to only)."""
        attention = self.num_layers * self.attention_params_per_layer()
        routed = self.moe_layers * self.experts_per_token * 3 * self.hidden_size * self.moe_intermediate_size
        return attention + self.dense_params() + routed + self.vocab_size * self.hidden_size

    def weights(self) -> WeightSplit:
        """The checkpoint's total split into parts; the routed experts (or, for a dense model, every part alike)
        absorb the difference between the shapes' estimate and the real total."""
        return _weights(self)

    def _split(self) -> WeightSplit:
        other = self.other_bits / 8
        attention = self.num_layers * self.attention_params_per_layer() * other
        dense = self.dense_params() * other
        embedding = self.vocab_size * self.hidden_size * BF16_BYTES
        lm_head = 0.0 if self.tied_embeddings else embedding
        vision = self.vision_params() * BF16_BYTES
        per_layer = (self.attention_params_per_layer() + (self.dense_params() + self.routed_params())
                     / max(self.num_layers, 1)) * other
        extra = self.mtp_layers * per_layer
        fixed = attention + dense + embedding + lm_head + vision + extra
        if self.is_moe and fixed < self.weight_bytes:
            routed = self.weight_bytes - fixed
        else:  # a dense model, or shapes that over-count: scale every part to the real total
            routed_estimate = self.routed_params() * self.routed_bits / 8
            scale = self.weight_bytes / max(fixed + routed_estimate, 1.0)
            attention, dense, embedding, lm_head, vision, extra = (
                part * scale for part in (attention, dense, embedding, lm_head, vision, extra))
            routed = routed_estimate * scale
        parts = [int(attention), int(dense), int(embedding), int(lm_head), int(routed), int(vision), int(extra)]
        parts[4] += self.weight_bytes - sum(parts)  # rounding goes to the largest part
        return WeightSplit(*parts)


@cache
def _active(model: ModelFacts) -> int:
    return model._active()  # noqa: SLF001


@cache
def _weights(model: ModelFacts) -> WeightSplit:
    return model._split()  # noqa: SLF001 - the cache of the method itself


# ----------------------------------------------------------------------------------------------------------------
# Parsing.


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


def _first_key(config: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    return next((key for key in keys if config.get(key) is not None), None)


def _required_int(config: dict[str, Any], keys: tuple[str, ...]) -> int:
    value = _first(config, keys)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        others = ", ".join(keys[1:]) or "no other key"
        raise ModelConfigError(f"config.json has no usable {keys[0]} (also tried {others})")
    return value


def _int(config: dict[str, Any], *keys: str, default: int = 0) -> int:
    value = _first(config, keys)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


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


def _rope_factor(llm: dict[str, Any]) -> float:
    # get_context_length (0.5.23 utils/hf_transformers/common.py:677): the factor counts unless the scaling
    # records original_max_position_embeddings (the positions are already the extended ones) or is llama3's.
    rope = llm.get("rope_scaling")
    if not isinstance(rope, dict):
        return 1.0
    if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
        return 1.0
    factor = rope.get("factor", 1)
    return float(factor) if isinstance(factor, (int, float)) else 1.0


class _MoeFacts(TypedDict, total=False):
    routed_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    shared_expert_intermediate: int
    moe_layers: int


class _VisionFacts(TypedDict, total=False):
    vision_layers: int
    vision_hidden: int
    vision_intermediate: int
    vision_projector_params: int


def _moe(llm: dict[str, Any], layers: int) -> _MoeFacts:
    experts = _int(llm, "n_routed_experts", "num_experts", "num_local_experts")
    per_token = _int(llm, "num_experts_per_tok", "num_experts_per_token", "moe_topk", "experts_per_token")
    if not experts or not per_token:
        return {}
    first_dense = _int(llm, "first_k_dense_replace")
    step = max(1, _int(llm, "moe_layer_freq", "decoder_sparse_step", default=1))
    moe_layers = len([i for i in range(first_dense, layers) if (i - first_dense) % step == 0])
    moe_inter = _int(llm, "moe_intermediate_size", "intermediate_size")
    shared = _int(llm, "shared_expert_intermediate_size")
    if not shared:
        shared = _int(llm, "n_shared_experts", "num_shared_experts") * moe_inter
    return {"routed_experts": experts, "experts_per_token": per_token, "moe_intermediate_size": moe_inter,
            "shared_expert_intermediate": shared, "moe_layers": moe_layers}


def _quantization(llm: dict[str, Any]) -> dict[str, Any]:
    """Bits per routed-expert and per other weight, and the GEMM dtype, from quantization_config."""
    quant = llm.get("quantization_config")
    dtype = str(llm.get("torch_dtype") or llm.get("dtype") or "bfloat16")
    base = 32.0 if dtype == "float32" else 16.0
    if not isinstance(quant, dict):
        return {"quant_method": None, "routed_bits": base, "other_bits": base, "compute_dtype": "bf16"}
    method = str(quant.get("quant_method") or "")
    if method == "fp8" or quant.get("fmt") in ("e4m3", "e5m2"):
        return {"quant_method": method, "routed_bits": 8.0, "other_bits": 8.0, "compute_dtype": "fp8"}
    if method == "mxfp4":  # gpt-oss: 4-bit experts + an 8-bit scale per 32; attention stays 16-bit
        return {"quant_method": method, "routed_bits": 4.25, "other_bits": 16.0, "compute_dtype": "bf16"}
    if method == "modelopt" or "fp4" in str(quant.get("quant_algo", "")).lower():
        return {"quant_method": method, "routed_bits": 4.5, "other_bits": 4.5, "compute_dtype": "fp4"}
    groups = quant.get("config_groups")
    if isinstance(groups, dict) and groups:  # compressed-tensors, e.g. Kimi's int4 group-32 routed experts
        weights = next(iter(groups.values())).get("weights") or {}
        bits = float(weights.get("num_bits") or 16)
        group = float(weights.get("group_size") or 128)
        routed = bits + 16.0 / group  # a 16-bit scale per group
        return {"quant_method": method, "routed_bits": routed,
                "other_bits": base if quant.get("ignore") else routed,
                "compute_dtype": "fp8" if bits == 8 and weights.get("type") == "float" else "bf16"}
    bits = float(quant.get("bits") or quant.get("w_bit") or 16)  # awq / gptq
    return {"quant_method": method, "routed_bits": bits + 16.0 / 128, "other_bits": bits + 16.0 / 128,
            "compute_dtype": "bf16"}


def _vision(config: dict[str, Any], text_hidden: int) -> _VisionFacts:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return {}
    layers = _int(vision, "num_hidden_layers", "vt_num_hidden_layers", "depth", "num_layers")
    hidden = _int(vision, "hidden_size", "vt_hidden_size", "embed_dim", "width")
    inner = _int(vision, "intermediate_size", "vt_intermediate_size", "mlp_dim") or 4 * hidden
    if not layers or not hidden:
        return {}
    merge = vision.get("merge_kernel_size") or [2, 2]
    merged = hidden * (int(merge[0]) * int(merge[1]) if isinstance(merge, list) and len(merge) == 2 else 1)
    projector = merged * merged + merged * text_hidden  # a two-layer projector into the language model's width
    return {"vision_layers": layers, "vision_hidden": hidden, "vision_intermediate": inner,
            "vision_projector_params": projector}


def model_facts(config: dict[str, Any], weight_bytes: int) -> ModelFacts:
    """Parse a config.json dict (multimodal wrappers included) and the total weight size into ModelFacts."""
    if weight_bytes <= 0:
        raise ModelConfigError(f"weight size must be positive; got {weight_bytes} (set spec.model.weightBytes)")
    llm, nested_under = _llm_config(config)
    hidden = _required_int(llm, _HIDDEN_KEYS)
    heads = _required_int(llm, _HEAD_KEYS)
    layers = _required_int(llm, _LAYER_KEYS)
    context_key = _first_key(llm, SGLANG_CONTEXT_KEYS)
    rope = _rope_factor(llm)
    positions = _required_int(llm, ("max_position_embeddings", *_GPT2_CONTEXT_KEYS, "seq_length",
                                    "max_sequence_length"))
    architectures = config.get("architectures") or llm.get("architectures") or [None]
    return ModelFacts(
        architecture=architectures[0],
        model_type=llm.get("model_type"),
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(_first(llm, _KV_HEAD_KEYS) or heads),  # absent: plain multi-head attention
        head_dim=int(llm.get("head_dim") or hidden // heads),
        max_position_embeddings=positions,
        # transformers 5 writes "dtype", older versions "torch_dtype".
        torch_dtype=llm.get("torch_dtype") or llm.get("dtype"),
        weight_bytes=weight_bytes,
        kv_lora_rank=llm.get("kv_lora_rank"),
        qk_rope_head_dim=llm.get("qk_rope_head_dim"),
        nested_under=nested_under,
        sglang_context_length=int(rope * llm[context_key]) if context_key else None,
        context_key=context_key,
        rope_factor=rope,
        vocab_size=_int(llm, "vocab_size", "padded_vocab_size"),
        intermediate_size=_int(llm, "intermediate_size", "ffn_hidden_size", "n_inner", default=4 * hidden),
        q_lora_rank=llm.get("q_lora_rank"),
        qk_nope_head_dim=llm.get("qk_nope_head_dim"),
        v_head_dim=llm.get("v_head_dim"),
        tied_embeddings=bool(llm.get("tie_word_embeddings", False)),
        mtp_layers=_int(llm, "num_nextn_predict_layers"),
        sparse_attention=llm.get("index_topk") is not None,
        **_moe(llm, layers),
        **_vision(config, hidden),
        **_quantization(llm),
    )
