"""How long one decode step and one prefill token take on a server layout: a roofline with a per-layer floor, a
per-request cost and the interconnect, calibrated on published SGLang measurements. Pure.

A decode step of one SGLang server (one replica: `tp` GPUs, `attention_dp` attention groups inside it) reads
the weights the batch touches and the KV cache of its requests from memory, multiplies the batch through the
active weights, and runs collectives over the link between its GPUs (two per layer). Per GPU:

    memory   = (attention / attention-TP + dense / TP + lm_head / TP + routed / TP x touched(B)) + KV of its requests
    compute  = 2 x active params x B / TP + attention scores
    step     = max(memory / (eff_memory x bandwidth), compute / (eff_compute x peak))
               + layers x (floor + collectives x (latency + bytes / link)) + per-request cost x requests per group

`touched(B) = 1 - (1 - k/E)^B` is the share of an MoE layer's experts that a batch of B tokens routes to. A plain
roofline over-predicts published throughputs 2-25x (docs/throughput.md): the per-layer floor (kernel launches and
collective latency, ~9 ms a step for a 61-layer MoE at TP 8) and a per-request cost (scheduling, sampling,
attention kernels) are what the calibration adds. The constants are fitted once on the records of
docs/throughput-calibration.yaml by hack/bench/bench_planner.py --fit; that bench reports the error per record.

`step_seconds(batch, context_tokens)` is the simulator's hook: the same step time for a GPU, a model and a layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Gpu, Link
from .model_facts import ModelFacts, WeightSplit

KV_AUTO_BYTES = 2.0  # SGLang's auto KV dtype is the served 16-bit dtype


@dataclass(frozen=True)
class Layout:
    """One SGLang server: tp GPUs, attention_dp attention groups among them (DP attention), ep expert groups."""

    tp: int
    attention_dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.attention_dp < 1 or self.tp % self.attention_dp:
            raise ValueError(f"attention DP {self.attention_dp} must divide TP {self.tp}")

    @property
    def attention_tp(self) -> int:
        return self.tp // self.attention_dp


@dataclass(frozen=True)
class Calibration:
    """The fitted constants (hack/bench/bench_planner.py --fit; values and errors in docs/throughput.md)."""

    memory_efficiency: float = 0.774  # share of the spec-sheet bandwidth dense reads (weights, KV) reach
    moe_memory_efficiency: float = 0.469  # the same for 16-bit routed experts: fused MoE kernels, few tokens each
    quantized_moe_memory_efficiency: float = 0.411  # for fp8/int4/fp4 experts, dequantized inside the MoE kernel
    compute_efficiency: float = 0.75  # share of the dense tensor peak decode GEMMs reach
    prefill_efficiency: float = 0.290  # share of the peak a prefill forward reaches (attention, chunking, launches)
    layer_floor_s: float = 5e-6  # per layer and forward: kernel launches and small ops that no batch amortizes
    mla_layer_floor_s: float = 17.6e-6  # more per MLA layer: its low-rank projections and rope are more kernels
    step_floor_s: float = 2.41e-3  # per forward: scheduling and sampling of the batch as a whole
    request_s: float = 0.0  # per running request, per layer and step: the fit finds none beyond the KV reads
    dp_attention_layer_s: float = 135e-6  # per layer and step with DP attention: the gather/scatter around MoE
    # Fixed latency of one all-reduce (or gather/scatter) of a decode step's small message, by link. NVLink's is
    # fitted (it carries most of the per-layer floor of a TP 8 server); Infinity Fabric has no record and takes
    # NVLink's; PCIe and the network between nodes have no record that constrains them: set a little above.
    collective_nvlink_s: float = 26.6e-6
    collective_pcie_s: float = 60e-6
    collective_network_s: float = 50e-6
    # GDDR cards (RTX PRO 6000: GDDR7 over PCIe) run a whole step this many times faster than the efficiencies fitted
    # mostly on HBM GPUs predict from their spec sheet: every record on them was under-predicted (held out: 1.2-2.9x)
    # while the HBM efficiency sat at its upper bound to meet them halfway. A class term, fitted on both of the
    # sources that measure these cards; the records cannot split it into GDDR7's share of its bandwidth and the
    # sm120 kernels' share of their peaks.
    gddr_step_speed: float = 1.31
    # A measured correction of every collective's time (latency and bytes alike) on the cluster's link: 1 until a
    # run's first minutes refit it (facts/refit.py); the published records fix no PCIe figure.
    collective_scale: float = 1.0

    def collective_latency(self, link: Link) -> float:
        if link.kind in ("nvlink", "xgmi"):
            return self.collective_nvlink_s
        return self.collective_pcie_s if link.kind == "pcie" else self.collective_network_s


CALIBRATION = Calibration()


# ----------------------------------------------------------------------------------------------------------------
# Bytes and FLOPs of one step.


def kv_bytes_per_token(model: ModelFacts, element_bytes: float = KV_AUTO_BYTES) -> float:
    """KV-cache bytes one token takes across all layers, all heads (MLA: the one latent)."""
    if model.is_mla:
        width = (model.kv_lora_rank or 0) + (model.qk_rope_head_dim or 0)
    else:
        width = 2 * model.num_kv_heads * model.head_dim
    return width * element_bytes * model.num_layers


def kv_shards(model: ModelFacts, attention_tp: int) -> int:
    """Ways an attention group splits one token's KV: MLA keeps the whole latent on every rank; grouped heads are
    split over the ranks, and replicated once there are more ranks than KV heads."""
    return 1 if model.is_mla else max(1, min(attention_tp, model.num_kv_heads))


def experts_touched(model: ModelFacts, tokens: float) -> float:
    """Expected share of an MoE layer's routed experts that `tokens` tokens route to (uniform routing)."""
    if not model.is_moe or tokens <= 0:
        return 1.0 if not model.is_moe else 0.0
    untouched: float = (1.0 - model.experts_per_token / model.routed_experts) ** tokens
    return 1.0 - untouched


