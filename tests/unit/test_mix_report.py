"""The mix report (report/mix.py): each dataset's share of samples and loss tokens, prompts repeated within and across
datasets by normalized content, n-gram overlap with evaluation files, and the export filter that leaves the
overlapping prompts out, of the token exports and of the vocabulary counts alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import orjson
import pytest

from tests.recount import as_counter, recount
from tokenmill_runner.export.exporter import ExportRequest, export
from tokenmill_runner.export.filters import ExportFilters
from tokenmill_runner.report.files import PromptChecks, compute_report
from tokenmill_runner.report.mix import EvalIndex
from tokenmill_runner.store.ledger import ShardContent
from tokenmill_runner.store.shards import commit_shard
from tokenmill_runner.store.storage import LocalStorage

GSM = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
       "clips did Natalia sell altogether in April and May?")
PROMPTS = {
    "d1": ["Write a haiku about autumn leaves.",
           "  write a HAIKU about autumn   leaves. ",  # the same prompt: case and whitespace differ
           "Explain how a hash map handles collisions.",
           "Quick one: what is the capital of France? Answer in one word.",  # holds a short eval prompt whole
           "Summarize the plot of Hamlet in three sentences."],
    "d2": ["Explain how a hash map handles collisions.",  # also in d1
           "List five prime numbers.",
           f"Solve this step by step. {GSM} Show your work.",  # a GSM8K question inside a longer prompt
           "Translate 'good morning' into Spanish."],
}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture
def run(tmp_path: Path) -> tuple[LocalStorage, Path]:
    out = tmp_path / "out"
    storage = LocalStorage(out)
    rng = np.random.default_rng(2)
    datasets = []
    for name, texts in PROMPTS.items():
        source = tmp_path / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"sample_id": f"{name}-{i}", "messages": chat(t)}) + "\n"
                                  for i, t in enumerate(texts, start=1)))
        datasets.append({"name": name, "source": str(source)})
        rows = [{"sample_id": f"{name}-{line}", "dataset": name, "line": line, "sample_index": 0,
                 "prompt_ids": [1, 2], "output_ids": rng.integers(0, 300, size=20 + line).tolist(),
                 "prompt_tokens": 2, "completion_tokens": 20 + line,
                 "finish_reason": "length" if (name, line) == ("d2", 2) else "stop"}
                for line in range(1, len(texts) + 1)]
        commit_shard(storage, name, "w000-aaaa-000001", 0, ShardContent(rows, []))
    storage.put("run.json", orjson.dumps({"name": "mix", "spec": {"datasets": datasets},
                                          "tokenizer": {"vocab_size": 300}}))
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"question": GSM, "answer": "72"}) + "\n"
                     + json.dumps({"turns": ["What is the capital of France?"]}) + "\n"
                     + json.dumps("A prompt no training row has anything in common with at all, surely.") + "\n")
    return storage, evals


def test_the_mix_report_counts_shares_repeated_prompts_and_evaluation_overlap(run):
    storage, evals = run
    computed = compute_report(storage, PromptChecks((str(evals),)))
    mix = computed.report["mix"]
    assert mix["shares"]["d1"]["sample_share"] == 5 / 9
    assert mix["shares"]["d2"]["loss_tokens"] == sum(recount(storage, "d2")[0].values())
    duplicates = mix["duplicates"]
    assert duplicates["datasets"]["d1"] == {"prompts": 5, "distinct": 4, "repeated_within": 1,
                                            "shared_with": {"d2": 1}}
    assert duplicates["datasets"]["d2"]["shared_with"] == {"d1": 1}
    assert duplicates["groups"] == 2 and duplicates["groups_across_datasets"] == 1
    assert [g["lines"] for g in duplicates["first_groups"]] == [
        [{"dataset": "d1", "line": 1}, {"dataset": "d1", "line": 2}],
        [{"dataset": "d1", "line": 3}, {"dataset": "d2", "line": 1}]]
    overlap = mix["eval_overlap"]
    assert {name: d["overlapping"] for name, d in overlap["datasets"].items()} == {"d1": 1, "d2": 1}
    assert overlap["eval_files"][str(evals)] == {"prompts": 3, "overlapped": 2}
    listed = [orjson.loads(line) for line in storage.get("report/eval_overlap.jsonl").splitlines()]
    assert [(m["dataset"], m["line"], m["sample_id"], m["overlaps"][0]["eval_line"]) for m in listed] == [
        ("d1", 4, "d1-4", 2), ("d2", 3, "d2-3", 1)]
    assert listed[0]["overlaps"][0]["ngram"] == "what is the capital of france"
    findings = [f for f in computed.report["findings"] if f["check"] == "eval_overlap"]
    assert [(f["dataset"], f["level"]) for f in findings] == [("d1", "warn"), ("d2", "warn")]
    assert computed.report["verdict"] in ("warn", "fail")


def test_an_n_gram_is_confirmed_word_for_word_and_shorter_runs_do_not_count():
    index = EvalIndex(n=5)
    index.add("e.jsonl", 1, "the quick brown fox jumps over the lazy dog")
    assert [o.ngram for o in index.overlaps("He said: THE quick, brown fox jumps!")] == ["the quick brown fox jumps"]
    assert index.overlaps("the quick brown fox sleeps") == []  # four words in a row are not five


def test_export_leaves_overlapping_prompts_out_of_the_records_and_of_the_vocabulary(run, tmp_path):
    storage, evals = run
    filters = ExportFilters(eval_files=(str(evals),))
    manifest = export(ExportRequest(str(storage.root), str(tmp_path / "sf"), "specforge", filters))
    records = [orjson.loads(line) for part in sorted((tmp_path / "sf" / "prompts").glob("*.jsonl"))
               for line in part.read_bytes().splitlines()]
    assert {(r["dataset"], r["line"]) for r in records} == {("d1", 1), ("d1", 2), ("d1", 3), ("d1", 5), ("d2", 1),
                                                            ("d2", 2), ("d2", 4)}
    assert manifest["counts"]["filtered"] == {"eval_overlap": 2}
    vocab = export(ExportRequest(str(storage.root), str(tmp_path / "vocab"), "vocab", filters,
                                 draft_vocab_sizes=(100,)))
    from tokenmill_runner.store.token_counts import dataset_frequencies

    for name, lines in (("d1", {4}), ("d2", {3})):
        expected, _ = recount(storage, name, left_out_lines=lines)
        kept = dataset_frequencies(storage, name, lambda line, _i, lines=lines: line in lines)
        assert as_counter(kept) == expected
        assert vocab["datasets"][name]["loss_tokens"] == sum(expected.values())
    assert vocab["target_vocab_size"] == 300 and vocab["target_vocab_size_from"].startswith("the tokenizer")
    # A unit filter recounts from the rows the units a token export writes: d2's truncated line 2 is left out too.
    truncated = export(ExportRequest(str(storage.root), str(tmp_path / "vocab2"), "vocab",
                                     ExportFilters(eval_files=(str(evals),), exclude_truncated=True),
                                     draft_vocab_sizes=(100,)))
    expected, _ = recount(storage, "d2", left_out_lines={2, 3})
    assert truncated["datasets"]["d2"]["loss_tokens"] == sum(expected.values())
    assert truncated["datasets"]["d2"]["left_out"] == {"eval_overlap": 1, "truncated": 1}
