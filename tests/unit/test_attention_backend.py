"""The attention backend under deterministic inference: tokenmill passes one that every supported release's
deterministic check accepts, that keeps the radix cache and that the GPU runs, and refuses what no backend allows
(planner/attention.py). The release lists themselves are checked against the wheels in
tests/contract/test_contract_attention.py."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill_operator.decide.manifests import sglang_args
from tokenmill_operator.decide.planner import PlanError, model_facts, plan_server, render_plan
from tokenmill_runner.facts.releases import release

from .test_planner import H200, RTX_PRO, facts, fixture, make_spec

B200, GB300 = "NVIDIA-B200", "NVIDIA-GB300"


def deterministic(gpu: str, version: str = "0.5.23", **server: Any) -> dict[str, Any]:
    return {"gpuProduct": gpu, "image": f"lmsysorg/sglang:v{version}", "deterministicInference": True, **server}


def launched_backend(args: list[str]) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args) if arg == "--attention-backend"]


@pytest.mark.parametrize("version", ["0.5.9", "0.5.16", "0.5.23"])  # the deterministic lists change at 0.5.16
@pytest.mark.parametrize(("gpu", "expected"), [(B200, "triton"), (GB300, "triton"), (RTX_PRO, "triton"),
                                               (H200, "fa3")])
def test_kimi_k25_deterministic_gets_a_backend_the_release_accepts_on_every_gpu(version: str, gpu: str,
                                                                               expected: str) -> None:
    # Unset, SGLang would pick trtllm_mla on B200/GB300 (ValueError at start) or flashinfer on RTX PRO 6000 (not
    # deterministic for MLA, radix cache off): the audit's F1 and F2.
    spec = make_spec(deterministic(gpu, version))
    plan = plan_server(spec, facts("kimi-k2.5"))
    facts_of = release(version)
    assert plan.attention_backend == expected
    assert expected in facts_of.deterministic_attention_backends
    assert expected in facts_of.radix_deterministic_attention_backends
    args = sglang_args("run", spec, plan, "/models/model")
    assert launched_backend(args) == [expected]
    assert args.index("--attention-backend") > args.index("--enable-deterministic-inference")
    assert any(line.startswith(f"--attention-backend {expected} for deterministic inference") for line in plan.reasoning)


def test_without_deterministic_inference_sglang_keeps_its_own_choice() -> None:
    spec = make_spec({"gpuProduct": B200})
    plan = plan_server(spec, facts("kimi-k2.5"))
    assert plan.attention_backend is None
    assert launched_backend(sglang_args("run", spec, plan, "/m")) == []
    assert "attention backend     SGLang's choice" in render_plan(plan)


def test_the_plan_shows_the_backend() -> None:
    plan = plan_server(make_spec(deterministic(RTX_PRO)), facts("kimi-k2.5"))
    assert "attention backend     triton" in render_plan(plan)


def test_an_unknown_gpu_gets_triton_which_runs_everywhere() -> None:
    plan = plan_server(make_spec({"gpuMemoryMib": 143771, "deterministicInference": True}), facts("kimi-k2.5"))
    assert plan.attention_backend == "triton"
    assert any("the GPU product is unknown" in line for line in plan.reasoning)


@pytest.mark.parametrize(("backend", "says"), [
    ("trtllm_mla", "refuses it at start"),  # not in the deterministic set: SGLang's ValueError
    ("flashinfer", "flashinfer is not deterministic for DeepSeek models"),  # accepted by SGLang for K2.5, but its own comment says so
    ("no_such_backend", "does not know it"),  # the argument parser exits
])
def test_an_extra_args_backend_no_deterministic_run_allows_is_refused(backend: str, says: str) -> None:
    spec = make_spec(deterministic(B200, extraArgs=["--attention-backend", backend]))
    with pytest.raises(PlanError, match=says) as error:
        plan_server(spec, facts("kimi-k2.5"))
    assert "spec.server.extraArgs" in str(error.value)


def test_an_unknown_backend_is_refused_even_without_deterministic_inference() -> None:
    with pytest.raises(PlanError, match="0.5.9 .* does not know it"):
        # qsa exists from 0.5.20 only
        plan_server(make_spec({"gpuProduct": H200, "image": "lmsysorg/sglang:v0.5.9",
                               "extraArgs": ["--attention-backend=qsa"]}), facts("kimi-k2.5"))


def test_an_extra_args_backend_that_works_is_used_once() -> None:
    spec = make_spec(deterministic(H200, extraArgs=["--attention-backend", "triton"]))
    plan = plan_server(spec, facts("kimi-k2.5"))
    assert plan.attention_backend == "triton"
    assert launched_backend(sglang_args("run", spec, plan, "/m")) == ["triton"]  # extraArgs' own, not doubled


def test_flashinfer_on_an_mha_model_runs_but_the_plan_says_the_radix_cache_is_off() -> None:
    spec = make_spec(deterministic(RTX_PRO, extraArgs=["--attention-backend", "flashinfer"]))
    plan = plan_server(spec, facts("qwen3-30b-a3b"))
    assert plan.attention_backend == "flashinfer"
    assert any(line.startswith("warning:") and "radix cache off" in line for line in plan.reasoning)


def test_deepseek_sparse_attention_cannot_be_deterministic() -> None:
    data = fixture("deepseek-v3")
    config = {**data["config"], "architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048}
    model = model_facts(config, data["weight_bytes"])
    assert model.sparse_attention
    with pytest.raises(PlanError, match="DeepSeek sparse attention .* turn deterministicInference off"):
        plan_server(make_spec(deterministic(B200)), model)
    assert plan_server(make_spec({"gpuProduct": B200}), model).attention_backend is None
