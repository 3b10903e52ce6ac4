"""The prose of a server plan: the reasoning lines rendered from a `Sizing`, the note of every candidate layout,
and `render_plan` for people (the settings, the candidate table, then the arithmetic). Pure.

Each line repeats the numbers and the rule behind a value, so a reader of `status.serverPlan.reasoning` or
`tokenmill plan` can check the arithmetic.
"""

from __future__ import annotations

from tokenmill_runner.facts.throughput import StepModel, simulator_step

from .capture import CAPTURE_IN_FLIGHT, JSON_STATE_BYTES_PER_S, CaptureTime
from .memory import MIB, Capacity, sglang_reserve, vlm_factor
from .memory_budget import aux_capture_terms
from .plan import Candidate, ServerPlan
from .sizing import FP8_OPTION, MIN_BATCH_REQUESTS, TIE, Option, Sizing, memory_choices
from .startup import describe
from .units import count, duration, elements, gib, per_token


def reasoning(sizing: Sizing) -> list[str]:
    """The arithmetic behind every value of the plan, one line per step, in the order a reader checks it."""
    return [
        *_release_lines(sizing),
        _model_line(sizing),
        _gpu_line(sizing),
        _budget_line(sizing),
        _job_line(sizing),
        _context_line(sizing),
        *_choice_lines(sizing),
        *_memory_lines(sizing),
        *_capacity_lines(sizing),
        _max_running_line(sizing),
        *_dp_attention_lines(sizing),
        *_kv_dtype_lines(sizing),
        *_prediction_lines(sizing),
    ]


def notes(sizing: Sizing) -> list[str]:
    """One note per option, in the order of sizing.options."""
    return [_note(sizing, option) for option in sizing.options]


# --------------------------------------------------------------------------------------------------------------
# The table for people.


def _layout(c: Candidate) -> str:
    dp = f" DP-attn {c.attention_data_parallel}" if c.attention_data_parallel > 1 else ""
    kv = f" {c.kv_cache_dtype} KV" if c.kv_cache_dtype != "auto" else ""
    return f"{c.replicas} x TP{c.tensor_parallel}{dp}{kv}"


