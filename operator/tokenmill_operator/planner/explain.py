"""The prose of a server plan: the reasoning lines rendered from a `Sizing`, and `render_plan` for people. Pure.

Each line repeats the numbers and the rule behind a value, so a reader of `status.serverPlan.reasoning` or
`tokenmill plan` can check the arithmetic.
"""

from __future__ import annotations

from ..gpus import MEMORY_FIELD
from .memory import MIB, Capacity, chunk_and_graph_bs, kv_heads_per_rank, sglang_reserved_mib
from .model import ModelFacts
from .plan import ServerPlan
from .sizing import (
    MAX_NODES_PER_REPLICA,
    MIN_BATCH_REQUESTS,
    OUTPUT_FRACTION_ESTIMATE,
    PROMPT_TOKENS_ESTIMATE,
    TIGHT_BATCH_REQUESTS,
    Demand,
    Sizing,
    product_label,
)
from .units import count, elements, gib, per_token


def reasoning(sizing: Sizing) -> list[str]:
    """The arithmetic behind every value of the plan, one line per step, in the order a reader checks it."""
    return [
        _model_line(sizing),
        _gpu_line(sizing),
        *_demand_lines(sizing.demand, sizing.auto_tp),
        *_tp_lines(sizing),
        _layout_line(sizing),
        _mem_fraction_line(sizing),
        *_capacity_lines(sizing),
        *_context_lines(sizing),
        _max_running_line(sizing),
        *_kv_dtype_lines(sizing),
    ]