def weight_bytes_read(weights: WeightSplit, model: ModelFacts, layout: Layout, batch: float) -> float:
    """Weight bytes one GPU reads in a decode step of `batch` requests."""
    return (weights.attention / layout.attention_tp
            + (weights.dense + weights.lm_head) / layout.tp
            + weights.routed / layout.tp * experts_touched(model, batch))


def _attention_flops_per_token(model: ModelFacts, context_tokens: float) -> float:
    if model.is_mla:  # absorbed MLA: scores over the latent + rope part, values over the latent
        width = 2 * (model.kv_lora_rank or 0) + (model.qk_rope_head_dim or 0)
        return 2.0 * model.num_attention_heads * width * context_tokens * model.num_layers
    return 4.0 * model.num_attention_heads * model.head_dim * context_tokens * model.num_layers


def _collectives(layout: Layout, link: Link, batch: float, model: ModelFacts, cal: Calibration) -> float:
    """Collective time of one layer: two all-reduces of the hidden states over TP, or under DP attention a gather
    and a scatter over TP plus an all-reduce inside each attention group."""
    if layout.tp == 1:
        return 0.0
    latency = cal.collective_latency(link)
    message = batch * model.hidden_size * 2.0  # bf16 hidden states of the whole batch

    def ring(gpus: int, size: float) -> float:
        return latency + 2.0 * (gpus - 1) / gpus * size / link.bandwidth

    if layout.attention_dp == 1:
        return cal.collective_scale * 2 * ring(layout.tp, message)
    inner = ring(layout.attention_tp, message / layout.attention_dp) if layout.attention_tp > 1 else 0.0
    return cal.collective_scale * (2 * ring(layout.tp, message / 2) + inner)


# ----------------------------------------------------------------------------------------------------------------
# The step.

@dataclass(frozen=True)
class StepParts:
    """One decode step in seconds by part: step = max(dense + experts, compute) + fixed + collectives + dp."""

    dense: float  # attention, dense and LM-head weights and the KV cache read from memory
    experts: float  # routed experts the batch touches, read from memory
    compute: float
    collectives: float
    dp: float  # DP attention's gather/scatter overhead per layer
    fixed: float  # step and layer floors

    @property
    def seconds(self) -> float:
        return max(self.dense + self.experts, self.compute) + self.fixed + self.collectives + self.dp


# SGLang's chunked prefill size for GPUs of 60-160 GB (H100, H200, RTX PRO 6000); 16384 from 160 GB (B200, MI300X)
# (0.5.23 arg_groups/memory_hook.py:90-170). A prompt longer than the chunk is prefilled in several forwards.
DEFAULT_CHUNK_TOKENS = 8192


