"""Reasoning that ends at any of several tokens, chat template arguments, and the model's sampling defaults."""

from __future__ import annotations

import json

from tests.reference.families import FIXTURES
from tokenmill_runner.generate.rows import finish_rows
from tokenmill_runner.generate.sampling_defaults import apply_model_defaults, model_sampling_defaults
from tokenmill_runner.render.tokenizer_info import TokenizerInfo
from tokenmill_runner.report.validation import DatasetSamples, dataset_report
from tokenmill_runner.spec.resource import DatasetGenerationSpec, SamplingSpec


def first_reasoning_end(output: list[int], ends: int | list[int]) -> tuple[int, int] | None:
    """Where a row says reasoning ended, and at which token (`finish_rows`, as the runner fills it)."""
    ids = [ends] if isinstance(ends, int) else ends
    row: dict = {"output_ids": output}
    finish_rows([row], TokenizerInfo(location="x", vocab_size=100, eos_token_ids=[2], eos_tokens={"2": "</s>"},
                                     reasoning_end_token="</think>", reasoning_end_id=ids[0],
                                     reasoning_end_tokens={str(i): f"t{i}" for i in ids}, tool_call_token=None,
                                     tool_call_id=None, model_context_length=None))
    return None if row["reasoning_end"] is None else (row["reasoning_end"], row["reasoning_end_token_id"])


def test_the_first_end_token_in_the_output_ends_reasoning() -> None:
    think, section = 7, 9
    assert first_reasoning_end([1, 2, think, 3, section], [think, section]) == (2, think)
    # Kimi-K2.5 opening a tool call straight from its reasoning, without </think>.
    assert first_reasoning_end([1, 2, section, 3, 4], [think, section]) == (2, section)
    assert first_reasoning_end([1, 2, 3], [think, section]) is None
    assert first_reasoning_end([1, think], think) == (1, think)


def test_report_counts_reasoning_ended_by_any_token_and_splits_by_token() -> None:
    ledger = DatasetSamples("B1_glaive")
    samples = {"sample_id": ["a", "b", "c", "d"], "line": [1, 2, 3, 4], "prompt_tokens": [5] * 4,
               "completion_tokens": [10, 10, 10, 10], "finish_reason": ["stop", "stop", "stop", "length"],
               "matched_stop": [4, 4, 4, None], "reasoning_end": [3, 6, 2, None],
               "reasoning_end_token_id": [7, 9, 9, None], "has_tool_call": [False, True, True, False],
               "max_new_tokens": [10] * 4, "latency_s": [1.0] * 4}
    ledger.add_markers([{"samples": samples, "failed": {"line": [], "reason": [], "sample_id": []}}])
    report = dataset_report(ledger, 4096, True, {"4": "<|im_end|>"},
                            {"7": "</think>", "9": "<|tool_calls_section_begin|>"})
    assert report["reasoning"]["present"] == 3 and report["reasoning"]["present_share"] == 0.75
    assert report["reasoning"]["end_tokens"] == {"<|tool_calls_section_begin|> (9)": 2, "</think> (7)": 1}


def test_markers_without_the_end_token_column_still_load() -> None:
    ledger = DatasetSamples("old")
    samples = {"sample_id": ["a"], "line": [1], "prompt_tokens": [5], "completion_tokens": [3],
               "finish_reason": ["stop"], "matched_stop": [4], "reasoning_end": [1], "has_tool_call": [False],
               "max_new_tokens": [10], "latency_s": [1.0]}
    ledger.add_markers([{"samples": samples, "failed": {"line": [], "reason": [], "sample_id": []}}])
    assert dataset_report(ledger, 4096, True)["reasoning"]["end_tokens"] == {"unrecorded": 1}


def test_chat_template_arguments_merge_per_key_with_the_dataset_winning() -> None:
    spec = DatasetGenerationSpec.model_validate({
        "model": {"path": "m"}, "output": {"uri": "out"},
        "chatTemplateKwargs": {"thinking": True, "reasoning_effort": "low"},
        "datasets": [{"name": "a", "source": "a.jsonl", "chatTemplateKwargs": {"thinking": False}},
                     {"name": "b", "source": "b.jsonl"}],
    })
    assert spec.chat_template_kwargs_for(spec.datasets[0]) == {"thinking": False, "reasoning_effort": "low"}
    assert spec.chat_template_kwargs_for(spec.datasets[1]) == {"thinking": True, "reasoning_effort": "low"}


def test_generation_config_fills_what_the_spec_leaves_unset() -> None:
    """SGLang applies generation_config.json to its chat API only, never to /generate (v0.5.9:
    configs/model_config.py:1052-1082 `get_default_sampling_params` is read by entrypoints/openai/serving_chat.py
    :103-113; /generate merges only --preferred-sampling-params, managers/tokenizer_manager.py:907-908; v0.5.23 the
    same: serving_chat.py:417 and rust_server/config.py:158-165 for chat only, tokenizer_manager.py:1550 for
    /generate), so the runner applies the model's defaults itself and says where each value came from."""
    qwen = json.loads((FIXTURES / "qwen3" / "generation_config.json").read_text())
    defaults = model_sampling_defaults(qwen)  # Qwen3 ships temperature 0.6, top_p 0.95, top_k 20
    assert defaults == {"temperature": "0.6", "top_p": "0.95", "top_k": 20}
    spec = SamplingSpec(max_new_tokens=512, temperature="1.0")
    effective, sources = apply_model_defaults(spec, defaults)
    assert effective.to_sglang() == {"max_new_tokens": 512, "temperature": 1.0, "top_p": 0.95, "top_k": 20}
    assert sources["temperature"] == {"value": 1.0, "source": "spec"}
    assert sources["top_p"] == {"value": 0.95, "source": "generation_config"}
    assert sources["min_p"] == {"value": 0.0, "source": "sglang_default"}
    assert sources["repetition_penalty"] == {"value": 1.0, "source": "sglang_default"}
    assert model_sampling_defaults({"do_sample": True, "eos_token_id": [1, 2]}) == {}
