"""Server planning: known deployments pinned, and the arithmetic checked against numbers computed here by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tokenmill_operator.gpus import GPU_MEMORY_MIB, MEMORY_FIELD, gpu_memory_mib
from tokenmill_operator.planner import (
    MIN_BATCH_REQUESTS,
    ModelFacts,
    PlanError,
    kv_bytes_per_token_per_rank,
    model_facts,
    plan_server,
    render_plan,
    sglang_default_mem_fraction,
)
from tokenmill_runner.spec import DatasetGenerationSpec, parse_document

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
MIB = 1024**2
H200 = "NVIDIA-H200"
H100 = "NVIDIA-H100-80GB-HBM3"
MEMORY_KEY = MEMORY_FIELD.removeprefix("spec.server.")  # the spec's camelCase name for the GPU memory in MiB


def fixture(name: str) -> dict[str, Any]:
    return json.loads((MODELS / f"{name}.json").read_text())


def facts(name: str) -> ModelFacts:
    data = fixture(name)
    return model_facts(data["config"], data["weight_bytes"])


def make_spec(server: dict[str, Any], datasets: list[dict[str, Any]] | None = None,
              model: dict[str, Any] | None = None) -> DatasetGenerationSpec:
    document = {
        "apiVersion": "tokenmill.io/v1alpha1",
        "kind": "DatasetGeneration",
        "metadata": {"name": "plan-test"},
        "spec": {
            "model": model or {"path": "s3://models/m/"},
            "server": server,
            "datasets": datasets or [{"name": "B1_glaive", "source": "s3://p/b1.jsonl"}],
            "output": {"uri": "s3://out/run/"},
        },
    }
    return parse_document(document).spec


def sglang_fraction_by_hand(gpu_mib: int, tp: int) -> float:
    # reference/sglang.md: H100/H200 tiers use chunked prefill 8192 and CUDA-graph max batch 256 (tp < 4) or 512.
    graph_bs = 256 if tp < 4 else 512
    reserved = 512 + max(8192, 2048) * 1.5 + graph_bs * 2 + tp / 8 * 1024
    reserved = max(reserved, 10 * 1024)  # both GPUs have more than 60 GB
    return round((gpu_mib - reserved) / gpu_mib, 3)


def capacity_by_hand(fraction: float, gpu_mib: int, weight_bytes: int, tp: int, per_rank: int) -> int:
    return (int(fraction * gpu_mib * MIB) - math.ceil(weight_bytes / tp)) // per_rank


# ---------------------------------------------------------------------------------------------------------------
# Pinned deployments


def test_kimi_k25_on_eight_h200_is_one_node_tp8():
    plan = plan_server(make_spec({"gpuProduct": H200, "gpusPerNode": 8}), facts("kimi-k2.5"))
    assert (plan.tensor_parallel, plan.nodes_per_replica, plan.gpus_per_node) == (8, 1, 8)
    assert plan.mem_fraction_static == f"{sglang_fraction_by_hand(143771, 8):.3f}" == "0.897"
    assert plan.context_length == 262144
    assert plan.kv_cache_dtype == "auto"
    assert plan.overrides == []


def test_kimi_k25_on_h100_needs_two_nodes_of_eight():
    plan = plan_server(make_spec({"gpuProduct": H100, "gpusPerNode": 8}), facts("kimi-k2.5"))
    assert (plan.tensor_parallel, plan.nodes_per_replica, plan.gpus_per_node) == (16, 2, 8)
    assert plan.mem_fraction_static == f"{sglang_fraction_by_hand(81559, 16):.3f}" == "0.805"
    # TP 8 was tried and rejected because the weights alone overflow an 80 GB GPU.
    assert any(line.startswith("TP 8:") and "do not fit" in line for line in plan.reasoning)


def test_llama_8b_on_one_h100_is_tp1():
    plan = plan_server(make_spec({"gpuProduct": H100, "gpusPerNode": 1}), facts("llama-3.1-8b"))
    assert (plan.tensor_parallel, plan.nodes_per_replica, plan.gpus_per_node) == (1, 1, 1)
    assert plan.concurrent_requests_at_expected_length >= MIN_BATCH_REQUESTS


def test_llama_70b_on_h100_leaves_room_for_a_batch():
    plan = plan_server(make_spec({"gpuProduct": H100}), facts("llama-3.1-70b"))
    assert (plan.tensor_parallel, plan.nodes_per_replica, plan.gpus_per_node) == (4, 1, 4)
    tp2 = next(line for line in plan.reasoning if line.startswith("TP 2:"))
    assert "too small a batch" in tp2 and "rejected" in tp2
    assert plan.concurrent_requests_at_expected_length >= MIN_BATCH_REQUESTS
    assert any(line.startswith("rule:") and f"{MIN_BATCH_REQUESTS} requests" in line for line in plan.reasoning)


# ---------------------------------------------------------------------------------------------------------------
# KV cache arithmetic


def test_mla_kv_bytes_per_token_is_the_latent_replicated_on_every_rank():
    text = fixture("kimi-k2.5")["config"]["text_config"]
    per_rank = (text["kv_lora_rank"] + text["qk_rope_head_dim"]) * 2 * text["num_hidden_layers"]
    assert per_rank == 70272
    model = facts("kimi-k2.5")
    assert model.is_mla and model.nested_under == "text_config" and model.num_layers == 61
    # TP does not split an MLA cache: the same bytes per token on each rank whatever the TP.
    assert {kv_bytes_per_token_per_rank(model, tp, 2.0) for tp in (1, 8, 16)} == {per_rank}

    plan = plan_server(make_spec({"gpuProduct": H200}), model)
    assert plan.kv_bytes_per_token == per_rank * 8
    fraction = sglang_fraction_by_hand(143771, 8)
    assert plan.kv_capacity_tokens == capacity_by_hand(fraction, 143771, 594_000_000_000, 8, per_rank)
    assert plan.concurrent_requests_at_expected_length == plan.kv_capacity_tokens // plan.expected_tokens_per_request
    kv_line = next(line for line in plan.reasoning if line.startswith("KV cache: MLA"))
    assert "(512 + 64) x 2 B x 61 layers = 70,272 B" in kv_line and "each of the 8 TP ranks" in kv_line


def test_gqa_kv_bytes_per_token_is_split_across_ranks():
    config = fixture("llama-3.1-70b")["config"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    full = 2 * config["num_key_value_heads"] * head_dim * 2 * config["num_hidden_layers"]  # K+V, all heads, bf16
    model = facts("llama-3.1-70b")
    assert not model.is_mla and model.head_dim == 128
    assert kv_bytes_per_token_per_rank(model, 1, 2.0) == full == 327680
    assert kv_bytes_per_token_per_rank(model, 4, 2.0) == full // 4
    # 8 KV heads over 16 ranks: one head per rank, replicated, not half a head.
    assert kv_bytes_per_token_per_rank(model, 16, 2.0) == 2 * 1 * 128 * 2 * 80

    plan = plan_server(make_spec({"gpuProduct": H100}), model)
    assert plan.kv_bytes_per_token == full  # 4 ranks x a quarter of the heads each
    fraction = sglang_fraction_by_hand(81559, 4)
    assert plan.kv_capacity_tokens == capacity_by_hand(fraction, 81559, 141_107_412_992, 4, full // 4)


def test_max_running_requests_follows_sglangs_rule():
    plan = plan_server(make_spec({"gpuProduct": H200}), facts("kimi-k2.5"))
    tokens = plan.kv_capacity_tokens
    expected = min(min(max(int(tokens / plan.context_length * 512), 2048), 4096), tokens // 2)
    assert plan.max_running_requests == expected


def test_expected_tokens_come_from_the_largest_max_new_tokens():
    datasets = [{"name": "short", "source": "a.jsonl", "sampling": {"maxNewTokens": 1024}},
                {"name": "long", "source": "b.jsonl", "sampling": {"maxNewTokens": 32768}}]
    plan = plan_server(make_spec({"gpuProduct": H200}, datasets), facts("kimi-k2.5"))
    assert plan.expected_tokens_per_request == 512 + math.ceil(0.15 * 32768)
    assert any("dataset long" in line for line in plan.reasoning)


# ---------------------------------------------------------------------------------------------------------------
# The spec wins


def test_spec_settings_win_and_are_listed():
    server = {"gpuProduct": "NVIDIA-X-Unknown", MEMORY_KEY: 81559, "tensorParallel": 8,
              "memFractionStatic": "0.85", "contextLength": 32768, "maxRunningRequests": 256,
              "kvCacheDtype": "fp8_e4m3"}
    model_spec = {"path": "s3://models/m/", "weightBytes": 150_000_000_000}
    plan = plan_server(make_spec(server, model=model_spec), facts("llama-3.1-70b"))
    assert (plan.tensor_parallel, plan.nodes_per_replica, plan.gpus_per_node) == (8, 1, 8)
    assert plan.mem_fraction_static == "0.85"
    assert plan.context_length == 32768
    assert plan.max_running_requests == 256
    assert plan.kv_cache_dtype == "fp8_e4m3"
    assert plan.gpu_memory_mib == 81559
    assert plan.weight_bytes == 150_000_000_000
    assert plan.kv_bytes_per_token == 2 * 8 * 128 * 1 * 80  # fp8: one byte per element
    assert set(plan.overrides) == {"tensorParallel", "memFractionStatic", "contextLength", "maxRunningRequests",
                                   "kvCacheDtype", MEMORY_KEY, "weightBytes"}
    assert plan.kv_capacity_tokens == capacity_by_hand(0.85, 81559, 150_000_000_000, 8, 2 * 1 * 128 * 80)


def test_a_given_tp_with_a_small_batch_is_kept_with_a_warning_and_the_fp8_option():
    server = {"gpuProduct": H100, "tensorParallel": 2, "memFractionStatic": "0.9"}
    plan = plan_server(make_spec(server), facts("llama-3.1-70b"))
    assert plan.tensor_parallel == 2
    assert plan.concurrent_requests_at_expected_length < MIN_BATCH_REQUESTS
    assert any(line.startswith("warning:") and "too small a batch" in line for line in plan.reasoning)
    assert any(line.startswith("option:") and "fp8_e4m3" in line for line in plan.reasoning)
    assert plan.kv_cache_dtype == "auto"  # suggested, never switched silently


def test_a_given_tp_that_does_not_fit_names_the_field_and_the_numbers():
    with pytest.raises(PlanError) as error:
        plan_server(make_spec({"gpuProduct": H100, "tensorParallel": 8}), facts("kimi-k2.5"))
    message = str(error.value)
    assert "spec.server.tensorParallel 8" in message
    assert "69.2 GiB per GPU" in message and "usable" in message


@pytest.mark.parametrize(("tp", "fragment"), [(6, "not a power of two"), (64, "more than 4 nodes")])
def test_a_given_tp_that_cannot_be_laid_out_names_the_field(tp: int, fragment: str):
    with pytest.raises(PlanError) as error:
        plan_server(make_spec({"gpuProduct": H200, "tensorParallel": tp}), facts("kimi-k2.5"))
    assert "spec.server.tensorParallel" in str(error.value) and fragment in str(error.value)


def test_a_model_that_fits_nowhere_says_what_to_change():
    with pytest.raises(PlanError) as error:
        plan_server(make_spec({"gpuProduct": H100, "gpusPerNode": 1}), facts("kimi-k2.5"))
    message = str(error.value)
    assert "up to 4 GPUs" in message and "fp8" in message and "spec.server.gpusPerNode" in message


def test_max_new_tokens_beyond_the_context_length_is_refused():
    datasets = [{"name": "long", "source": "b.jsonl", "sampling": {"maxNewTokens": 40000}}]
    with pytest.raises(PlanError) as error:
        plan_server(make_spec({"gpuProduct": H200, "contextLength": 32768}, datasets), facts("kimi-k2.5"))
    assert "spec.server.contextLength" in str(error.value) and "long" in str(error.value)


# ---------------------------------------------------------------------------------------------------------------
# SGLang's default memory split and the GPU table


@pytest.mark.parametrize(("gpu_mib", "tp"), [(143771, 8), (143771, 1), (81559, 16), (81559, 4), (81559, 2)])
def test_mem_fraction_matches_sglangs_formula(gpu_mib: int, tp: int):
    assert sglang_default_mem_fraction(gpu_mib, tp) == sglang_fraction_by_hand(gpu_mib, tp)


def test_known_gpus_and_aliases():
    assert gpu_memory_mib("NVIDIA-H200", None) == GPU_MEMORY_MIB["NVIDIA-H200"] == 143771
    for alias in ("NVIDIA-H100", "H100", "h100", "nvidia-h100-80gb-hbm3", "NVIDIA-H100-80GB-HBM3-SHARED"):
        assert gpu_memory_mib(alias, None) == 81559
    assert gpu_memory_mib("NVIDIA-A100-SXM4-80GB", None) == 81920
    assert gpu_memory_mib("NVIDIA-L40S", None) == 46068
    assert gpu_memory_mib("anything", 12345) == 12345  # the spec's number wins


def test_unknown_gpu_product_asks_for_gpu_memory_mib():
    assert MEMORY_FIELD.lower() == "spec.server.gpumemorymib"
    with pytest.raises(ValueError, match=MEMORY_FIELD):
        gpu_memory_mib("NVIDIA-X9000", None)
    with pytest.raises(PlanError, match=MEMORY_FIELD):
        plan_server(make_spec({"gpuProduct": "NVIDIA-X9000"}), facts("llama-3.1-8b"))
    with pytest.raises(PlanError, match=MEMORY_FIELD):
        plan_server(make_spec({}), facts("llama-3.1-8b"))  # no product at all


def test_an_alias_is_planned_for_its_node_label():
    plan = plan_server(make_spec({"gpuProduct": "H100", "gpusPerNode": 1}), facts("llama-3.1-8b"))
    assert plan.gpu_product == H100


# ---------------------------------------------------------------------------------------------------------------
# Config parsing and output


def test_config_parsing_handles_dtype_key_and_missing_kv_heads():
    config = {"architectures": ["GPT2LMHeadModel"], "n_layer": 12, "n_embd": 768, "n_head": 12,
              "n_positions": 1024, "dtype": "float32"}
    model = model_facts(config, 500_000_000)
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.max_position_embeddings) == (12, 12, 64, 1024)
    assert model.torch_dtype == "float32" and not model.is_mla
    with pytest.raises(PlanError, match="num_hidden_layers"):
        model_facts({"hidden_size": 8, "num_attention_heads": 1, "max_position_embeddings": 8}, 1)


def test_render_and_status_shape():
    plan = plan_server(make_spec({"gpuProduct": H100}), facts("llama-3.1-70b"))
    text = render_plan(plan)
    assert "tensor parallel" in text and "4 = 1 node x 4 GPUs" in text
    assert "why:" in text and all(line in text for line in plan.reasoning)
    status = plan.model_dump(by_alias=True)
    assert status["tensorParallel"] == 4 and status["kvCapacityTokens"] == plan.kv_capacity_tokens