@dataclass(frozen=True)
class StepModel:
    """A model on a GPU in a layout: decode step and prefill forward times, and what bounds them."""

    model: ModelFacts
    gpu: Gpu
    layout: Layout
    kv_element_bytes: float = KV_AUTO_BYTES
    calibration: Calibration = CALIBRATION
    nodes: int = 1  # nodes the replica spans: beyond the scale-up domain its collectives cross the network
    chunk: int | None = None  # the per-group prefill chunk the plan sets; None: SGLang's tier default // groups

    @property
    def _speed(self) -> float:
        return self.calibration.gddr_step_speed if self.gpu.memory_kind == "gddr" else 1.0

    @property
    def link(self) -> Link:
        span = self.layout.tp if self.nodes == 1 else max(self.layout.tp, self.gpu.scale_up_domain + 1)
        return self.gpu.link(span)

    @property
    def chunk_tokens(self) -> int:
        """Prompt tokens one attention group prefills per forward: under DP attention SGLang divides
        --chunked-prefill-size by the groups (0.5.23 arg_groups/parallel_hook.py:331; 0.5.9 server_args.py:2117)."""
        if self.chunk:
            return self.chunk
        tier = DEFAULT_CHUNK_TOKENS if self.gpu.memory_mib < 160 * 1024 else 2 * DEFAULT_CHUNK_TOKENS
        return tier // self.layout.attention_dp

    def _read_seconds(self, tokens: float, kv_bytes: float) -> float:
        weights, cal = self.model.weights(), self.calibration
        dense = weights.attention / self.layout.attention_tp + (weights.dense + weights.lm_head) / self.layout.tp
        routed = weights.routed / self.layout.tp * experts_touched(self.model, tokens)
        moe = cal.moe_memory_efficiency if self.model.routed_bits >= 16 else cal.quantized_moe_memory_efficiency
        return ((dense + kv_bytes) / (cal.memory_efficiency * self.gpu.memory_bandwidth)
                + routed / (moe * self.gpu.memory_bandwidth)) / self._speed

    def _gemm_flops(self, tokens: float) -> float:
        return 2.0 * self.model.active_params_per_token() * tokens / self.layout.tp

    def memory_seconds(self, batch: float, context_tokens: float) -> float:
        per_group = batch / self.layout.attention_dp
        kv = per_group * context_tokens * kv_bytes_per_token(self.model, self.kv_element_bytes) / kv_shards(
            self.model, self.layout.attention_tp)
        return self._read_seconds(batch, kv)

    def compute_seconds(self, batch: float, context_tokens: float) -> float:
        attention = _attention_flops_per_token(self.model, context_tokens) * batch / self.layout.tp
        cal = self.calibration
        return (self._gemm_flops(batch) / (cal.compute_efficiency * self.gpu.flops(self.model.compute_dtype))
                + attention / (cal.compute_efficiency * self.gpu.flops("bf16"))) / self._speed

    def _fixed_seconds(self, tokens: float) -> float:
        cal = self.calibration
        per_layer = cal.layer_floor_s + _collectives(self.layout, self.link, tokens, self.model, cal)
        if self.model.is_mla:
            per_layer += cal.mla_layer_floor_s
        if self.layout.attention_dp > 1:
            per_layer += cal.dp_attention_layer_s
        return (cal.step_floor_s + self.model.num_layers * per_layer) / self._speed

    def overhead_seconds(self, batch: float) -> float:
        per_group = batch / self.layout.attention_dp
        return (self._fixed_seconds(batch)
                + self.calibration.request_s * per_group * self.model.num_layers / self._speed)

    def step_seconds(self, batch: float, context_tokens: float) -> float:
        """One decode step with `batch` running requests holding `context_tokens` tokens each on average."""
        batch = max(batch, 1.0)
        bound = max(self.memory_seconds(batch, context_tokens), self.compute_seconds(batch, context_tokens))
        return bound + self.overhead_seconds(batch)

    def parts(self, batch: float, context_tokens: float) -> StepParts:
        """The decode step split into what the refit scales (facts/refit.py) and what it keeps."""
        batch = max(batch, 1.0)
        weights, cal = self.model.weights(), self.calibration
        per_group = batch / self.layout.attention_dp
        kv = per_group * context_tokens * kv_bytes_per_token(self.model, self.kv_element_bytes) / kv_shards(
            self.model, self.layout.attention_tp)
        dense = weights.attention / self.layout.attention_tp + (weights.dense + weights.lm_head) / self.layout.tp
        routed = weights.routed / self.layout.tp * experts_touched(self.model, batch)
        moe = cal.moe_memory_efficiency if self.model.routed_bits >= 16 else cal.quantized_moe_memory_efficiency
        layers, speed = self.model.num_layers, self._speed
        collectives = layers * _collectives(self.layout, self.link, batch, self.model, cal) / speed
        dp = (layers * cal.dp_attention_layer_s if self.layout.attention_dp > 1 else 0.0) / speed
        fixed = self.overhead_seconds(batch) - collectives - dp
        return StepParts(dense=(dense + kv) / (cal.memory_efficiency * self.gpu.memory_bandwidth) / speed,
                         experts=routed / (moe * self.gpu.memory_bandwidth) / speed,
                         compute=self.compute_seconds(batch, context_tokens), collectives=collectives, dp=dp,
                         fixed=fixed)

    def decode_tokens_per_second(self, batch: float, context_tokens: float) -> float:
        return batch / self.step_seconds(batch, context_tokens)

    def prefill_seconds(self, tokens: float, prompt_tokens: float) -> float:
        """One prefill forward over `tokens` prompt tokens (of prompts `prompt_tokens` long): SGLang runs it apart
        from the decode steps (mixed chunks are off by default), reading the experts its tokens route to."""
        tokens = max(tokens, 1.0)
        cal = self.calibration
        attention = _attention_flops_per_token(self.model, prompt_tokens / 2) * tokens / self.layout.tp
        compute = (self._gemm_flops(tokens) + attention) / (cal.prefill_efficiency * self._speed
                                                           * self.gpu.flops(self.model.compute_dtype))
        return max(self._read_seconds(tokens, 0.0), compute) + self._fixed_seconds(tokens)

    def chunked_prefill_seconds(self, tokens: float, prompt_tokens: float) -> float:
        """Prefill of `tokens` admitted prompt tokens: SGLang runs at most a chunk per forward, so a large admission
        takes several forwards, each paying the fixed costs and the expert reads again."""
        groups = self.layout.attention_dp
        # The groups prefill side by side, each at most its chunk (the admitted prompts spread over them), and one
        # prompt longer than a group's chunk takes several forwards on its own.
        forwards = max(1, math.ceil(tokens / (self.chunk_tokens * groups)),
                       math.ceil(prompt_tokens / self.chunk_tokens))
        return forwards * self.prefill_seconds(tokens / forwards, prompt_tokens)

    def bound(self, batch: float, context_tokens: float) -> str:
        """What limits the step: memory, compute or the fixed costs (floor, collectives, per-request)."""
        memory, compute = self.memory_seconds(batch, context_tokens), self.compute_seconds(batch, context_tokens)
        overhead = self.overhead_seconds(batch)
        largest = max(memory, compute, overhead)
        return "memory" if largest == memory else "compute" if largest == compute else "overhead"


