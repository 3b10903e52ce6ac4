"""The model's own sampling defaults (generation_config.json), applied where the spec is silent. Pure.

SGLang applies generation_config.json only to its OpenAI-compatible chat API, never to /generate: in v0.5.9
`ModelConfig.get_default_sampling_params` (configs/model_config.py:1052-1082) is read by
`entrypoints/openai/serving_chat.py:103-113` alone, while /generate merges nothing but --preferred-sampling-params
(`managers/tokenizer_manager.py:907-908`) over the request. v0.5.23 is the same: serving_chat.py:417 and the Rust
server's chat conversions (rust_server/config.py:158-165) read the defaults, /generate merges only the preferred
parameters (tokenizer_manager.py:1550). A run through /generate would otherwise sample at
SGLang's class defaults (temperature 1.0, top_p 1.0, ...) instead of what the model's authors ship.
"""

from __future__ import annotations

from typing import Any

from ..spec.resource import SamplingSpec

# generation_config.json keys SGLang reads as sampling defaults (model_config.py:1070-1076), by spec field.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty"}
# SGLang's SamplingParams defaults (sampling/sampling_params.py), what /generate uses for a missing key.
SGLANG_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                   "repetition_penalty": 1.0}
DECIMAL_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty")


def model_sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling values generation_config.json sets, as spec field values."""
    found: dict[str, Any] = {}
    for field, key in GENERATION_CONFIG_KEYS.items():
        value = generation_config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        found[field] = repr(float(value)) if field in DECIMAL_FIELDS else int(value)
    return found


def apply_model_defaults(sampling: SamplingSpec, model_defaults: dict[str, Any]) -> tuple[SamplingSpec, dict[str, dict[str, Any]]]:
    """(sampling with the model's defaults filled in where the spec left a field unset, where each value came from)."""
    filled = {field: value for field, value in model_defaults.items() if getattr(sampling, field) is None}
    effective = sampling.model_copy(update=filled)
    sources: dict[str, dict[str, Any]] = {}
    for field, default in SGLANG_DEFAULTS.items():
        value = getattr(effective, field)
        if value is None:
            sources[field] = {"value": default, "source": "sglang_default"}
        else:
            number = float(value) if field in DECIMAL_FIELDS else value
            sources[field] = {"value": number, "source": "generation_config" if field in filled else "spec"}
    sources["max_new_tokens"] = {"value": effective.max_new_tokens, "source": "spec"}
    return effective, sources
