"""SGLang's DP-attention mechanics and memory accounting, mirrored from the source (0.5.23 unless named; 0.5.9, the
oldest supported release, where it differs or agrees) and visible in the plan and the flags the server gets."""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill_operator.decide.manifests import sglang_args
from tokenmill_operator.decide.planner import model_facts, plan_server
from tokenmill_operator.decide.planner.dp_attention import (
    chunk_flag_for,
    graph_capped_max_running,
    load_balance_method,
    max_running_per_group,
    per_group_chunk,
    schedule_conservativeness,
)
from tokenmill_operator.decide.planner.memory import (
    PRE_LOAD_USED_MIB,
    mm_reserved_from_kv,
    replica_capacity,
    req_to_token_mib,
    weight_bytes_per_gpu,
)
from tokenmill_operator.decide.planner.memory_budget import mla_decode_backend, moe_kernel, terms, triton_mla_kv_splits
from tokenmill_runner.facts.hardware import find
from tokenmill_runner.facts.model_facts import ModelFacts
from tokenmill_runner.facts.releases import release
from tokenmill_runner.facts.throughput import Layout, StepModel
from tokenmill_runner.spec.resource import DatasetGenerationSpec, parse_document

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
MIB = 1024**2
RTX_PRO_MIB = 97887


def facts(name: str) -> ModelFacts:
    data = json.loads((MODELS / f"{name}.json").read_text())
    return model_facts(data["config"], data["weight_bytes"])


def seeds_spec(**server: object) -> DatasetGenerationSpec:
    return parse_document({
        "apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "dp"},
        "spec": {"model": {"path": "s3://models/m/"},
                 "server": {"image": "lmsysorg/sglang:v0.5.23", "gpuProduct": "RTX-PRO-6000", **server},
                 "sampling": {"maxNewTokens": 10240},
                 "datasets": [{"name": "B5", "source": "s3://p/b5.jsonl", "limit": 11000}],
                 "output": {"uri": "s3://out/run/"}}}).spec


def test_the_chunk_is_divided_by_the_groups_and_the_plan_passes_it_multiplied():
    # arg_groups/parallel_hook.py:331: chunked_prefill_size = chunked_prefill_size // attn_dp_size
    # (0.5.9 server_args.py:2117: self.chunked_prefill_size // self.dp_size).
    assert per_group_chunk(2048, 4) == 512
    assert per_group_chunk(chunk_flag_for(2048, 4), 4) == 2048
    plan = plan_server(seeds_spec(attentionDataParallel=4), facts("kimi-k2.5"))
    assert plan.chunked_prefill_size is not None and plan.chunked_prefill_size % 4 == 0
    assert plan.chunked_prefill_size // 4 >= 2048  # each group still prefills a seeds' prompt in one forward
    assert any("per group after SGLang divides it" in line for line in plan.reasoning)


def test_sglangs_default_chunk_under_dp_attention_is_a_quarter_and_long_prompts_take_several_forwards():
    model, gpu = facts("kimi-k2.5"), find("RTX-PRO-6000")
    assert gpu is not None
    dp = StepModel(model, gpu, Layout(8, 4))
    assert dp.chunk_tokens == 8192 // 4  # the tier chunk (arg_groups/memory_hook.py:90-170) divided by 4
    narrow = StepModel(model, gpu, Layout(8, 4), chunk=512)
    # A 1,130-token prompt (the seeds' B8) at 512 per group is 3 forwards, each reading the experts again.
    assert narrow.chunked_prefill_seconds(1130, 1130) > 2.5 * narrow.prefill_seconds(1130 / 3, 1130)


def test_conservativeness_load_balance_and_the_per_group_request_cap():
    assert schedule_conservativeness(1.0, 4) == 0.3  # parallel_hook.py:318; 0.5.9 server_args.py:2115
    assert schedule_conservativeness(1.0, 1) == 1.0
    # kv_cache_configurator.py:3129-3132: max(1, max_running // attn_dp_size), at most half the group's tokens.
    assert max_running_per_group(8192, 4, 173_219) == 2048
    assert max_running_per_group(8192, 4, 3000) == 1500
    assert graph_capped_max_running(8192, 80, 4) == 320
    assert load_balance_method(4) == "total_tokens" and load_balance_method(1) is None
    spec = seeds_spec(attentionDataParallel=4)
    plan = plan_server(spec, facts("kimi-k2.5"))
    assert plan.cuda_graph_max_bs and plan.max_running_requests <= plan.cuda_graph_max_bs * 4
    args = sglang_args("dp", spec, plan, "/models/kimi")
    assert args[args.index("--load-balance-method") + 1] == "total_tokens"
    plain = plan_server(seeds_spec(attentionDataParallel=1), facts("kimi-k2.5"))
    assert "--load-balance-method" not in sglang_args("dp", seeds_spec(attentionDataParallel=1), plain, "/m")