def prefill_seconds_per_step(step: StepModel, batch: float, prompt_tokens: float, output_tokens: float) -> float:
    """Prefill time a decode step carries when `batch` requests keep running: batch / output_tokens requests finish
    per step and as many new prompts are prefilled, together in one forward up to the chunk size."""
    admitted = batch / max(output_tokens, 1.0)
    tokens = admitted * prompt_tokens
    groups = step.layout.attention_dp
    forward = step.chunk_tokens * groups  # every group prefills its chunk side by side
    # A prompt longer than a group's chunk takes several forwards in a row (the other prompts ride along).
    sequential = min(admitted, 1.0) * math.ceil(prompt_tokens / step.chunk_tokens)
    forwards = max(tokens / forward, sequential, min(1.0, admitted))
    per_forward = tokens / forwards if forwards else 0.0
    return forwards * step.prefill_seconds(per_forward, prompt_tokens) if forwards else 0.0


def serving_tokens_per_second(step: StepModel, batch: float, prompt_tokens: float, output_tokens: float) -> float:
    """Output tokens/s of a server that keeps `batch` requests running, their prompts' prefill included."""
    context = prompt_tokens + output_tokens / 2
    return batch / (step.step_seconds(batch, context)
                    + prefill_seconds_per_step(step, batch, prompt_tokens, output_tokens))


def simulator_step(step: StepModel, batch: int, context_tokens: float, prompt_tokens: float) -> tuple[float, float,
                                                                                                          float]:
    """The built-in simulator's linear step for this layout: (ms at an empty batch, ms per running request, prefill
    ms per 1,000 prompt tokens), matching step_seconds at batch 1 and at `batch` (tokenmill sim-server --step-ms,
    --step-ms-per-request, --prefill-ms-per-1k-tokens), so a local run shows the throughput this hardware would."""
    one = step.step_seconds(1, context_tokens)
    full = step.step_seconds(max(batch, 2), context_tokens)
    per_request = (full - one) / (max(batch, 2) - 1)
    chunk = step.chunk_tokens
    prefill = step.prefill_seconds(chunk, prompt_tokens) / chunk * 1000
    return (one - per_request) * 1e3, per_request * 1e3, prefill * 1e3
