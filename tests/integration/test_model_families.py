"""`tokenmill run` on each model family's tokenizer fixture, against the built-in simulator (which loads the same
folder the way SGLang would): the committed prompt_ids equal the family's own reference ids for every prompt, tools
and multi-turn tool calls included, and prompts the family's template rejects are recorded as template errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.reference.families import FIXTURES, PROMPTS, VARIANTS, Variant
from tokenmill_runner.cli import main
from tokenmill_runner.report.files import load_ledger
from tokenmill_runner.report.validation import build_report
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import open_storage

from .workloads import write_spec

REPO = Path(__file__).resolve().parents[2]


def family_spec(variant: Variant, source: Path, out: Path, name: str = "prompts") -> dict[str, Any]:
    model: dict[str, Any] = {"path": str(variant.path), "trustRemoteCode": variant.trust_remote_code,
                             "reasoning": {"endToken": variant.end_token}}
    dataset: dict[str, Any] = {"name": name, "source": str(source), "sampling": {"maxNewTokens": 256}}
    if variant.kwargs:
        dataset["chatTemplateKwargs"] = variant.kwargs
    return {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": variant.family},
            "spec": {"model": model, "datasets": [dataset], "output": {"uri": str(out)},
                     "runner": {"concurrency": 16, "shardMaxSamples": 8, "shardMaxSeconds": 2}}}


def run(tmp_path: Path, document: dict[str, Any]) -> Any:
    spec = write_spec(tmp_path / "spec.yaml", document)
    out = document["spec"]["output"]["uri"]
    assert main(["-q", "run", str(spec), "--out", out, "--sim-time-scale", "2000"]) == 0
    return open_storage(out)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_run_commits_the_family_reference_prompt_ids(variant: Variant, reference: dict, tmp_path: Path) -> None:
    storage = run(tmp_path, family_spec(variant, PROMPTS, tmp_path / "out"))
    expected = reference["fixtures"][variant.name]["results"]
    rows = {row["sample_id"]: row for row in read_committed_rows(storage, "prompts")}
    errors = {sid: reason for marker in read_markers(storage, "prompts")
              for sid, reason in zip(marker["failed"]["sample_id"], marker["failed"]["reason"], strict=True)}
    assert set(rows) == {sid for sid, want in expected.items() if "ids" in want}
    assert errors == {sid: "template_error" for sid, want in expected.items() if "error" in want}
    for sample_id, row in rows.items():
        assert row["prompt_ids"] == expected[sample_id]["ids"], sample_id
    run_json = orjson.loads(storage.get("run.json"))
    dataset = run_json["datasets"]["prompts"]
    assert dataset["chat_template_kwargs"] == variant.kwargs
    assert dataset["sampling"]["max_new_tokens"] == {"value": 256, "source": "spec"}


def test_kimi_function_calling_counts_reasoning_that_ends_at_the_tool_call_section(tmp_path: Path) -> None:
    kimi = next(v for v in VARIANTS if v.name == "kimi-k2.5")
    source = REPO / "examples" / "prompts" / "function_calling.jsonl"
    document = family_spec(kimi, source, tmp_path / "out", name="B1_glaive")
    document["spec"]["datasets"][0]["sampling"]["maxNewTokens"] = 10240
    storage = run(tmp_path, document)
    report = build_report(load_ledger(storage))
    reasoning = report["datasets"]["B1_glaive"]["reasoning"]
    ends = reasoning["end_tokens"]
    section = next(name for name in ends if name.startswith("<|tool_calls_section_begin|>"))
    think = next(name for name in ends if name.startswith("</think>"))
    assert ends[section] > 0 and ends[think] > 0
    # Samples that left reasoning at the tool-call section count as reasoning present: no reasoning finding.
    assert reasoning["present"] + reasoning["truncated_while_reasoning"] == report["datasets"]["B1_glaive"]["samples"]
    assert not [f for f in report["findings"] if f["check"] == "reasoning"]
    run_json = orjson.loads(storage.get("run.json"))
    assert sorted(run_json["tokenizer"]["reasoning_end_tokens"].values()) == [
        "</think>", "<|tool_calls_section_begin|>"]
    assert (FIXTURES / "kimi-k2.5" / "tiktoken.model").is_file() and not (FIXTURES / "kimi-k2.5" / "tokenizer.json").exists()
