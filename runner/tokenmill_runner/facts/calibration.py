"""Published throughput measurements as records the throughput model predicts: the calibration set of
docs/throughput-calibration.yaml. Pure: the caller reads the YAML and the model fixtures.

Each record names a model, a GPU, a layout and a workload; `predict` runs the same step-time model the planner
uses. Offline (max-throughput) records get their batch from the KV cache the weights leave, as the planner's does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from .hardware import Gpu, find
from .model_facts import ModelFacts, model_facts
from .throughput import (
    CALIBRATION,
    KV_AUTO_BYTES,
    Calibration,
    Layout,
    StepModel,
    kv_bytes_per_token,
    kv_shards,
    serving_tokens_per_second,
)

_KV_ELEMENT_BYTES = {"auto": KV_AUTO_BYTES, "bf16": 2.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0}
MIB = 1024**2
GIB = 1024**3
# TensorRT-LLM's KV pool: kv_cache_free_gpu_mem_fraction 0.9 of what is free after the weights and ~2 GiB of
# activations and runtime buffers (perf-overview: 0.90-0.95).
TRTLLM_KV_FRACTION = 0.9
TRTLLM_RUNTIME_BYTES = 2 * GIB


class CalibrationError(ValueError):
    """A record that cannot be predicted; the message names the record and the field."""


@dataclass(frozen=True)
class Record:
    id: str
    fit: bool
    reason: str
    source: str
    engine: str
    model: ModelFacts
    gpu: Gpu
    layout: Layout
    kind: Literal["serving", "batch", "offline"]
    prompt_tokens: float
    output_tokens: float
    published: float
    batch: float | None = None
    kv_element_bytes: float = KV_AUTO_BYTES
    mem_fraction: float | None = None
    trtllm_kv: bool = False

    def step_model(self, cal: Calibration = CALIBRATION) -> StepModel:
        return StepModel(self.model, self.gpu, self.layout, self.kv_element_bytes, cal)


def _requantized(config: dict[str, Any], quantization: dict[str, Any] | None) -> tuple[dict[str, Any], int | None]:
    if not quantization:
        return config, None
    quant = {"quant_method": quantization["quant_method"]}
    if quantization["quant_method"] == "modelopt":
        quant["quant_algo"] = "NVFP4"
    text_config = config.get("text_config")
    target: dict[str, Any] = text_config if isinstance(text_config, dict) else config
    updated = {**target, "quantization_config": quant}
    if target is config:
        return updated, int(quantization["weight_bytes"])
    return {**config, "text_config": updated}, int(quantization["weight_bytes"])


def load_record(raw: dict[str, Any], models: dict[str, dict[str, Any]]) -> Record:
    ident = raw.get("id", "<no id>")
    try:
        fixture = models[raw["model"]]
        gpu = find(raw["gpu"])
        if gpu is None:
            raise CalibrationError(f"record {ident}: unknown gpu {raw['gpu']!r}")
        config, weight_bytes = _requantized(fixture["config"], raw.get("quantization"))
        layout = Layout(**raw["layout"])
        return Record(
            id=ident, fit=bool(raw["fit"]), reason=raw.get("reason", ""), source=raw["source"], engine=raw["engine"],
            model=model_facts(config, weight_bytes or int(fixture["weight_bytes"])), gpu=gpu, layout=layout,
            kind=raw["kind"], prompt_tokens=float(raw["prompt_tokens"]), output_tokens=float(raw["output_tokens"]),
            published=float(raw["published"]), batch=float(raw["batch"]) if "batch" in raw else None,
            kv_element_bytes=_KV_ELEMENT_BYTES[raw.get("kv_dtype", "auto")],
            mem_fraction=raw.get("mem_fraction"), trtllm_kv=raw.get("engine_kv") == "trtllm",
        )
    except KeyError as error:
        raise CalibrationError(f"record {ident}: missing or unknown {error}") from None


def load_records(document: dict[str, Any], models: dict[str, dict[str, Any]]) -> list[Record]:
    return [load_record(raw, models) for raw in document["records"]]


def offline_batch(record: Record) -> float:
    """Requests the KV cache holds at once when every request is queued: the pool each GPU has after its share
    of the weights, over the tokens a request holds (SGLang admits against its growing length, about prompt +
    half the output on average; TensorRT-LLM reserves the whole prompt + output)."""
    model, gpu, layout = record.model, record.gpu, record.layout
    weights = model.weights()
    per_gpu_weights = (weights.attention / layout.attention_tp + weights.vision
                       + (weights.served - weights.attention - weights.vision) / layout.tp)
    memory = gpu.memory_mib * MIB
    if record.trtllm_kv:
        pool = TRTLLM_KV_FRACTION * (memory - per_gpu_weights - TRTLLM_RUNTIME_BYTES)
        held = record.prompt_tokens + record.output_tokens
    else:
        pool = (record.mem_fraction or 0.88) * memory - per_gpu_weights
        held = record.prompt_tokens + record.output_tokens / 2
    per_token = kv_bytes_per_token(model, record.kv_element_bytes) / kv_shards(model, layout.attention_tp)
    tokens_per_group = max(pool, 0.0) / per_token
    return max(1.0, tokens_per_group * layout.attention_dp / held)


def predict(record: Record, cal: Calibration = CALIBRATION) -> float:
    """Output tokens/s the throughput model predicts for the record's configuration and workload."""
    step = record.step_model(cal)
    if record.kind == "batch":
        batch = record.batch or 1.0
        return step.decode_tokens_per_second(batch, record.prompt_tokens + record.output_tokens / 2)
    batch = record.batch if record.kind == "serving" and record.batch else offline_batch(record)
    return serving_tokens_per_second(step, batch, record.prompt_tokens, record.output_tokens)


def with_calibration(record: Record, **changes: Any) -> Record:
    return replace(record, **changes)