def test_kv_comes_from_the_memory_free_before_loading_less_the_multimodal_reservation():
    kimi = facts("kimi-k2.5")
    layout = Layout(8, 4)
    # kv_cache_configurator.py:3005-3038: rest = free_after_load - free_before x (1 - fraction) - mm_reservation,
    # i.e. fraction x free_before - weights - mm (the weights are what loading took).
    mm = mm_reserved_from_kv(kimi, release("0.5.23"))
    assert mm == 100.0 and mm_reserved_from_kv(kimi, release("0.5.9")) == 0.0
    cap = replica_capacity(kimi, RTX_PRO_MIB, layout, 0.9, 2.0, mm)
    expected = int(0.9 * (RTX_PRO_MIB - PRE_LOAD_USED_MIB) * MIB) - weight_bytes_per_gpu(kimi, layout) - 100 * MIB
    assert cap.kv_room_bytes == expected
    naive = replica_capacity(kimi, RTX_PRO_MIB, layout, 0.9, 2.0, pre_load_mib=0)
    assert naive.tokens_per_group > cap.tokens_per_group  # the old total-memory rule promised more


def test_the_req_to_token_pool_is_counted_at_the_context_the_job_needs():
    # memory_pool.py:400-406: torch.zeros((size + 1, max_context_len), int32), max_context_len = context + 4
    # (allocation_sizing.py:104); 2,048 slots per group at 262,144 is 2 GiB per GPU.
    assert abs(req_to_token_mib(2048, 262144) - 2049 * 262148 * 4 / MIB) < 1e-9
    assert req_to_token_mib(2048, 262144) > 2000
    kimi = facts("kimi-k2.5")
    found = terms(RTX_PRO_MIB, Layout(8, 4), kimi, release("0.5.23"), 2048, 80, context_length=16384,
                  request_rows=80, arch="sm120")
    pool = next(t for t in found if t.name == "req_to_token pool")
    assert abs(pool.mib - 81 * 16388 * 4 / MIB) < 1e-9 and "memory_pool.py:406" in pool.source
    plan = plan_server(seeds_spec(contextLength=16384), kimi)
    assert plan.context_length == 16384
    assert any(t.name == "req_to_token pool" for t in plan.memory_split)


def test_the_kernels_these_cards_run_are_the_ones_cited():
    kimi = facts("kimi-k2.5")
    # compressed_tensors_wNa16_moe.py:449-473: int4 compressed-tensors experts run fused_marlin_moe.
    assert kimi.quant_method == "compressed-tensors" and moe_kernel(kimi) == "marlin"
    # model_override_base.py:336-350: MLA gets fa3 on Hopper, flashinfer on sm100, triton elsewhere (sm120).
    assert (mla_decode_backend("sm90"), mla_decode_backend("sm100"), mla_decode_backend("sm120")) == (
        "fa3", "flashinfer", "triton")
    # triton_backend.py:83-90: max(8, min(next_pow2(SMs), next_pow2(ceil(context / 32)))).
    assert triton_mla_kv_splits(16384) == 256 and triton_mla_kv_splits(1024) == 32 and triton_mla_kv_splits(64) == 8
    found = {t.name: t for t in terms(RTX_PRO_MIB, Layout(8, 4), kimi, release("0.5.23"), 2048, 80,
                                      context_length=16384, request_rows=80, arch="sm120")}
    attention = found["attention workspace"]
    # triton_backend.py:1169-1190: (graph batch, heads per rank, splits, kv_lora_rank) float32 plus the lse.
    assert abs(attention.mib - 80 * 32 * 256 * 513 * 4 / MIB) < 1e-6 and "triton" in attention.source
    assert "Marlin" in found["prefill activations"].source
    hopper = {t.name: t for t in terms(143771, Layout(8, 4), kimi, release("0.5.23"), 2048, 80,
                                       context_length=16384, request_rows=80, arch="sm90")}
    assert "fa3" in hopper["attention workspace"].source