def render_plan(plan: ServerPlan) -> str:
    """The plan for people: a short table of the settings, then the arithmetic behind them."""
    rows = [
        ("tensor parallel", f"{plan.tensor_parallel} = {count(plan.nodes_per_replica, 'node')} x "
                            f"{count(plan.gpus_per_node, 'GPU')}, {count(plan.replicas, 'replica')}"),
        ("mem-fraction-static", plan.mem_fraction_static),
        ("context length", f"{plan.context_length:,}"),
        ("max running requests", f"{plan.max_running_requests:,}"),
        ("KV cache dtype", plan.kv_cache_dtype),
        ("GPU", f"{plan.gpu_product or '-'}, {plan.gpu_memory_mib:,} MiB"),
        ("weights", f"{gib(plan.weight_bytes)}, {gib(plan.weight_bytes_per_gpu)} per GPU"),
        ("KV per token", f"{plan.kv_bytes_per_token:,} B per replica"),
        ("KV capacity", f"{plan.kv_capacity_tokens:,} tokens = {plan.concurrent_requests_at_expected_length:,} "
                        f"requests of ~{plan.expected_tokens_per_request:,} tokens"),
        ("set in the spec", ", ".join(plan.overrides) or "nothing (all auto)"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    return "\n".join([*lines, "", "why:", *(f"  - {line}" for line in plan.reasoning)])


# --------------------------------------------------------------------------------------------------------------
# The model, the GPU and the expected request.


def _model_line(sizing: Sizing) -> str:
    model = sizing.model
    nested = f" (language model under {model.nested_under})" if model.nested_under else ""
    if model.is_mla:
        attention = f"MLA (kv_lora_rank {model.kv_lora_rank}, qk_rope_head_dim {model.qk_rope_head_dim})"
    else:
        kind = "MHA" if model.num_kv_heads == model.num_attention_heads else "GQA"
        attention = f"{kind}, {model.num_kv_heads} KV heads x {model.head_dim} head dim"
    source = " (spec.model.weightBytes)" if sizing.spec.model.weight_bytes is not None else ""
    return (f"model: {model.architecture or model.model_type or 'unknown architecture'}{nested}, "
            f"{model.num_layers} layers, {model.num_attention_heads} attention heads, {attention}; "
            f"weights {gib(sizing.weight_bytes)}{source}")


def _product_text(product: str | None) -> str:
    label = product_label(product)
    if label is None:
        return "product not named"
    return label if label == product else f"{product} (node label {label})"


def _gpu_line(sizing: Sizing) -> str:
    server, gpu_mib = sizing.spec.server, sizing.gpu_memory_mib
    return (f"GPU: {_product_text(server.gpu_product)}, {gpu_mib:,} MiB ({gib(gpu_mib * MIB)}) each"
            f"{f' ({MEMORY_FIELD})' if server.gpu_memory_mib is not None else ''}; "
            f"{server.gpus_per_node} per node, at most {MAX_NODES_PER_REPLICA} nodes per replica")


def _demand_lines(demand: Demand, auto_tp: bool) -> list[str]:
    lines = [
        f"expected request: {PROMPT_TOKENS_ESTIMATE} prompt tokens + {OUTPUT_FRACTION_ESTIMATE:g} x maxNewTokens "
        f"{demand.max_new_tokens:,} (dataset {demand.longest_dataset}, the largest cap) = "
        f"{demand.expected_tokens:,} tokens (prompts are unknown before tokenizing; the seeds' run averaged "
        f"1,314-1,416 output tokens at a 10,240 cap)"
    ]
    if auto_tp:
        lines.append(f"rule: the smallest power-of-two TP whose KV cache holds {MIN_BATCH_REQUESTS} requests of "
                     f"that length and one at its cap ({PROMPT_TOKENS_ESTIMATE} + {demand.max_new_tokens:,}): "
                     f">= {demand.required_tokens:,} tokens")
    return lines


# --------------------------------------------------------------------------------------------------------------
# The tensor-parallel size and the layout.


def _rejection(cap: Capacity, demand: Demand, gpu_memory_mib: int) -> str:
    if cap.kv_room_bytes <= 0:
        return (f"TP {cap.tp}: weights {gib(cap.weight_bytes_per_gpu)} per GPU do not fit in "
                f"{gib(cap.usable_bytes)} usable ({cap.mem_fraction:g} x {gib(gpu_memory_mib * MIB)}): rejected")
    return (f"TP {cap.tp}: weights {gib(cap.weight_bytes_per_gpu)} per GPU leave {gib(cap.kv_room_bytes)} "
            f"for the KV cache = {cap.tokens:,} tokens = {cap.tokens // demand.expected_tokens:,} requests of "
            f"~{demand.expected_tokens:,} tokens: too small a batch (need room for {MIN_BATCH_REQUESTS} "
            f"requests, {demand.required_tokens:,} tokens): rejected")


def _tp_lines(sizing: Sizing) -> list[str]:
    demand, gpu_mib, chosen = sizing.demand, sizing.gpu_memory_mib, sizing.capacity
    if not sizing.auto_tp:
        lines = [f"TP {chosen.tp} from spec.server.tensorParallel"]
        if chosen.tokens < demand.required_tokens:
            lines.append(f"warning: {_rejection(chosen, demand, gpu_mib).removesuffix(': rejected')}; "
                         f"kept because the spec sets it")
        return lines
    lines = []
    for candidate in sizing.candidates[:-1]:
        if candidate.unusable:
            lines.append(f"TP {candidate.tp}: {candidate.unusable}: skipped")
        elif candidate.capacity is not None:
            lines.append(_rejection(candidate.capacity, demand, gpu_mib))
    lines.append(f"TP {chosen.tp}: chosen, the smallest that holds the batch")
    return lines


def _layout_line(sizing: Sizing) -> str:
    server, tp = sizing.spec.server, sizing.tp
    return (f"layout: TP {tp} = {count(sizing.nodes_per_replica, 'node')} x {count(sizing.gpus_per_node, 'GPU')} "
            f"per replica (gpusPerNode {server.gpus_per_node}), {count(server.replicas, 'replica')}, "
            f"{count(tp * server.replicas, 'GPU')} in all")


# --------------------------------------------------------------------------------------------------------------
# Memory and the KV cache.


def _mem_fraction_line(sizing: Sizing) -> str:
    spec, gpu_memory_mib, tp = sizing.spec, sizing.gpu_memory_mib, sizing.tp
    if spec.server.mem_fraction_static != "auto":
        return f"mem-fraction-static {spec.server.mem_fraction_static} from spec.server.memFractionStatic"
    chunk, graph_bs = chunk_and_graph_bs(gpu_memory_mib, tp)
    reserved = sglang_reserved_mib(gpu_memory_mib, tp)
    formula = f"512 + 1.5 x {chunk} (chunked prefill) + 2 x {graph_bs} (CUDA-graph batch) + {tp}/8 x 1024"
    if gpu_memory_mib > 60 * 1024:
        formula = f"max({formula}, 10240)"
    return (f"mem-fraction-static {sizing.capacity.mem_fraction:.3f}: SGLang v0.5.6's default for this GPU and TP, "
            f"round(({gpu_memory_mib:,} - {reserved:,.0f}) / {gpu_memory_mib:,}, 3) with {formula} MiB reserved "
            f"for activations and CUDA graphs")


def _kv_line(model: ModelFacts, tp: int, element_bytes: float, per_rank: int) -> str:
    layers = f"{elements(element_bytes)} x {model.num_layers} layers = {per_token(per_rank)} per token"
    replica = f"{per_rank * tp:,} B per token for the replica"
    if model.is_mla:
        return (f"KV cache: MLA, ({model.kv_lora_rank} + {model.qk_rope_head_dim}) x {layers} on every rank: "
                f"SGLang keeps the whole latent on each of the {tp} TP ranks (no DP attention), so TP does not "
                f"split it and adds room only by splitting the weights ({replica})")
    heads = kv_heads_per_rank(model, tp)
    split = "replicated" if model.num_kv_heads < tp else "split"
    return (f"KV cache: 2 (K, V) x {heads} KV heads per rank ({model.num_kv_heads} {split} over TP {tp}) x "
            f"{model.head_dim} head dim x {layers} per rank ({replica})")


def _capacity_lines(sizing: Sizing) -> list[str]:
    cap, demand, replicas = sizing.capacity, sizing.demand, sizing.spec.server.replicas
    concurrent = sizing.concurrent_requests
    total = f"; x {replicas} replicas = {concurrent * replicas:,} requests" if replicas > 1 else ""
    return [
        f"weights {gib(sizing.weight_bytes)} / TP {cap.tp} = {gib(cap.weight_bytes_per_gpu)} per GPU of "
        f"{gib(cap.usable_bytes)} usable ({cap.mem_fraction:g} x {gib(sizing.gpu_memory_mib * MIB)}), leaving "
        f"{gib(cap.kv_room_bytes)} per GPU for the KV cache",
        _kv_line(sizing.model, cap.tp, sizing.kv_element_bytes, cap.kv_bytes_per_rank),
        f"capacity: {gib(cap.kv_room_bytes)} / {cap.kv_bytes_per_rank:,} B = {cap.tokens:,} tokens per replica "
        f"(each rank holds its share of every token, so one rank's room bounds the replica) = {concurrent:,} "
        f"requests of ~{demand.expected_tokens:,} tokens at once{total}",
    ]


def _kv_dtype_lines(sizing: Sizing) -> list[str]:
    dtype, element_bytes = sizing.spec.server.kv_cache_dtype, sizing.kv_element_bytes
    if dtype != "auto":
        return [f"KV cache dtype {dtype} from spec.server.kvCacheDtype ({elements(element_bytes)} per element)"]
    concurrent = sizing.concurrent_requests
    lines = [f"KV cache dtype auto: the served 16-bit dtype ({sizing.model.torch_dtype or 'dtype not in config'} "
             f"checkpoint), {elements(element_bytes)} per element"]
    if concurrent < TIGHT_BATCH_REQUESTS:
        lines.append(f"option: kvCacheDtype fp8_e4m3 would halve the cache per token (~{2 * concurrent:,} "
                     f"requests of ~{sizing.demand.expected_tokens:,} tokens) at some risk to output fidelity; not "
                     f"applied, set spec.server.kvCacheDtype to use it")
    return lines


# --------------------------------------------------------------------------------------------------------------
# Context length and the batch.


def _context_lines(sizing: Sizing) -> list[str]:
    given, length, model, demand = (sizing.spec.server.context_length, sizing.context_length, sizing.model,
                                    sizing.demand)
    if given == "auto":
        lines = [f"context length {length:,}: the model's max_position_embeddings (SGLang's default too), kept "
                 f"whole because prompt lengths are unknown before tokenizing; lower it with "
                 f"spec.server.contextLength"]
    else:
        lines = [f"context length {length:,} from spec.server.contextLength"]
        if length > model.max_position_embeddings:
            lines.append(f"warning: above the model's max_position_embeddings {model.max_position_embeddings:,}; "
                         f"SGLang refuses it unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
    if demand.longest_tokens > length:
        lines.append(f"warning: dataset {demand.longest_dataset} maxNewTokens {demand.max_new_tokens:,} leaves "
                     f"{length - demand.max_new_tokens:,} tokens for its prompts")
    return lines


def _max_running_line(sizing: Sizing) -> str:
    value, concurrent = sizing.max_running_requests, sizing.concurrent_requests
    if sizing.spec.server.max_running_requests != "auto":
        note = (f"; the KV cache holds ~{concurrent:,} at the expected length, SGLang queues the rest"
                if value > concurrent else "")
        return f"max running requests {value:,} from spec.server.maxRunningRequests{note}"
    cap, context_length = sizing.capacity, sizing.context_length
    return (f"max running requests {value:,}: SGLang's own rule, min(max(int({cap.tokens:,} / "
            f"{context_length:,} x 512), 2048), 4096) capped at {cap.tokens // 2:,} (half the capacity); "
            f"SGLang admits only what free KV allows, ~{concurrent:,} at the expected length")
