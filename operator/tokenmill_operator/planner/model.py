"""What planning needs from a model: its config.json (multimodal wrappers included) and its total weight size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .plan import PlanError

# Keys for the same quantity across config.json families (Llama/DeepSeek, GPT-2/Falcon, ChatGLM, ...).
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length")
# Multimodal wrappers keep the language model's config under one of these (Kimi-K2.5: text_config).
_LLM_SUBCONFIG_KEYS = ("text_config", "llm_config", "language_config")


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
