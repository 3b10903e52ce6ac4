"""Server planning: known deployments pinned, the release checks, SGLang's memory rules checked against numbers
computed here by hand, and the choice of the layout predicted to finish soonest."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tokenmill_operator.decide.gpus import GPU_MEMORY_MIB, MEMORY_FIELD, gpu_memory_mib
from tokenmill_operator.decide.planner import (
    ModelFacts,
    PlanError,
    kv_bytes_per_token_per_rank,
    model_facts,
    plan_server,
    render_plan,
    workload,
)
from tokenmill_operator.decide.planner.memory import (
    PRE_LOAD_USED_MIB,
    sglang_default_mem_fraction,
    sglang_reserve,
    vlm_factor,
)
from tokenmill_runner.facts.releases import release
from tokenmill_runner.facts.throughput import Layout
from tokenmill_runner.spec.resource import DatasetGenerationSpec, parse_document

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
MIB = 1024**2
H200 = "NVIDIA-H200"
H100 = "NVIDIA-H100-80GB-HBM3"
RTX_PRO = "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"
MEMORY_KEY = MEMORY_FIELD.removeprefix("spec.server.")  # the spec's camelCase name for the GPU memory in MiB
B5 = [{"name": "B5_openthoughts", "source": "s3://p/b5.jsonl", "limit": 10000}]


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
            "datasets": datasets or B5,
            "output": {"uri": "s3://out/run/"},
        },
    }
    return parse_document(document).spec


def reserve_by_hand(gpu_mib: int, tp: int, mla: bool, graph_bs: int, dp: int = 1) -> float:
    # docs/sglang-release-facts.md §K, 0.5.23 (arg_groups/memory_hook.py:309): 512 + 1.5 x chunk + 2 x graph batch
    # + tp/8 x 1024 + DP-attention padding + prefill graphs (MLA 1536 MiB), floor 10240 above 60 GB. H100/H200/RTX
    # PRO 6000 tiers: chunk 8192.
    reserved = 512 + 8192 * 1.5 + graph_bs * 2 + tp / 8 * 1024
    if dp > 1:
        reserved += graph_bs * dp * 3 + (graph_bs * dp * 1.5 if graph_bs > 300 else 0)
    reserved += 1536 if mla else 0
    return max(reserved, 10 * 1024)


# ---------------------------------------------------------------------------------------------------------------
# Pinned deployments


def test_kimi_k25_on_eight_h200_uses_dp_attention_on_one_node():
    plan = plan_server(make_spec({"gpuProduct": H200}), facts("kimi-k2.5"))
    assert (plan.replicas, plan.tensor_parallel, plan.nodes_per_replica, plan.gpus_per_node) == (1, 8, 1, 8)
    # DP attention wins: TP alone keeps the whole MLA latent on all 8 ranks, 8 groups keep 8 separate caches.
    assert plan.attention_data_parallel == 8
    tp_only = next(c for c in plan.candidates if c.tensor_parallel == 8 and c.attention_data_parallel == 1
                   and c.kv_cache_dtype == "auto")
    assert plan.kv_capacity_tokens > 4 * tp_only.kv_capacity_tokens
    assert plan.prediction is not None and tp_only.prediction is not None
    assert plan.prediction.eta_seconds < tp_only.prediction.eta_seconds
    assert plan.context_length == 262144 and plan.kv_cache_dtype == "auto" and plan.sglang_version == "0.5.23"
    assert plan.overrides == []


def test_kimi_k25_on_the_seeds_rtx_pro_6000_plans_with_only_the_product_name():
    # A chunk size in extraArgs keeps SGLang's own memory rule, whose arithmetic this test checks by hand.
    spec = make_spec({"gpuProduct": "RTX-PRO-6000", "extraArgs": ["--chunked-prefill-size", "8192"]})
    plan = plan_server(spec, facts("kimi-k2.5"))
    assert plan.gpu_product == RTX_PRO and plan.gpu_memory_mib == 97887
    assert (plan.replicas, plan.tensor_parallel) == (1, 8)
    assert plan.interconnect == "pcie"
    assert any("tensor parallelism runs over PCIe" in line for line in plan.reasoning)
    # SGLang's rule for multimodal models lowers the default fraction: Kimi-K2.5's tower (27 x 1152) gives 0.910.
    fraction = round((97887 - reserve_by_hand(97887, 8, mla=True, graph_bs=512)) / 97887, 3) * 0.95 * (
        1 - 0.1 * (27 * 1152**2 / (24 * 1024**2) - 1))
    assert plan.mem_fraction_static == f"{fraction:.3f}" == "0.758"
    assert any("x 0.910 for the vision tower" in line for line in plan.reasoning)
    # The batch is small on 96 GB cards; the fp8 KV cache is offered, never switched on silently.
    assert any(line.startswith("warning:") and "small" in line for line in plan.reasoning)
    assert any(line.startswith("option:") and "fp8_e4m3" in line for line in plan.reasoning)
    assert plan.kv_cache_dtype == "auto"
    fp8 = [c for c in plan.candidates if c.kv_cache_dtype == "fp8_e4m3" and c.prediction]
    assert fp8 and all("kvCacheDtype" in c.note and not c.chosen for c in fp8)


def test_the_workstation_edition_is_a_different_product_with_more_bandwidth():
    server = plan_server(make_spec({"gpuProduct": RTX_PRO}), facts("kimi-k2.5"))
    workstation = plan_server(make_spec({"gpuProduct": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"}),
                              facts("kimi-k2.5"))
    assert workstation.gpu_product == "NVIDIA-RTX-PRO-6000-Blackwell-Workstation-Edition"
    assert workstation.gpu_memory_mib == server.gpu_memory_mib == 97887
    assert server.prediction and workstation.prediction
    assert workstation.prediction.decode_tokens_per_second > server.prediction.decode_tokens_per_second


def test_kimi_k25_on_h100_needs_two_nodes_of_eight_at_sglangs_default_fraction():
    plan = plan_server(make_spec({"gpuProduct": H100, "gpusPerNode": 8, "memFractionStatic": "0.85"}),
                       facts("kimi-k2.5"))
    assert (plan.tensor_parallel, plan.nodes_per_replica, plan.gpus_per_node) == (16, 2, 8)
    # TP 8 was considered and cannot hold the weights of an 80 GB GPU at that fraction.
    tp8 = [c for c in plan.candidates if c.tensor_parallel == 8]
    assert tp8 and all(c.prediction is None and "do not fit" in c.note for c in tp8)
    # With the memory split left to the plan and the context the job needs, one node holds the 69.9 GiB per GPU with
    # room for a few requests, and says the batch is small. At the model's 262,144 context SGLang's req_to_token
    # pool alone takes (2,048 + 1) x 262,148 x 4 B = 2 GiB per GPU (mem_cache/memory_pool.py:406), and one node
    # no longer holds a request.
    full = plan_server(make_spec({"gpuProduct": H100, "gpusPerNode": 8}), facts("kimi-k2.5"))
    assert full.context_length == 262144 and full.nodes_per_replica == 2
    decided = plan_server(make_spec({"gpuProduct": H100, "gpusPerNode": 8, "contextLength": 16384}),
                          facts("kimi-k2.5"))
    assert (decided.tensor_parallel, decided.nodes_per_replica) == (8, 1)
    assert any(line.startswith("warning:") and "small" in line for line in decided.reasoning)
    assert any("2 nodes of 8 GPUs" in line for line in plan.reasoning)


def test_llama_8b_on_one_h100_is_tp1():
    plan = plan_server(make_spec({"gpuProduct": H100, "gpusPerNode": 1}), facts("llama-3.1-8b"))
    assert (plan.replicas, plan.tensor_parallel, plan.nodes_per_replica, plan.gpus_per_node) == (1, 1, 1, 1)
    assert plan.attention_data_parallel == 1  # not an MLA model: no DP attention is tried
    assert {c.attention_data_parallel for c in plan.candidates} == {1}


def test_a_model_that_fits_fewer_gpus_runs_several_replicas_on_the_node():
    plan = plan_server(make_spec({"gpuProduct": H100}), facts("llama-3.1-8b"))
    assert plan.replicas * plan.tensor_parallel == 8 and plan.replicas > 1
    assert plan.gpus_per_node == plan.tensor_parallel  # each replica's pod asks for its own GPUs
    eight = next(c for c in plan.candidates if c.tensor_parallel == 1 and c.kv_cache_dtype == "auto")
    assert eight.replicas == 8 and eight.prediction is not None


# ---------------------------------------------------------------------------------------------------------------
# The choice: the soonest finish on the GPUs the spec gives; the spec's own values win.


def test_the_chosen_layout_has_the_smallest_eta_of_those_allowed():
    plan = plan_server(make_spec({"gpuProduct": H200}), facts("deepseek-v3"))
    chosen = next(c for c in plan.candidates if c.chosen)
    allowed = [c for c in plan.candidates if c.prediction and c.kv_cache_dtype == "auto"]
    assert chosen.prediction is not None and plan.prediction == chosen.prediction
    assert all(chosen.prediction.eta_seconds <= c.prediction.eta_seconds * 1.02 for c in allowed)  # type: ignore[union-attr]
    # GPU-hours are the GPUs held times the ETA.
    p = plan.prediction
    assert p is not None and p.gpu_hours == pytest.approx(8 * p.eta_seconds / 3600, abs=0.06)


def test_spec_settings_win_and_the_table_keeps_the_alternatives():
    server = {"gpuProduct": H200, "tensorParallel": 8, "attentionDataParallel": 1}
    plan = plan_server(make_spec(server), facts("kimi-k2.5"))
    assert (plan.tensor_parallel, plan.attention_data_parallel) == (8, 1)
    others = [c for c in plan.candidates if c.attention_data_parallel > 1]
    assert others and all(c.note.startswith("not allowed: spec.server.attentionDataParallel is 1") for c in others)
    faster = [c for c in others if c.kv_cache_dtype == "auto" and c.prediction]
    assert any(c.prediction.eta_seconds < plan.prediction.eta_seconds for c in faster)  # type: ignore[union-attr]
    assert {"tensorParallel", "attentionDataParallel"} <= set(plan.overrides)


def test_every_given_setting_is_used_and_listed():
    server = {"gpuProduct": "NVIDIA-X-Unknown", MEMORY_KEY: 81559, "tensorParallel": 8,
              "memFractionStatic": "0.85", "contextLength": 32768, "maxRunningRequests": 256,
              "kvCacheDtype": "fp8_e4m3", "replicas": 1}
    model_spec = {"path": "s3://models/m/", "weightBytes": 150_000_000_000}
    data = fixture("llama-3.1-70b")
    model = model_facts(data["config"], 150_000_000_000)
    plan = plan_server(make_spec(server, model=model_spec), model)
    assert (plan.tensor_parallel, plan.nodes_per_replica, plan.gpus_per_node, plan.replicas) == (8, 1, 8, 1)
    assert plan.mem_fraction_static == "0.85"
    assert plan.context_length == 32768
    assert plan.max_running_requests == 256
    assert plan.kv_cache_dtype == "fp8_e4m3"
    assert plan.gpu_memory_mib == 81559
    assert plan.kv_bytes_per_token == 2 * 8 * 128 * 1 * 80  # fp8: one byte per element
    assert set(plan.overrides) == {"replicas", "tensorParallel", "memFractionStatic", "contextLength",
                                   "maxRunningRequests", "kvCacheDtype", MEMORY_KEY, "weightBytes"}
    # An unknown product: no prediction, and the reasoning says why.
    assert plan.prediction is None and any("no throughput is predicted" in line for line in plan.reasoning)


def test_a_given_tp_that_does_not_fit_names_the_field_and_the_numbers():
    with pytest.raises(PlanError) as error:
        plan_server(make_spec({"gpuProduct": H100, "tensorParallel": 4}), facts("kimi-k2.5"))
    message = str(error.value)
    assert "spec.server.tensorParallel 4" in message and "do not fit" in message and "usable" in message


def test_a_given_tp_that_cannot_be_laid_out_is_refused_by_the_spec_or_the_plan():
    with pytest.raises(PlanError, match="not a power of two"):
        plan_server(make_spec({"gpuProduct": H200, "tensorParallel": 6}), facts("kimi-k2.5"))
    with pytest.raises(PlanError, match="more than 4 nodes"):
        plan_server(make_spec({"gpuProduct": H200, "tensorParallel": 64}), facts("kimi-k2.5"))


def test_a_model_that_fits_nowhere_says_what_to_change():
    with pytest.raises(PlanError) as error:
        plan_server(make_spec({"gpuProduct": H100, "gpusPerNode": 1}), facts("kimi-k2.5"))
    message = str(error.value)
    assert "fp8" in message and "spec.server.gpusPerNode" in message


def test_max_new_tokens_beyond_the_context_length_is_refused():
    datasets = [{"name": "long", "source": "b.jsonl", "sampling": {"maxNewTokens": 40000}}]
    with pytest.raises(PlanError) as error:
        plan_server(make_spec({"gpuProduct": H200, "contextLength": 32768}, datasets), facts("kimi-k2.5"))
    assert "spec.server.contextLength" in str(error.value) and "long" in str(error.value)


# ---------------------------------------------------------------------------------------------------------------
# The SGLang release: read from the image, its refusals refused at plan time.


def test_the_release_comes_from_the_tag_then_sglang_version_then_the_default():
    kimi = facts("kimi-k2.5")
    assert plan_server(make_spec({"gpuProduct": H200, "image": "lmsysorg/sglang:v0.5.19-cu129"}),
                       kimi).sglang_version == "0.5.19"
    custom = {"gpuProduct": H200, "image": "registry.example/sglang:team-build", "sglangVersion": "0.5.15.post1"}
    assert plan_server(make_spec(custom), kimi).sglang_version == "0.5.15.post1"
    plan = plan_server(make_spec({"gpuProduct": H200, "image": "registry.example/sglang:team-build"}), kimi)
    assert plan.sglang_version == "0.5.23"
    assert any(line.startswith("warning:") and "names no SGLang release" in line for line in plan.reasoning)


def test_a_release_that_cannot_serve_kimi_k25_is_refused_with_the_first_that_can():
    # KimiK25ForConditionalGeneration is registered from 0.5.9 (models/kimi_k25.py:776); 0.5.6 would fall back to
    # the Transformers backend.
    with pytest.raises(PlanError) as error:
        plan_server(make_spec({"gpuProduct": H200, "image": "lmsysorg/sglang:v0.5.6"}), facts("kimi-k2.5"))
    message = str(error.value)
    assert "spec.server.image" in message and "KimiK25ForConditionalGeneration" in message and "0.5.9" in message


def test_an_unknown_release_is_refused():
    with pytest.raises(PlanError, match="no facts"):
        plan_server(make_spec({"gpuProduct": H200, "image": "lmsysorg/sglang:v0.4.1"}), facts("llama-3.1-8b"))


def test_a_kv_cache_dtype_the_release_refuses_is_refused_in_the_spec():
    # --kv-cache-dtype choices: mxfp8/nvfp4/fp4_mx_block16 from 0.5.16 (server_args.py:604); argparse exits on
    # them before (exit 2, CrashLoopBackOff).
    with pytest.raises(ValueError, match="does not accept it"):
        make_spec({"gpuProduct": H200, "image": "lmsysorg/sglang:v0.5.15.post1", "kvCacheDtype": "nvfp4"})
    with pytest.raises(ValueError, match="does not accept it"):
        make_spec({"gpuProduct": H200, "image": "x/sglang:custom", "sglangVersion": "0.5.21",
                   "kvCacheDtype": "fp4_e2m1"})
    ok = make_spec({"gpuProduct": H200, "image": "lmsysorg/sglang:v0.5.16", "kvCacheDtype": "nvfp4"})
    assert plan_server(ok, facts("llama-3.1-8b")).kv_cache_dtype == "nvfp4"


def test_context_length_auto_is_what_sglang_derives():
    # get_context_length (0.5.23 utils/hf_transformers/common.py:677): the first of max_sequence_length, seq_length,
    # max_seq_len, model_max_length, max_position_embeddings, times the rope factor unless the scaling carries
    # original_max_position_embeddings.
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 131072, "seq_length": 8192, "rope_scaling": {"type": "linear", "factor": 2.0}}
    plan = plan_server(make_spec({"gpuProduct": H200}, [{"name": "d", "source": "d.jsonl",
                                                          "sampling": {"maxNewTokens": 4096}}]),
                       model_facts(config, 16_000_000_000))
    assert plan.context_length == 16384  # seq_length 8192 x factor 2, not max_position_embeddings
    with pytest.raises(PlanError) as error:
        plan_server(make_spec({"gpuProduct": H200, "contextLength": 32768}, [{"name": "d", "source": "d.jsonl",
                                                                              "sampling": {"maxNewTokens": 4096}}]),
                    model_facts(config, 16_000_000_000))
    assert "spec.server.contextLength 32,768" in str(error.value) and "16,384" in str(error.value)


@pytest.mark.parametrize(("product", "image", "fragment"), [
    ("MI300X", "lmsysorg/sglang:v0.5.23", "lmsysorg/sglang:v0.5.23-rocm700-mi30x"),
    ("MI355X", "lmsysorg/sglang:v0.5.9-rocm700-mi30x", "lmsysorg/sglang:v0.5.9-rocm700-mi35x"),
    (H200, "lmsysorg/sglang:v0.5.9-rocm700-mi30x", "lmsysorg/sglang:v0.5.9"),
])
def test_amd_gpus_need_sglangs_rocm_image_and_nvidia_gpus_a_cuda_one(product, image, fragment):
    with pytest.raises(PlanError) as error:
        plan_server(make_spec({"gpuProduct": product, "image": image}), facts("llama-3.1-8b"))
    assert "spec.server.image" in str(error.value) and fragment in str(error.value)


def test_an_amd_plan_asks_for_amd_gpus():
    plan = plan_server(make_spec({"gpuProduct": "MI300X", "image": "lmsysorg/sglang:v0.5.23-rocm700-mi30x"}),
                       facts("deepseek-v3"))
    assert plan.gpu_vendor == "amd" and plan.gpu_product == "AMD_Instinct_MI300X_OAM"
    assert plan.gpu_memory_mib == 196592 and plan.interconnect == "xgmi"


# ---------------------------------------------------------------------------------------------------------------
# Memory: SGLang's own rules, by release


def test_mem_fraction_follows_the_release_reserve():
    kimi, llama = facts("kimi-k2.5"), facts("llama-3.1-70b")
    # 0.5.9 has no prefill-graph reserve; 0.5.10.post1+ adds 1536 MiB for an MLA model (piecewise CUDA graphs).
    old = sglang_reserve(143771, Layout(8), kimi, release("0.5.9"))
    new = sglang_reserve(143771, Layout(8), kimi, release("0.5.23"))
    assert old.total == reserve_by_hand(143771, 8, mla=False, graph_bs=512) == 14848
    assert new.total == reserve_by_hand(143771, 8, mla=True, graph_bs=512) == 14848 + 1536
    # A non-MLA model captures prefill graphs for 58 token counts up to the 8192 chunk, 8 MiB each.
    assert sglang_reserve(81559, Layout(4), llama, release("0.5.23")).prefill_graphs == 58 * 8
    # DP attention pads per group: graph batch x groups x 3 MiB (+1.5 above a batch of 300).
    dp = sglang_reserve(143771, Layout(8, 8), kimi, release("0.5.23"), graph_bs=128)
    assert dp.dp_attention == 128 * 8 * 3
    assert vlm_factor(kimi) == pytest.approx(0.910, abs=5e-4) and vlm_factor(llama) == 1.0
    assert sglang_default_mem_fraction(143771, Layout(8), llama, release("0.5.23")) == round(
        (143771 - reserve_by_hand(143771, 8, mla=False, graph_bs=512) - 58 * 8) / 143771, 3)


def test_mla_kv_is_the_latent_on_every_rank_and_dp_attention_splits_the_requests():
    text = fixture("kimi-k2.5")["config"]["text_config"]
    per_rank = (text["kv_lora_rank"] + text["qk_rope_head_dim"]) * 2 * text["num_hidden_layers"]
    assert per_rank == 70272
    model = facts("kimi-k2.5")
    assert model.is_mla and model.nested_under == "text_config" and model.num_layers == 61
    assert {kv_bytes_per_token_per_rank(model, tp, 2.0) for tp in (1, 8, 16)} == {per_rank}
    plan = plan_server(make_spec({"gpuProduct": H200, "attentionDataParallel": 1}), model)
    fraction = float(plan.mem_fraction_static)
    # The fraction is of the memory free before loading; 0.5.23 takes the multimodal cache out of the KV budget
    # (mem_cache/kv_cache_configurator.py:2990-3038).
    before, mm = (143771 - PRE_LOAD_USED_MIB) * MIB, 100 * MIB
    room = int(fraction * before) - plan.weight_bytes_per_gpu - mm
    assert plan.kv_capacity_tokens == room // per_rank
    dp = plan_server(make_spec({"gpuProduct": H200, "attentionDataParallel": 8}), model)
    room_dp = int(float(dp.mem_fraction_static) * before) - dp.weight_bytes_per_gpu - mm
    assert dp.kv_capacity_tokens == 8 * (room_dp // per_rank)  # eight caches, one per group
    # The price: attention weights whole on every GPU instead of an eighth.
    assert dp.weight_bytes_per_gpu > plan.weight_bytes_per_gpu


def test_the_vision_tower_is_counted_on_every_gpu():
    model = facts("kimi-k2.5")
    tower = model.weights().vision
    assert 0.8e9 < tower < 1.1e9  # MoonViT 27 x 1152 + projector: ~0.47 B parameters in bf16
    plan = plan_server(make_spec({"gpuProduct": H200, "attentionDataParallel": 1}), model)
    w = model.weights()
    assert plan.weight_bytes_per_gpu == math.ceil((w.attention + w.embedding) / 8 + (w.served - w.attention
                                                                                      - w.embedding - tower) / 8
                                                  + tower)


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


def test_max_running_requests_follows_sglangs_rule_per_group():
    plan = plan_server(make_spec({"gpuProduct": H200}), facts("kimi-k2.5"))
    groups = plan.attention_data_parallel
    per_group = plan.kv_capacity_tokens // groups
    expected = min(min(max(int(per_group / plan.context_length * 512), 2048), 4096), per_group // 2)
    if groups > 1:  # capped at the decode graph: lockstep groups go eager together past it (planner/dp_attention.py)
        assert plan.cuda_graph_max_bs and plan.cuda_graph_max_bs < expected
        expected = plan.cuda_graph_max_bs
    assert plan.max_running_requests == expected * groups


# ---------------------------------------------------------------------------------------------------------------
# The job and the prediction


def test_a_fixed_workload_changes_the_prediction():
    spec = make_spec({"gpuProduct": H200})
    model = facts("kimi-k2.5")
    estimate = plan_server(spec, model, work=workload(spec, concurrency=64))
    short = plan_server(spec, model, work=workload(spec, prompt_tokens=300, output_tokens=200, concurrency=64))
    assert short.prediction and estimate.prediction
    assert short.prediction.batch_per_replica == 64  # the runner's concurrency caps the batch
    assert short.expected_tokens_per_request == 400  # 300 + 200 / 2
    assert short.prediction.eta_seconds < estimate.prediction.eta_seconds


def test_samples_per_prompt_multiply_the_requests_the_plan_predicts():
    one = plan_server(make_spec({"gpuProduct": H200}, [{"name": "d", "source": "d.jsonl", "limit": 500}]),
                      facts("kimi-k2.5"))
    four = plan_server(make_spec({"gpuProduct": H200}, [{"name": "d", "source": "d.jsonl", "limit": 500,
                                                         "samples": 4}]), facts("kimi-k2.5"))
    assert one.prediction and four.prediction
    assert (one.prediction.samples, four.prediction.samples) == (500, 2000)
    assert four.prediction.eta_seconds > one.prediction.eta_seconds  # (the plan may fill a larger batch)


def test_datasets_without_limit_are_counted_as_assumed():
    plan = plan_server(make_spec({"gpuProduct": H200}, [{"name": "d", "source": "d.jsonl"}]), facts("kimi-k2.5"))
    assert plan.prediction and plan.prediction.samples == 10000 and plan.prediction.samples_assumed
    assert any("without limit" in line for line in plan.reasoning)


# ---------------------------------------------------------------------------------------------------------------
# The GPU table, config parsing and output


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
    assert "layouts considered" in text and "why:" in text and all(line in text for line in plan.reasoning)
    chosen_rows = [line for line in text.splitlines() if line.strip().startswith("*")]
    assert len(chosen_rows) == 1 and "chosen" in chosen_rows[0]
    status = plan.model_dump(by_alias=True, mode="json")
    assert status["tensorParallel"] == plan.tensor_parallel and status["kvCapacityTokens"] == plan.kv_capacity_tokens
    prediction = status["prediction"]
    assert {"decodeTokensPerSecond", "outputTokensPerSecond", "etaSeconds", "gpuHours"} <= set(prediction)
    assert prediction["decodeTokensPerSecond"] >= prediction["outputTokensPerSecond"] > 0
    assert all("prediction" in c and "note" in c for c in status["candidates"])
