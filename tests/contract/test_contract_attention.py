"""Deterministic inference against every supported release's own code (its wheel, sglang_wheels.py): the backend
lists tokenmill keeps are the release's, the backend tokenmill passes goes through the release's deterministic check
on each GPU class untouched and keeps the radix cache, and whatever that check refuses, tokenmill refuses first.

The same check also shows why the flag is needed: left to SGLang, Kimi-K2.5 gets trtllm_mla on sm100 (its model
override; the check then raises) and flashinfer on sm120 (radix cache off, and not deterministic for MLA per SGLang's
own comment) -- the audit's F1 and F2, reproduced by the release's code rather than by reading it.
"""

from __future__ import annotations

import pytest

from tokenmill_operator.decide.planner import PlanError, model_facts
from tokenmill_operator.decide.planner.attention import MLA_DETERMINISTIC, attention_backend
from tokenmill_operator.decide.planner.serving import gpu_product, serving_release
from tokenmill_runner.facts.model_facts import ModelFacts
from tokenmill_runner.facts.releases import SUPPORTED_RELEASES, release
from tokenmill_runner.spec.resource import ServerSpec

from ..unit.test_planner import fixture
from .release_code import Gpu, check_node, run_deterministic_check
from .sglang_wheels import list_holding, module_lists

KIMI = "KimiK25ForConditionalGeneration"
# GPU products by what SGLang's probes read: the compute capability major (sm103 is 10 like sm100), or ROCm.
GPUS = {"NVIDIA-H200": Gpu(9), "NVIDIA-B200": Gpu(10), "NVIDIA-GB300": Gpu(10),
        "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition": Gpu(12), "NVIDIA-A100-SXM4-80GB": Gpu(8),
        "AMD_Instinct_MI300X_OAM": Gpu(9, hip=True)}
MODELS = ("kimi-k2.5", "deepseek-v3", "qwen3-30b-a3b")


def model(name: str) -> ModelFacts:
    data = fixture(name)
    return model_facts(data["config"], data["weight_bytes"])


def server(version: str, gpu: str | None, extra_args: list[str] | None = None) -> ServerSpec:
    return ServerSpec.model_validate({"image": f"lmsysorg/sglang:v{version}", "gpuProduct": gpu,
                                      "deterministicInference": True, "extraArgs": extra_args or []})


def tokenmill_backend(version: str, gpu: str | None, facts: ModelFacts,
                      extra_args: list[str] | None = None) -> str | None:
    spec = server(version, gpu, extra_args)
    return attention_backend(spec, gpu_product(spec), facts, serving_release(spec)).backend


@pytest.mark.parametrize("version", SUPPORTED_RELEASES)
def test_the_backend_lists_are_the_releases_own(version: str) -> None:
    lists, facts = module_lists(version), release(version)
    assert set(facts.attention_backends) == set(lists["ATTENTION_BACKEND_CHOICES"])
    assert set(facts.deterministic_attention_backends) == set(lists["DETERMINISTIC_ATTENTION_BACKEND_CHOICES"])
    assert set(facts.radix_deterministic_attention_backends) == set(
        lists["RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND"])
    assert set(facts.deterministic_mla_architectures) == set(list_holding(check_node(version),
                                                                         "DeepseekV3ForCausalLM"))


@pytest.mark.parametrize("version", SUPPORTED_RELEASES)
def test_tokenmills_backend_passes_the_release_check_untouched_on_every_gpu(version: str) -> None:
    for name in MODELS:
        facts = model(name)
        for gpu, capability in GPUS.items():
            backend = tokenmill_backend(version, gpu, facts)
            after = run_deterministic_check(version, capability, facts.architecture or "", backend)
            assert (after.attention_backend, after.disable_radix_cache) == (backend, False), (name, gpu)
            assert after.sampling_backend == "pytorch"  # the check really ran: it forces the pytorch sampler


@pytest.mark.parametrize("version", SUPPORTED_RELEASES)
def test_left_to_sglang_kimi_k25_crashes_on_sm100_and_loses_the_radix_cache_on_sm120(version: str) -> None:
    # What SGLang's DeepSeek-family model override sets on sm100 before the check (0.5.9 server_args.py:1277-1283).
    with pytest.raises(ValueError, match="trtllm_mla"):
        run_deterministic_check(version, Gpu(10), KIMI, "trtllm_mla")
    fallback = run_deterministic_check(version, Gpu(12), KIMI, None)
    assert (fallback.attention_backend, fallback.disable_radix_cache) == ("flashinfer", True)


@pytest.mark.parametrize("version", SUPPORTED_RELEASES)
def test_every_backend_the_release_check_refuses_tokenmill_refuses_first(version: str) -> None:
    """Every --attention-backend the release parses, given in extraArgs, for an MHA model and for an MLA model the
    check knows: SGLang raising means tokenmill refused; tokenmill refusing more is only its MLA rule."""
    for name, arch in (("qwen3-30b-a3b", None), ("deepseek-v3", "DeepseekV3ForCausalLM")):
        facts = model(name)
        for backend in release(version).attention_backends:
            for gpu, capability in GPUS.items():
                try:
                    run_deterministic_check(version, capability, arch or facts.architecture or "", backend)
                    sglang_refuses = False
                except ValueError:
                    sglang_refuses = True
                try:
                    tokenmill_backend(version, gpu, facts, ["--attention-backend", backend])
                    tokenmill_refuses = False
                except PlanError:
                    tokenmill_refuses = True
                if sglang_refuses:
                    assert tokenmill_refuses, (name, backend, gpu)
                elif tokenmill_refuses:
                    assert facts.is_mla and backend not in MLA_DETERMINISTIC, (name, backend, gpu)
