"""The memory decision: --mem-fraction-static, --chunked-prefill-size and the decode CUDA-graph batch chosen from
what each use of the GPU's memory costs, every term shown with its source, never more than the GPU holds; SGLang's
default rule whenever the spec or the model takes the decision away."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill_operator.decide.manifests import sglang_args
from tokenmill_operator.decide.planner import model_facts, plan_server, workload
from tokenmill_operator.decide.planner.memory import PRE_LOAD_USED_MIB, replica_capacity, weight_bytes_per_gpu
from tokenmill_operator.decide.planner.memory_budget import activation_bytes_per_token, decided_split
from tokenmill_runner.facts.model_facts import ModelFacts
from tokenmill_runner.facts.releases import release
from tokenmill_runner.facts.throughput import Layout
from tokenmill_runner.spec.resource import DatasetGenerationSpec, parse_document

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
MIB = 1024**2
RTX_PRO_MIB = 97887
# The seeds' hand-tuned server: "The server had been optimized to ~930-1350 tok/s throughput."
# (/work/shared/seeds/001_c9073f2c6fe2794a.txt line 17)
SEEDS_TOKENS_PER_SECOND = 930


def facts(name: str) -> ModelFacts:
    data = json.loads((MODELS / f"{name}.json").read_text())
    return model_facts(data["config"], data["weight_bytes"])


def make_spec(server: dict[str, Any], max_new_tokens: int = 10240, limit: int = 11000,
              **fields: Any) -> DatasetGenerationSpec:
    return parse_document({
        "apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "mem"},
        "spec": {"model": {"path": "s3://models/m/"}, "server": {"image": "lmsysorg/sglang:v0.5.23", **server},
                 "sampling": {"maxNewTokens": max_new_tokens},
                 "datasets": [{"name": "B5_openthoughts", "source": "s3://p/b5.jsonl", "limit": limit}],
                 "output": {"uri": "s3://out/run/"}, **fields}}).spec


def test_the_seeds_job_is_planned_faster_than_the_seeds_tuned_it_by_hand_with_every_term_sourced():
    spec = make_spec({"gpuProduct": "RTX-PRO-6000"})
    plan = plan_server(spec, facts("kimi-k2.5"))
    assert plan.prediction is not None
    # SGLang's default split left 2.6 GiB of KV per GPU (13 running requests, ~320 tokens/s).
    assert plan.prediction.output_tokens_per_second >= SEEDS_TOKENS_PER_SECOND
    assert plan.prediction.decode_tokens_per_second >= SEEDS_TOKENS_PER_SECOND
    assert plan.kv_cache_dtype == "auto"  # no fp8 cache unless the spec asks
    names = [term.name for term in plan.memory_split]
    assert {"prefill activations", "decode CUDA graphs", "NCCL and all-reduce buffers", "req_to_token pool",
            "safety margin"} <= set(names)
    # 0.5.23 takes the multimodal cache out of the KV budget (kv_cache_configurator.py:3038), not the slack.
    assert "multimodal cache" not in names
    assert all(term.mib > 0 and term.source for term in plan.memory_split)
    assert all(".py:" in term.source for term in plan.memory_split if term.name != "safety margin")
    # The fraction leaves room for every term; the weights and the KV pool fit inside it.
    reserved = sum(term.mib for term in plan.memory_split)
    fraction = float(plan.mem_fraction_static)
    assert fraction * RTX_PRO_MIB + reserved <= RTX_PRO_MIB + len(names)  # terms are rounded to whole MiB
    per_rank = plan.kv_bytes_per_token // plan.tensor_parallel
    groups = plan.attention_data_parallel
    assert plan.weight_bytes_per_gpu + plan.kv_capacity_tokens // groups * per_rank <= fraction * RTX_PRO_MIB * MIB
    assert any("decided by the plan" in line and "safety margin" in line for line in plan.reasoning)
    # The server runs with the split the plan counted.
    args = sglang_args("mem", spec, plan, "/models/kimi")
    assert args[args.index("--mem-fraction-static") + 1] == plan.mem_fraction_static
    assert args[args.index("--chunked-prefill-size") + 1] == str(plan.chunked_prefill_size)
    assert args[args.index("--cuda-graph-max-bs-decode") + 1] == str(plan.cuda_graph_max_bs)


def test_the_decode_graph_covers_the_batch_a_group_runs():
    for gpu in ("RTX-PRO-6000", "NVIDIA-H200"):
        plan = plan_server(make_spec({"gpuProduct": gpu}), facts("kimi-k2.5"))
        assert plan.prediction and plan.cuda_graph_max_bs
        assert plan.cuda_graph_max_bs * plan.attention_data_parallel >= plan.prediction.batch_per_replica


def test_the_activation_term_follows_the_fused_moe_buffers():
    kimi = facts("kimi-k2.5")
    # TP 8: gate/up N = 2 x 2048 / 8 = 512 per expert slot; peak = top-8 x max(N + N/2, N/2 + hidden 7168) (the
    # gate/up buffer is freed before the down projection's) + the shared expert's gate/up and activated half
    # (3 x 2048 / 8), plus 3 hidden-state copies, all 2 bytes.
    expected = 2 * (3 * 7168 + 8 * max(512 + 256, 256 + 7168) + 3 * 2048 // 8)
    assert activation_bytes_per_token(kimi, Layout(8)) == expected
    # DP attention gathers every group's chunk into the MoE.
    assert activation_bytes_per_token(kimi, Layout(8, 4)) == 2 * (3 * 7168 + 4 * 8 * (256 + 7168) + 3 * 2048 // 8)
    llama = facts("llama-3.1-8b")  # dense: gate/up (2 x 14336) and the activated half at TP 1
    assert activation_bytes_per_token(llama, Layout(1)) == 2 * (3 * 4096 + 3 * 14336)


def test_a_smaller_chunk_frees_kv_and_the_plan_weighs_it_against_prefill():
    kimi, rel = facts("kimi-k2.5"), release("0.5.23")
    splits = {chunk: decided_split(RTX_PRO_MIB, Layout(8), kimi, rel, chunk, 128) for chunk in (8192, 4096, 2048)}
    assert all(s is not None for s in splits.values())
    fractions = [splits[c].mem_fraction for c in (8192, 4096, 2048)]  # type: ignore[union-attr]
    assert fractions == sorted(fractions) and fractions[0] < fractions[-1]
    # Long prompts make a small chunk expensive (more forwards, each reading the experts again): the plan keeps a
    # larger chunk for 16k-token prompts than for 512-token ones on the same hardware. Without DP attention: with it
    # every group's chunk meets in the MoE (x groups of activations) and the smallest chunk per group wins.
    spec = make_spec({"gpuProduct": "NVIDIA-H200", "attentionDataParallel": 1})
    short = plan_server(spec, kimi, work=workload(spec, prompt_tokens=512))
    long = plan_server(spec, kimi, work=workload(spec, prompt_tokens=16000))
    assert short.chunked_prefill_size and long.chunked_prefill_size
    assert long.chunked_prefill_size > short.chunked_prefill_size
    assert any("weighed:" in line and "chunk 8,192" in line for line in short.reasoning)


@pytest.mark.parametrize(("model", "gpu"), [("kimi-k2.5", "NVIDIA-H200"), ("llama-3.1-70b", "NVIDIA-H100-80GB-HBM3"),
                                             ("qwen3-235b-a22b", "NVIDIA-B200"), ("llama-3.1-8b", "NVIDIA-A10G")])
def test_no_split_promises_more_than_the_gpu(model: str, gpu: str):
    plan = plan_server(make_spec({"gpuProduct": gpu}), facts(model))
    fraction = float(plan.mem_fraction_static)
    assert 0 < fraction < 1
    reserved = sum(term.mib for term in plan.memory_split)
    assert fraction * plan.gpu_memory_mib + reserved <= plan.gpu_memory_mib + len(plan.memory_split)


@pytest.mark.parametrize("server", [{"memFractionStatic": "0.85"},
                                    {"extraArgs": ["--chunked-prefill-size", "4096"]},
                                    {"extraArgs": ["--cuda-graph-max-bs-decode=64"]}])
def test_a_spec_that_sets_the_memory_keeps_sglangs_rule(server: dict[str, Any]):
    plan = plan_server(make_spec({"gpuProduct": "RTX-PRO-6000", **server}), facts("kimi-k2.5"))
    assert plan.memory_split == [] and plan.chunked_prefill_size is None
    assert not any("decided by the plan" in line for line in plan.reasoning)


def test_a_model_whose_config_lacks_a_shape_keeps_sglangs_default():
    data = json.loads((MODELS / "llama-3.1-8b.json").read_text())
    config = {k: v for k, v in data["config"].items() if k != "vocab_size"}  # no logits term can be computed
    plan = plan_server(make_spec({"gpuProduct": "NVIDIA-H100-80GB-HBM3"}), model_facts(config, data["weight_bytes"]))
    assert plan.memory_split == [] and plan.chunked_prefill_size is None


def test_the_decided_kv_pool_is_what_the_capacity_says():
    kimi = facts("kimi-k2.5")
    split = decided_split(RTX_PRO_MIB, Layout(8), kimi, release("0.5.23"), 2048, 128)
    assert split is not None
    cap = replica_capacity(kimi, RTX_PRO_MIB, Layout(8), split.mem_fraction, 2.0)
    # SGLang's KV budget: fraction x the memory free before loading, less the weights
    # (mem_cache/kv_cache_configurator.py:2990-3038: free now - free before x (1 - fraction)).
    before = RTX_PRO_MIB - PRE_LOAD_USED_MIB
    assert cap.kv_room_bytes == int(split.mem_fraction * before * MIB) - weight_bytes_per_gpu(kimi, Layout(8))
    assert (before - split.reserved_mib) / before - split.mem_fraction < 0.001  # rounded down


def test_hidden_state_capture_counts_its_buffers_and_its_requests_logprobs_as_0_5_23_allocates_them():
    from tokenmill_operator.decide.planner.memory_budget import aux_capture_terms

    # Llama clones each capture and concatenates them (0.5.23 models/llama.py:485, layers/aux_hidden_states.py:26,
    # :97-102), then concatenates the logprob rows (layers/logits_processor.py:821-826): 3 copies of
    # (chunk + graph) tokens x 3 layers x 4,096 hidden x 2 B. Its capture requests' logprobs from position 0 take
    # 2,048-row chunks of 3 float32 vocabulary matrices (layers/logprob_processor.py:515-564, environ.py:1513).
    llama = facts("llama-3.1-8b")
    capture, logprobs = aux_capture_terms(llama, Layout(1), 8192, 256, 3)
    assert capture.mib == (8192 + 256) * 3 * 4096 * 2 * 3 / MIB  # 594 MiB
    assert logprobs.mib == 2048 * 3 * 128_256 * 4 / MIB  # 3,006 MiB
    # Kimi-K2.5 (DeepSeek-V3's model) packs them into one buffer (models/deepseek_v2.py:3175): 2 copies; under DP
    # attention the logits stay one chunk of the group's tokens (logprob_processor.py:515-522).
    kimi = facts("kimi-k2.5")
    capture, logprobs = aux_capture_terms(kimi, Layout(8, 8), 2048, 160, 3)
    assert capture.mib == (2048 + 160) * 3 * 7168 * 2 * 2 / MIB
    assert logprobs.mib == 2048 * 3 * 163_840 * 4 / MIB  # 3,840 MiB


def test_a_plan_with_hidden_states_leaves_room_for_the_capture_in_its_memory_split():
    plain = plan_server(make_spec({"gpuProduct": "NVIDIA-H200"}, max_new_tokens=2048), facts("kimi-k2.5"))
    spec = make_spec({"gpuProduct": "NVIDIA-H200"}, max_new_tokens=2048, hiddenStates={"convention": "eagle3"})
    planned = plan_server(spec, facts("kimi-k2.5"))
    terms = {term.name: term for term in planned.memory_split}
    assert {"aux hidden-state capture", "capture input logprobs"} <= set(terms)
    assert all(".py:" in terms[name].source for name in ("aux hidden-state capture", "capture input logprobs"))
    # The capture's terms come out of the KV pool, nothing else.
    assert "aux hidden-state capture" not in {term.name for term in plain.memory_split}
    assert float(planned.mem_fraction_static) < float(plain.mem_fraction_static)
    assert planned.kv_capacity_tokens < plain.kv_capacity_tokens
