"""The per-release SGLang facts: each assertion names the release's own file:line (wheel `sglang/srt/...`)."""

from __future__ import annotations

import pytest

from tokenmill_runner.facts.releases import (
    DEFAULT_IMAGE,
    DEFAULT_RELEASE,
    OLDEST_SUPPORTED,
    SUPPORTED_RELEASES,
    UnknownReleaseError,
    release,
    release_of_image,
)
from tokenmill_runner.spec.resource import DatasetGenerationSpec, SamplingSpec


def test_kimi_k25_is_served_from_the_first_supported_release_only():
    # KimiK25ForConditionalGeneration: first registered in 0.5.9 models/kimi_k25.py:776; absent from 0.5.8.post1.
    assert release("0.5.9").serves("KimiK25ForConditionalGeneration")
    assert not release("0.5.8.post1").serves("KimiK25ForConditionalGeneration")
    assert not release("0.5.6").serves("KimiK25ForConditionalGeneration")
    assert release("0.5.6").serves("DeepseekV3ForCausalLM")  # 0.5.6 models/deepseek_v2.py
    assert not release("0.5.23").serves("NoSuchModelForCausalLM")
    assert OLDEST_SUPPORTED == SUPPORTED_RELEASES[0] == "0.5.9"


def test_default_image_is_the_latest_supported_release():
    assert DEFAULT_RELEASE == SUPPORTED_RELEASES[-1]
    assert release_of_image(DEFAULT_IMAGE) == DEFAULT_RELEASE
    assert DatasetGenerationSpec.model_validate(
        {"model": {"path": "m"}, "datasets": [{"name": "d", "source": "s.jsonl"}], "output": {"uri": "o"}}
    ).server.image == DEFAULT_IMAGE


@pytest.mark.parametrize(("version", "dtypes_in", "dtypes_out"), [
    # 0.5.6 server_args.py:2237-2241; 0.5.16 adds mxfp8/nvfp4/fp4_mx_block16; 0.5.21 arg_groups/fields/model.py
    # drops fp4_e2m1.
    ("0.5.6", {"fp8_e4m3", "fp4_e2m1"}, {"mxfp8", "nvfp4", "fp4_mx_block16"}),
    ("0.5.15.post1", {"fp8_e5m2", "fp4_e2m1"}, {"nvfp4"}),
    ("0.5.16", {"mxfp8", "nvfp4", "fp4_mx_block16", "fp4_e2m1"}, set()),
    ("0.5.23", {"mxfp8", "nvfp4", "fp4_mx_block16", "bf16", "auto"}, {"fp4_e2m1"}),
])
def test_kv_cache_dtype_choices_per_release(version, dtypes_in, dtypes_out):
    choices = set(release(version).kv_cache_dtypes)
    assert dtypes_in <= choices and not dtypes_out & choices


def test_context_rule_changes_in_0_5_11():
    # 0.5.6 managers/tokenizer_manager.py:762 refuses prompt + max_new_tokens >= context; 0.5.11 only >.
    assert release("0.5.10.post1").refuses_total(1000, 24, 1024)
    assert not release("0.5.11").refuses_total(1000, 24, 1024)
    assert release("0.5.11").refuses_total(1000, 25, 1024)


def test_response_and_error_facts_per_release():
    assert release("0.5.11").retractions_key == "total_retractions"
    assert release("0.5.12.post1").retractions_key == "num_retractions"  # managers/tokenizer_manager.py
    assert release("0.5.17").eos_at_cap == "length" and release("0.5.18").eos_at_cap == "stop"
    assert release("0.5.21").unknown_sampling_key_status == 500  # TypeError escapes the ValueError handler
    assert release("0.5.22").unknown_sampling_key_status == 400  # entrypoints/http_server.py:921 contract gate
    assert release("0.5.21").dp_attention_flag == "--enable-dp-attention"
    assert release("0.5.22").dp_attention_flag == "--attn-dp-size"  # arg_groups/fields/parallel.py:81
    assert not release("0.5.9").kimi_k2_reasoning_ends_at_tool_section  # 0.5.9 maps kimi_k2 to Qwen3Detector
    assert release("0.5.10.post1").kimi_k2_reasoning_ends_at_tool_section  # KimiK2Detector


def test_images_name_their_release():
    assert release_of_image("lmsysorg/sglang:v0.5.19-cu129") == "0.5.19"
    assert release_of_image("lmsysorg/sglang:v0.5.10.post1") == "0.5.10.post1"
    assert release_of_image("lmsysorg/sglang:v0.5.9-rocm700-mi30x") == "0.5.9"
    assert release_of_image("lmsysorg/sglang:latest") is None
    assert release_of_image("registry.example/sglang@sha256:abcd") is None
    assert release("0.5.19").cuda12_image() == "lmsysorg/sglang:v0.5.19-cu129"
    assert release("0.5.20").cuda12_image() is None  # install docs: v0.5.19-cu129 is the last CUDA 12 tag
    assert release("0.5.23").rocm_image("mi35x") == "lmsysorg/sglang:v0.5.23-rocm700-mi35x"


def test_unread_patches_resolve_to_their_minor_line_and_unknown_versions_fail_clearly():
    assert release("0.5.12").version == "0.5.12.post1"
    with pytest.raises(UnknownReleaseError, match="known: 0.5.6"):
        release("0.4.6")
    with pytest.raises(UnknownReleaseError, match="not an SGLang version"):
        release("latest")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("temperature", "-0.1", "a finite number >= 0"),
    ("temperature", "nan", "a finite number >= 0"),
    ("top_p", "0", "in (0, 1]"),
    ("top_p", "1.01", "in (0, 1]"),
    ("min_p", "-0.1", "in [0, 1]"),
    ("min_p", "1.1", "in [0, 1]"),
    ("top_k", 0, "-1 (the whole vocabulary) or at least 1"),
    ("top_k", -2, "-1 (the whole vocabulary) or at least 1"),
    ("repetition_penalty", "0", "in (0, 2]"),
    ("repetition_penalty", "2.1", "in (0, 2]"),
])
def test_sampling_values_sglang_refuses_are_refused_in_the_spec(field, value, message):
    # The probes of SamplingParams.verify in every supported release (sampling/sampling_params.py:252-290, 0.5.23).
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingSpec.model_validate({field: value})


def test_sampling_values_sglang_accepts_pass():
    spec = SamplingSpec.model_validate({"temperature": "0", "top_p": "1", "min_p": "0", "top_k": -1,
                                        "repetition_penalty": "2"})
    assert spec.to_sglang()["top_k"] == -1


def test_every_supported_release_takes_a_per_request_seed() -> None:
    # SamplingParams.sampling_seed: 0.5.9 sampling/sampling_params.py:66; 0.5.23 sampling/sampling_params.py:179 (and
    # the 0.5.22+ contract gate's list, api/v1/api_types.py). tokenmill sends each sample's seed under this key.
    from tokenmill_runner.facts.server_info import ServerFacts, seeds_accepted

    assert all("sampling_seed" in release(version).sampling_keys for version in SUPPORTED_RELEASES)
    facts = [ServerFacts.read(f"http://s{i}", {"version": version}) for i, version in enumerate(SUPPORTED_RELEASES)]
    assert seeds_accepted(facts) and seeds_accepted([ServerFacts.read("http://x", {})])
