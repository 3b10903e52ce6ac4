"""The attention backend SGLang runs with, per release, GPU and model, when tokenmill must choose it. Pure.

Left to itself, SGLang picks the backend, and with --enable-deterministic-inference that pick can crash the server or
quietly lose the determinism asked for:
- on sm100-class GPUs (B200, GB200, B300, GB300) the DeepSeek-family model override sets trtllm_mla for
  DeepseekV3ForCausalLM and KimiK25ForConditionalGeneration (0.5.9 server_args.py:1277-1283; 0.5.23
  arg_groups/model_overrides/deepseek_v2.py:177-185) before the deterministic check runs, and that check refuses it
  (ValueError: 0.5.9 server_args.py:2758-2763; 0.5.23 arg_groups/overrides.py:1117-1122), so the pod restarts forever;
- on Blackwell the deterministic fallback is flashinfer for any architecture outside SGLang's DeepSeek list (0.5.23
  arg_groups/overrides.py:1100-1108), Kimi-K2.5 included, although the comment right there says flashinfer is not
  deterministic for DeepSeek (MLA) models; flashinfer also turns the radix cache off (0.5.23
  arg_groups/attention_hook.py:656-665).
An explicit --attention-backend skips both the model override and the fallback (each acts only when none is set), so
with deterministic inference tokenmill always passes one: accepted by the release's deterministic check, keeping
the radix cache, and run by the GPU: fa3 on Hopper, triton elsewhere (SGLang's Triton kernels, on every CUDA and
ROCm GPU). What no backend allows is refused before any GPU is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill_runner.facts.hardware import Gpu
from tokenmill_runner.facts.model_facts import ModelFacts
from tokenmill_runner.spec.resource import ServerSpec

from .plan import PlanError
from .serving import ServingRelease

FLAG = "--attention-backend"
# Hopper runs FlashAttention 3 (SGLang's default there for MHA and MLA alike, 0.5.9 server_args.py:1799-1822).
HOPPER = "sm90"
# What every release's check lets an MLA model run deterministically on: fa3 and triton (0.5.9
# server_args.py:2765-2769); fa4 only from 0.5.17 and only on sm100/sm110 (0.5.23 arg_groups/attention_hook.py:643-654),
# so tokenmill leaves it out.
MLA_DETERMINISTIC = ("fa3", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    """The backend the server runs with (None: SGLang picks by GPU and model), and why."""

    backend: str | None
    reason: str
    warnings: tuple[str, ...] = ()


def given_backend(extra_args: list[str]) -> str | None:
    """The --attention-backend extraArgs set (argparse keeps the last one), in either spelling."""
    value = None
    for index, arg in enumerate(extra_args):
        if arg == FLAG and index + 1 < len(extra_args):
            value = extra_args[index + 1]
        elif arg.startswith(FLAG + "="):
            value = arg.split("=", 1)[1]
    return value


def _default_backend(gpu: Gpu | None) -> tuple[str, str]:
    if gpu is None:
        return "triton", "the GPU product is unknown, and triton runs on every GPU"
    if gpu.arch == HOPPER:
        return "fa3", f"{gpu.label} is Hopper ({gpu.arch}), where FlashAttention 3 is SGLang's own default"
    return "triton", f"{gpu.label} ({gpu.arch}) is not Hopper (fa3's GPU), and triton runs on every GPU"


def attention_backend(server: ServerSpec, gpu: Gpu | None, model: ModelFacts,
                      serving: ServingRelease) -> AttentionBackend:
    """The --attention-backend of this spec: refused when the release's parser or its deterministic check would
    stop the server, or when the result would not be deterministic although the spec asks for it."""
    facts, given = serving.release, given_backend(server.extra_args)
    if given is not None and given not in facts.attention_backends:
        raise PlanError(f"spec.server.extraArgs {FLAG} {given}: {serving.source} does not know it (its argument "
                        f"parser exits and the pod restarts forever); it knows {', '.join(facts.attention_backends)}")
    if not server.deterministic_inference:
        if given is not None:
            return AttentionBackend(given, f"{FLAG} {given} from spec.server.extraArgs")
        return AttentionBackend(None, "SGLang picks the attention backend by GPU and model")
    where = f"spec.server.deterministicInference with {serving.source}"
    if model.sparse_attention:
        raise PlanError(f"{where}: {model.architecture} uses DeepSeek sparse attention (config.json index_topk), "
                        f"which SGLang runs only on its nsa/dsa backends, and its deterministic check accepts none of "
                        f"them ({', '.join(facts.deterministic_attention_backends)}): turn deterministicInference off "
                        f"for this model")
    mla = model.is_mla or model.architecture in facts.deterministic_mla_architectures
    if given is None:
        backend, why = _default_backend(gpu)
        return AttentionBackend(backend, f"{FLAG} {backend} for deterministic inference: {why}; it is in the "
                                f"release's deterministic set and keeps the radix cache (left unset, SGLang would "
                                f"pick trtllm_mla for DeepSeek-family models on sm100-class GPUs, which its "
                                f"deterministic check refuses, or flashinfer on Blackwell, not deterministic for MLA "
                                f"models)")
    if given not in facts.deterministic_attention_backends:
        raise PlanError(f"spec.server.extraArgs {FLAG} {given}: {where} refuses it at start (ValueError, the pod "
                        f"restarts forever); use one of {', '.join(facts.deterministic_attention_backends)}, or drop "
                        f"it and tokenmill passes one")
    if mla and given not in MLA_DETERMINISTIC:
        raise PlanError(f"spec.server.extraArgs {FLAG} {given}: {model.architecture} is an MLA model, and SGLang "
                        f"runs MLA deterministically only on {' or '.join(MLA_DETERMINISTIC)} (its own comment: "
                        f"flashinfer is not deterministic for DeepSeek models); use one of them, or drop it and "
                        f"tokenmill passes one")
    if given not in facts.radix_deterministic_attention_backends:
        return AttentionBackend(given, f"{FLAG} {given} from spec.server.extraArgs",
                                (f"warning: {FLAG} {given} turns SGLang's radix cache off under deterministic "
                                 f"inference (no prefix reuse across samples and turns); "
                                 f"{', '.join(facts.radix_deterministic_attention_backends)} keep it",))
    return AttentionBackend(given, f"{FLAG} {given} from spec.server.extraArgs")