def candidate_table(plan: ServerPlan) -> list[str]:
    header = ("", "layout", "GPUs", "KV tok/replica", "batch", "decode tok/s", "output tok/s", "ETA", "GPU-h", "note")
    rows = [header]
    for c in plan.candidates:
        p = c.prediction
        rows.append(("*" if c.chosen else "", _layout(c), str(c.gpus), f"{c.kv_capacity_tokens:,}" if c.kv_capacity_tokens
                     else "-", f"{p.batch_per_replica:,}" if p else "-", f"{p.decode_tokens_per_second:,}" if p else "-",
                     f"{p.output_tokens_per_second:,}" if p else "-", duration(p.eta_seconds) if p else "-",
                     f"{p.gpu_hours:,.1f}" if p else "-", c.note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
            for row in rows]


def render_plan(plan: ServerPlan) -> str:
    """The plan for people: a short table of the settings, the candidate layouts, then the arithmetic."""
    dp = f", DP attention over {plan.attention_data_parallel} groups" if plan.attention_data_parallel > 1 else ""
    rows = [
        ("SGLang", f"{plan.sglang_version or '-'}, {plan.image or '-'}"),
        ("tensor parallel", f"{plan.tensor_parallel} = {count(plan.nodes_per_replica, 'node')} x "
                            f"{count(plan.gpus_per_node, 'GPU')}, {count(plan.replicas, 'replica')}{dp}"),
        ("mem-fraction-static", plan.mem_fraction_static),
        ("context length", f"{plan.context_length:,}"),
        ("max running requests", f"{plan.max_running_requests:,}"),
        ("KV cache dtype", plan.kv_cache_dtype),
        ("attention backend", plan.attention_backend or "SGLang's choice"),
        ("GPU", f"{plan.gpu_product or '-'}, {plan.gpu_memory_mib:,} MiB"
                f"{f', TP over {plan.interconnect}' if plan.interconnect else ''}"),
        ("weights", f"{gib(plan.weight_bytes)}, {gib(plan.weight_bytes_per_gpu)} per GPU"),
        ("KV per token", f"{plan.kv_bytes_per_token:,} B per replica"),
        ("KV capacity", f"{plan.kv_capacity_tokens:,} tokens = {plan.concurrent_requests_at_expected_length:,} "
                        f"requests of ~{plan.expected_tokens_per_request:,} tokens"),
        ("set in the spec", ", ".join(plan.overrides) or "nothing (all auto)"),
    ]
    if plan.prediction:
        p = plan.prediction
        rows.insert(1, ("predicted", f"{p.output_tokens_per_second:,} output tokens/s ({p.decode_tokens_per_second:,} "
                                     f"decode at the full batch), ETA {duration(p.eta_seconds)} for {p.samples:,} "
                                     f"samples, {p.gpu_hours:,.1f} GPU-hours"))
        if plan.startup and p.generation_seconds is not None:
            rows.insert(2, ("ETA", describe(plan.startup, p.generation_seconds, p.capture_seconds,
                                            p.relaunch_seconds)))
        if p.interval:
            r = p.interval
            rows.insert(2, ("range", f"{r.output_tokens_per_second_low:,}-{r.output_tokens_per_second_high:,} output "
                                     f"tokens/s, ETA {duration(r.eta_seconds_low)}-{duration(r.eta_seconds_high)} "
                                     f"({r.basis})"))
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    if plan.prediction and plan.prediction.datasets:
        lines += ["", "datasets (in the order the runner sends them):"]
        lines += [f"  {d.name}: {d.samples:,} samples, prompts {d.prompt_tokens:,} tokens ({d.prompt_source}), "
                  f"outputs {d.mean_output_tokens:,} ({d.output_source}), done {duration(d.done_seconds)} into "
                  f"generation" for d in plan.prediction.datasets]
    table = ["", "layouts considered (* = chosen):", *(f"  {line}" for line in candidate_table(plan))]
    return "\n".join([*lines, *(table if plan.candidates else []), "", "why:",
                      *(f"  - {line}" for line in plan.reasoning)])


# --------------------------------------------------------------------------------------------------------------
# The release, the model, the GPU, the job.


def _release_lines(sizing: Sizing) -> list[str]:
    serving = sizing.ctx.serving
    said = [sizing.image.reason if sizing.image else "", sizing.attention.reason if sizing.attention else ""]
    return [f"{serving.source} (released {serving.release.released}): the checks and the memory rules below are "
            f"that release's", *filter(None, said), *sizing.warnings]


def _model_line(sizing: Sizing) -> str:
    model = sizing.model
    nested = f" (language model under {model.nested_under})" if model.nested_under else ""
    if model.is_mla:
        attention = f"MLA (kv_lora_rank {model.kv_lora_rank}, qk_rope_head_dim {model.qk_rope_head_dim})"
    else:
        kind = "MHA" if model.num_kv_heads == model.num_attention_heads else "GQA"
        attention = f"{kind}, {model.num_kv_heads} KV heads x {model.head_dim} head dim"
    moe = (f", MoE {model.routed_experts} experts (top {model.experts_per_token}) in {model.moe_layers} layers"
           if model.is_moe else "")
    w = model.weights()
    split = (f" = attention {gib(w.attention)} + experts {gib(w.routed)} + other {gib(w.dense + w.embedding + w.lm_head)}"
             if model.is_moe else "")
    vision = (f" + vision tower {gib(w.vision)} ({model.vision_layers} layers x {model.vision_hidden}, replicated on "
              f"every GPU)" if w.vision else "")
    source = " (spec.model.weightBytes)" if sizing.spec.model.weight_bytes is not None else ""
    return (f"model: {model.architecture or model.model_type or 'unknown architecture'}{nested}, "
            f"{model.num_layers} layers, {model.num_attention_heads} attention heads, {attention}{moe}; "
            f"weights {gib(model.weight_bytes)}{source}{split}{vision}")


def _gpu_line(sizing: Sizing) -> str:
    server, gpu, mib = sizing.spec.server, sizing.ctx.gpu, sizing.ctx.gpu_memory_mib
    memory = f"{mib:,} MiB ({gib(mib * MIB)}) each{' (spec.server.gpuMemoryMib)' if server.gpu_memory_mib else ''}"
    if gpu is None:
        name = server.gpu_product or "product not named"
        return (f"GPU: {name}, {memory}; no known product, so no throughput is predicted (the plan takes the "
                f"smallest TP whose cache holds {MIN_BATCH_REQUESTS} requests); name a product in "
                f"spec.server.gpuProduct for the candidate table")
    alias = f" (for {server.gpu_product})" if server.gpu_product and server.gpu_product != gpu.label else ""
    link = gpu.scale_up
    return (f"GPU: {gpu.label}{alias}, {memory}, {gpu.memory_bandwidth / 1e9:,.0f} GB/s, "
            f"{gpu.flops('bf16') / 1e12:,.0f} TFLOPS bf16 dense; GPUs of a node talk over {link.kind} "
            f"({link.bandwidth / 1e9:,.0f} GB/s per direction, {gpu.scale_up_domain} GPUs per domain); "
            f"{server.gpus_per_node} per node")


def _budget_line(sizing: Sizing) -> str:
    return (f"GPUs: {sizing.budget_gpus} ({sizing.budget_source}); the layout that finishes soonest on them is "
            f"chosen (ETAs within {TIE:.0%} are a tie, then fewer GPU-hours)")


def _job_line(sizing: Sizing) -> str:
    work = sizing.ctx.work
    parts = []
    for d in work.datasets:
        shape = (f"fixed {d.output_tokens:,} output tokens" if d.output_tokens is not None else
                 f"outputs like the seeds' (median 470, p90 3,700) cut at maxNewTokens {d.max_new_tokens:,}: mean "
                 f"{d.mean_output():,.0f}, {d.capped_share():.1%} at the cap")
        if d.outputs_from_answers and d.output_tokens is None:
            shape = (f"outputs like the sampled rows' earlier answers cut at maxNewTokens {d.max_new_tokens:,}: mean "
                     f"{d.mean_output():,.0f}, {d.capped_share():.1%} at the cap")
        count_text = f"{d.samples:,}" if d.samples_known else f"{d.samples:,} (no limit: assumed)"
        prompts = (f"prompts from a sample ({d.sample.describe()})" if d.prompt_sampled and d.sample else
                   f"{d.prompt_tokens:,}-token prompts (assumed: no sample read)")
        parts.append(f"{d.name} {count_text} samples, {prompts}, {shape}")
    concurrency = f"; runner concurrency {work.concurrency:,}" if work.concurrency else ""
    return (f"job: {'; '.join(parts)}{concurrency}. A running request holds {work.held:,.0f} tokens on average "
            f"(long requests run longer, so they weigh more than their share)")


def _context_line(sizing: Sizing) -> str:
    return (f"context length {sizing.ctx.context_length:,}: {sizing.context_source} (SGLang refuses a "
            f"--context-length longer than it derives from config.json; every request slot's req_to_token row is "
            f"this long, mem_cache/memory_pool.py:406)")


# --------------------------------------------------------------------------------------------------------------
# The layouts and the choice.


def _layout_text(option: Option) -> str:
    dp = f" with DP attention over {option.layout.attention_dp}" if option.layout.attention_dp > 1 else ""
    kv = f", {option.kv_cache_dtype} KV" if option.kv_cache_dtype != "auto" else ""
    return f"{count(option.replicas, 'replica')} of TP {option.layout.tp}{dp}{kv}"


def _note(sizing: Sizing, option: Option) -> str:
    if option is sizing.chosen:
        return "chosen"
    if option.unusable:
        return option.unusable
    best = sizing.chosen
    if option.not_allowed:
        change = f", {option.eta / best.eta - 1:+.0%} ETA" if option.job and best.job else ""
        return f"not allowed: {option.not_allowed}{change}"
    if not option.eligible:
        return f"needs spec.server.kvCacheDtype: {FP8_OPTION} (half the cache per token, some risk to fidelity)"
    if option.batch == 0:
        return "holds no request"
    if option.job and best.job:
        slower = option.eta / best.eta - 1
        return f"{slower:+.0%} ETA" if abs(slower) >= 0.005 else "a tie, more GPU-hours or a larger layout"
    return "not chosen"


def _choice_lines(sizing: Sizing) -> list[str]:
    chosen, server = sizing.chosen, sizing.spec.server
    given = [name for name, value in (("tensorParallel", server.tensor_parallel), ("replicas", server.replicas),
                                      ("attentionDataParallel", server.attention_data_parallel))
             if value != "auto"]
    lines = [f"layout: {_layout_text(chosen)}, {count(chosen.nodes_per_replica, 'node')} per replica, "
             f"{count(chosen.gpus, 'GPU')} in all"
             + (f" ({', '.join('spec.server.' + g for g in given)} as given)" if given else "")]
    if sizing.predicted:
        runnable = [o for o in sizing.options if o.choosable and o.job]
        others = sorted((o for o in runnable if o is not chosen), key=lambda o: o.eta)[:2]
        if others:
            lines.append("rule: the smallest predicted ETA; next: " + "; ".join(
                f"{_layout_text(o)} {duration(round(o.eta))} ({o.eta / chosen.eta - 1:+.0%})" for o in others))
    else:
        lines.append(f"rule: the smallest TP whose KV cache holds {MIN_BATCH_REQUESTS} running requests")
    if chosen.layout.attention_dp > 1:
        lines.append(f"DP attention: {chosen.layout.attention_dp} groups of {chosen.layout.attention_tp} GPUs each "
                     f"keep their own requests' KV, so the replica holds {chosen.layout.attention_dp}x the requests "
                     f"a TP-only replica would (MLA keeps its whole latent on every rank of a group); attention "
                     f"weights are split over {chosen.layout.attention_tp} GPUs instead of {chosen.layout.tp}")
    elif sizing.model.is_mla and chosen.layout.tp > 1:
        lines.append(f"no DP attention: MLA keeps the whole latent on each of the {chosen.layout.tp} ranks, so TP "
                     f"adds KV room only by splitting the weights")
    return lines


# --------------------------------------------------------------------------------------------------------------
# Memory and the KV cache.


def _memory_lines(sizing: Sizing) -> list[str]:
    chosen = sizing.chosen
    if chosen.memory is None or not chosen.memory.decided:
        return [_mem_fraction_line(sizing), *_uncounted_capture_lines(sizing)]
    split, mib = chosen.memory, sizing.ctx.gpu_memory_mib
    outside = "; ".join(f"{t.name} {t.mib:,.0f} ({t.source})" for t in split.terms)
    choices = memory_choices(sizing.ctx, chosen.layout, chosen.kv_cache_dtype, chosen.nodes_per_replica,
                             chosen.replicas)
    default = next(c for c in choices if not c.split.decided)
    rate = "tokens/s" if sizing.predicted else "KV tokens"
    weighed = "; ".join(
        f"{'SGLang default' if not c.split.decided else f'chunk {c.split.chunk:,}'}: fraction "
        f"{c.split.mem_fraction:.3f}, batch {c.batch:,}, {c.served:,.0f} {rate}" for c in choices)
    default_kv = (f"{gib(default.capacity.kv_room_bytes)} of KV per GPU" if default.capacity.fits
                  else "no room for the weights")
    return [
        f"mem-fraction-static {split.mem_fraction:.3f}, decided by the plan: floor(({mib:,} - "
        f"{split.reserved_mib:,.0f}) / {mib:,}, 3) with, per GPU in MiB, {outside}. Every allocation SGLang makes after sizing the KV pool is one "
        f"of these terms at its largest (a full chunk, the whole captured graph batch), and the margin covers what "
        f"they do not count",
        f"instead of SGLang's default {default.split.mem_fraction:.3f} ({default_kv}): its reserve (512 + 1.5 MiB "
        f"per chunk token, at least 10 GiB over 60 GB, and a vision-tower cut for a tower tokenmill never feeds) is "
        f"one rule for every model; weighed: {weighed} (chunks per group); the most {rate} wins, so "
        f"--chunked-prefill-size {split.chunk_flag:,}"
        + (f" ({split.chunk:,} per group after SGLang divides it by the {split.groups} groups, "
           f"arg_groups/parallel_hook.py:331)" if split.groups > 1 else "")
        + f" and a decode CUDA-graph batch of {split.graph_bs} per group (a quarter above the batch a group runs)",
    ]


def _dp_attention_lines(sizing: Sizing) -> list[str]:
    """What SGLang does under DP attention (planner/dp_attention.py), so the reader sees the server that runs."""
    chosen = sizing.chosen
    groups = chosen.layout.attention_dp
    if groups == 1:
        return []
    graph = chosen.graph_bs or 0
    return [
        f"DP attention over {groups} groups, as SGLang runs it: schedule conservativeness x 0.3 "
        f"(arg_groups/parallel_hook.py:318: bolder admission, more retractions); the groups step in lockstep and all "
        f"run eager when any group's batch exceeds its decode graph of {graph} "
        f"(model_executor/runner/decode_cuda_graph_runner.py:871-895), so --max-running-requests is at most "
        f"{graph} x {groups}; requests go to the group holding the fewest tokens (--load-balance-method total_tokens, "
        f"managers/data_parallel_controller.py:139-155) rather than round robin, blind to length "
        f"(arg_groups/serving_hook.py:222-233)",
    ]


def _mem_fraction_line(sizing: Sizing) -> str:
    spec, chosen, mib = sizing.spec, sizing.chosen, sizing.ctx.gpu_memory_mib
    if spec.server.mem_fraction_static != "auto":
        return f"mem-fraction-static {spec.server.mem_fraction_static} from spec.server.memFractionStatic"
    release = sizing.ctx.serving.release
    r = sglang_reserve(mib, chosen.layout, sizing.model, release, chosen.graph_bs)
    terms = [f"512 + 1.5 x {r.chunk} (prefill chunk)", f"2 x {r.graph_bs} (decode CUDA graphs)",
             f"{chosen.layout.tp}/8 x 1024 (NCCL)"]
    if r.dp_attention:
        terms.append(f"{r.dp_attention:,.0f} (DP attention padding, {r.graph_bs} x {chosen.layout.attention_dp} "
                     f"groups x {'4.5' if r.graph_bs > 300 else '3'})")
    if r.prefill_graphs:
        terms.append(f"{r.prefill_graphs:,.0f} (prefill CUDA graphs)")
    formula = " + ".join(terms)
    if mib > 60 * 1024:
        formula = f"max({formula}, 10240)"
    factor = vlm_factor(sizing.model)
    vlm = (f", x {factor:.3f} for the vision tower (SGLang's rule for multimodal models: 0.95 x (1 - 0.1 x "
           f"({sizing.model.vision_layers} x {sizing.model.vision_hidden}^2 / (24 x 1024^2) - 1)))"
           if factor != 1 else "")
    graph = (f"; the plan sets the decode CUDA-graph batch to {chosen.graph_bs} per group, the batch a group runs, "
             f"which shrinks that padding" if chosen.graph_bs else "")
    return (f"mem-fraction-static {chosen.mem_fraction:.3f}: SGLang {release.version}'s default for this GPU and "
            f"layout, round(({mib:,} - {r.total:,.0f}) / {mib:,}, 3) with {formula} MiB reserved{vlm}{graph}")


def _uncounted_capture_lines(sizing: Sizing) -> list[str]:
    """Under SGLang's own rule (or a given fraction) the capture's memory is not in the reserve: say how much of
    the slack it takes, so a reader can lower memFractionStatic by it."""
    chosen, layers = sizing.chosen, sizing.ctx.aux_layers
    if not layers:
        return []
    r = sglang_reserve(sizing.ctx.gpu_memory_mib, chosen.layout, sizing.model, sizing.ctx.serving.release,
                       chosen.graph_bs)
    found = aux_capture_terms(sizing.model, chosen.layout, r.chunk // chosen.layout.attention_dp, r.graph_bs, layers)
    total = sum(term.mib for term in found)
    return [f"note: hidden-state capture needs {total:,.0f} MiB per GPU that this fraction's reserve does not count "
            f"(SGLang's rule has no term for it, arg_groups/memory_hook.py:296-318): "
            + "; ".join(f"{t.name} {t.mib:,.0f} ({t.source})" for t in found)]


def _kv_line(sizing: Sizing, cap: Capacity) -> str:
    model, layout = sizing.model, cap.layout
    element = cap.kv_bytes_per_rank / max(1, model.num_layers)
    if model.is_mla:
        width = (model.kv_lora_rank or 0) + (model.qk_rope_head_dim or 0)
        where = (f"each of the {layout.attention_tp} ranks of an attention group" if layout.attention_dp > 1
                 else f"each of the {layout.tp} TP ranks")
        return (f"KV cache: MLA, ({model.kv_lora_rank} + {model.qk_rope_head_dim}) x "
                f"{elements(cap.kv_bytes_per_rank / width / model.num_layers)} x {model.num_layers} layers = "
                f"{per_token(cap.kv_bytes_per_rank)} per token on {where} (SGLang keeps the whole latent per rank)")
    heads = max(1, model.num_kv_heads // layout.attention_tp)
    split = "replicated" if model.num_kv_heads < layout.attention_tp else "split"
    return (f"KV cache: 2 (K, V) x {heads} KV heads per rank ({model.num_kv_heads} {split} over {layout.attention_tp}) "
            f"x {model.head_dim} head dim x {model.num_layers} layers = {per_token(cap.kv_bytes_per_rank)} per rank "
            f"({element:,.0f} B per layer)")


def _capacity_lines(sizing: Sizing) -> list[str]:
    cap, chosen = sizing.capacity, sizing.chosen
    mib = sizing.ctx.gpu_memory_mib
    groups = (f" per group x {cap.layout.attention_dp} groups = {cap.tokens:,} tokens per replica"
              if cap.layout.attention_dp > 1 else " per replica (every rank holds its share of every token)")
    lines = [
        f"weights {gib(cap.weight_bytes_per_gpu)} per GPU of {gib(cap.usable_bytes)} usable ({cap.mem_fraction:.3f} "
        f"x {gib(mib * MIB)}), leaving {gib(cap.kv_room_bytes)} per GPU for the KV cache",
        _kv_line(sizing, cap),
        f"capacity: {gib(cap.kv_room_bytes)} / {cap.kv_bytes_per_rank:,} B = {cap.tokens_per_group:,} tokens{groups} = "
        f"{sizing.concurrent_requests:,} requests of ~{sizing.ctx.held:,.0f} tokens; batch {chosen.batch:,} per replica",
    ]
    if chosen.batch < MIN_BATCH_REQUESTS:
        lines.append(f"warning: a batch of {chosen.batch} running requests per replica is small: decode throughput "
                     f"grows with the batch; more or larger GPUs, an fp8 KV cache or smaller maxNewTokens raise it")
    return lines


def _max_running_line(sizing: Sizing) -> str:
    chosen, cap = sizing.chosen, sizing.capacity
    if sizing.spec.server.max_running_requests != "auto":
        note = (f"; the KV cache holds ~{sizing.concurrent_requests:,} at the expected length, SGLang queues the rest"
                if chosen.max_running > sizing.concurrent_requests else "")
        return f"max running requests {chosen.max_running:,} from spec.server.maxRunningRequests{note}"
    per_group = (f" per group, x {cap.layout.attention_dp} groups (SGLang divides the value by the groups)"
                 if cap.layout.attention_dp > 1 else "")
    graph_cap = (f", capped at the decode graph batch {chosen.graph_bs} per group (lockstep: one group past it sends "
                 f"every group eager)" if cap.layout.attention_dp > 1 and chosen.graph_bs else "")
    return (f"max running requests {chosen.max_running:,}: SGLang's own rule, min(max(int({cap.tokens_per_group:,} / "
            f"{sizing.ctx.context_length:,} x 512), 2048), 4096) capped at {cap.tokens_per_group // 2:,} (half the "
            f"capacity){per_group}{graph_cap}; SGLang admits only what free KV allows, "
            f"~{sizing.concurrent_requests:,} at the expected length")


def _kv_dtype_lines(sizing: Sizing) -> list[str]:
    chosen = sizing.chosen
    dtype = chosen.kv_cache_dtype
    if dtype != "auto":
        return [f"KV cache dtype {dtype} from spec.server.kvCacheDtype"]
    lines = [f"KV cache dtype auto: the served 16-bit dtype ({sizing.model.torch_dtype or 'dtype not in config'} "
             f"checkpoint)"]
    fp8 = [o for o in sizing.options if not o.eligible and o.runs and o.job and o.layout == chosen.layout]
    if fp8 and chosen.job and fp8[0].job:
        shorter = 1 - fp8[0].eta / chosen.eta
        lines.append(f"option: kvCacheDtype {FP8_OPTION} would halve the cache per token (batch {fp8[0].batch:,} "
                     f"instead of {chosen.batch:,}, ETA {shorter:.0%} shorter) at some risk to output fidelity; not "
                     f"applied, set spec.server.kvCacheDtype to use it")
    elif chosen.batch < MIN_BATCH_REQUESTS:
        lines.append(f"option: kvCacheDtype {FP8_OPTION} would halve the cache per token; not applied, set "
                     f"spec.server.kvCacheDtype to use it")
    return lines


def _prediction_lines(sizing: Sizing) -> list[str]:
    chosen = sizing.chosen
    step = sizing.step_model(chosen)
    if step is None or chosen.job is None:
        return []
    held = sizing.ctx.held
    t = step.step_seconds(chosen.batch, held)
    memory, compute = step.memory_seconds(chosen.batch, held), step.compute_seconds(chosen.batch, held)
    fixed = step.overhead_seconds(chosen.batch)
    prediction = chosen.prediction(step, held, sizing.ctx.work)
    assert prediction is not None
    lines = [
        f"prediction: a decode step of {chosen.batch:,} requests takes {t * 1e3:,.1f} ms = max(memory "
        f"{memory * 1e3:,.1f} ms, compute {compute * 1e3:,.1f} ms) + fixed costs {fixed * 1e3:,.1f} ms (layer floors, "
        f"collectives; bound by {chosen.bound}) = {prediction.decode_tokens_per_second:,} tokens/s over "
        f"{count(chosen.replicas, 'replica')}; with prefill and the draining tail the job averages "
        f"{prediction.output_tokens_per_second:,} output tokens/s: ETA {duration(prediction.eta_seconds)} for "
        f"{prediction.samples:,} samples, {prediction.gpu_hours:,.1f} GPU-hours (throughput model calibrated on "
        f"published SGLang measurements, docs/throughput.md)",
    ]
    if chosen.capture is not None:
        lines.append(_capture_line(sizing, chosen.capture, step))
    empty, per_request, prefill = simulator_step(step, chosen.batch, held, sizing.ctx.work.prompt_tokens())
    lines.append(f"simulator: tokenmill sim-server --step-ms {empty:.2f} --step-ms-per-request {per_request:.4f} "
                 f"--prefill-ms-per-1k-tokens {prefill:.2f} --max-running-requests {chosen.batch} --max-total-tokens "
                 f"{sizing.capacity.tokens} runs one replica of this layout locally (the same step time, linear "
                 f"between batch 1 and {chosen.batch})")
    if step.link.is_pcie and chosen.layout.tp > 1:
        lines.append(f"note: tensor parallelism runs over PCIe ({step.link.bandwidth / 1e9:,.0f} GB/s per direction, "
                     f"no NVLink): every layer's all-reduces cross it, which the prediction includes")
    if prediction.samples_assumed:
        lines.append("note: a dataset without limit is counted as 10,000 samples for the ETA (tokens/s do not depend "
                     "on it)")
    return lines


def _capture_line(sizing: Sizing, capture: CaptureTime, step: StepModel) -> str:
    workers = sizing.spec.runner.parallelism
    in_flight = CAPTURE_IN_FLIGHT * workers
    return (f"hidden-state capture after generation: {duration(round(capture.seconds))} (bound by {capture.bound}) = "
            f"max(prefill {duration(round(capture.forward_seconds))}: every prompt + output once more, no cached "
            f"prefix, {in_flight} in flight on one replica, chunks of {step.chunk_tokens:,} tokens, by the step "
            f"model above; JSON {duration(round(capture.transfer_seconds))}: {capture.state_bytes / 1e9:,.2f} GB of "
            f"served states at {JSON_STATE_BYTES_PER_S / 1e6:,.1f} MB/s per runner worker x {count(workers, 'worker')}, "
            f"docs/export.md); every GPU is held through it, so it is in the ETA and GPU-hours"
            + (f"; it includes SpecForge's final-state pass after the server's relaunch with "
               f"--enable-return-hidden-states: {duration(round(capture.final.seconds))}, "
               f"{capture.final.state_bytes / 1e9:,.2f} GB" if capture.final else ""))
