"""The report is one streaming pass: its figures equal the list-based definitions, a slot counts once, the commit
order survives old marker names, and what it holds does not grow with the number of samples."""

from __future__ import annotations

import math
import random
import tracemalloc
from datetime import UTC, datetime, timedelta

import numpy as np
import orjson
import pytest

from tokenmill_runner.report.files import load_ledger
from tokenmill_runner.report.stream import DatasetSamples
from tokenmill_runner.report.validation import build_report, dataset_report
from tokenmill_runner.stats import histograms
from tokenmill_runner.stats.distributions import distribution, mann_whitney
from tokenmill_runner.store.ledger import ShardContent, build_marker
from tokenmill_runner.store.markers import markers_in_commit_order
from tokenmill_runner.store.shards import commit_shard
from tokenmill_runner.store.storage import LocalStorage

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def sample(line: int, rng: random.Random) -> dict:
    length = min(int(rng.lognormvariate(math.log(470), 1.4)) + 1, 4096)
    end = length // 3 if line % 4 else None
    finish = "length" if length >= 4096 else "stop"
    return {"sample_id": f"s{line}", "line": line, "sample_index": 0, "prompt_tokens": 20 + line % 300,
            "completion_tokens": length, "finish_reason": finish, "matched_stop": 9 if finish == "stop" else None,
            "reasoning_end": end, "reasoning_end_token_id": None if end is None else 50,
            "has_tool_call": line % 5 == 0, "max_new_tokens": 4096, "latency_s": rng.lognormvariate(0.5, 1.0)}


def markers(lines: range, per: int = 256, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    built = []
    for n, start in enumerate(range(lines.start, lines.stop, per)):
        rows = [sample(line, rng) for line in range(start, min(start + per, lines.stop))]
        built.append(build_marker("d", f"w000-t-{n:06d}", 0, ShardContent(rows, []), 0))
    return built


def columns(built: list[dict], name: str) -> list:
    return [value for marker in built for value in marker["samples"][name]]


def test_every_figure_equals_the_definition_on_the_list_of_values():
    built = markers(range(1, 5001))
    samples = DatasetSamples("d", lines=5000)
    samples.add_markers(built)
    report = dataset_report(samples, 8192, True)
    for key, name in (("completion_tokens", "completion_tokens"), ("prompt_tokens", "prompt_tokens"),
                      ("latency_s", "latency_s")):
        assert report[key] == pytest.approx(distribution(columns(built, name)).as_dict(), rel=1e-12), key
    completions = columns(built, "completion_tokens")
    z, p = mann_whitney(completions[:100], completions[100:])
    assert report["order_drift"]["z"] == pytest.approx(z) and report["order_drift"]["p_value"] == pytest.approx(p)
    assert report["order_drift"]["first_median"] == float(np.median(completions[:100]))
    ends = [(e, c, f) for e, c, f in zip(columns(built, "reasoning_end"), completions, columns(built, "finish_reason"),
                                         strict=True) if e is not None]
    assert report["reasoning"]["answer_tokens"] == pytest.approx(
        distribution([c - e - 1 - (f == "stop") for e, c, f in ends]).as_dict(), rel=1e-12)
    budgets = [p + 4096 for p in columns(built, "prompt_tokens")]
    assert report["context_budget"]["share_over_90pct_of_context"] == sum(b > 0.9 * 8192 for b in budgets) / 5000


def test_a_slot_named_by_two_markers_counts_once_in_the_report():
    built = markers(range(1, 301))
    again = markers(range(1, 51), seed=2)  # a restarted worker committed lines 1-50 again
    samples = DatasetSamples("d", lines=300)
    samples.add_markers([*built, *again])
    report = dataset_report(samples, 8192, True)
    assert report["samples"] == 300 and report["without_outcome"] == 0
    assert report["completion_tokens_total"] == sum(columns(built, "completion_tokens")), "the first row counts"


def test_latency_is_exact_below_the_limit_and_within_the_bound_above(monkeypatch):
    built = markers(range(1, 3001))
    monkeypatch.setattr(histograms, "EXACT_LIMIT", 1000)
    samples = DatasetSamples("d", lines=3000)
    samples.add_markers(built)
    assert not samples.latency.exact
    got = dataset_report(samples, 8192, True)["latency_s"]
    want = distribution(columns(built, "latency_s")).as_dict()
    assert got["count"] == want["count"] and got["max"] == want["max"]
    for key in ("p10", "p25", "median", "p75", "p90", "p95", "p99"):
        assert got[key] == pytest.approx(want[key], rel=histograms.RELATIVE_ERROR), key


def test_old_marker_names_keep_their_commit_order_before_time_named_ones(tmp_path):
    storage = LocalStorage(tmp_path)
    rows = [{"sample_id": f"s{n}", "dataset": "d", "line": n, "sample_index": 0, "prompt_ids": [1], "output_ids": [2],
             "prompt_tokens": 1, "completion_tokens": n, "finish_reason": "stop"} for n in range(1, 5)]
    # Two markers in the old layout (commits/<shard id>.json), committed in the opposite order of their names.
    for shard, row, at in (("w000-b-000001", rows[0], T0), ("w000-a-000001", rows[1], T0 + timedelta(seconds=1))):
        marker = build_marker("d", shard, 0, ShardContent([row], []), 0, committed_at=at)
        storage.put(f"d/commits/{shard}.json", orjson.dumps(marker))
    commit_shard(storage, "d", "w001-c-000001", 1, ShardContent([rows[3]], []), clock=lambda: T0 + timedelta(hours=1))
    commit_shard(storage, "d", "w000-c-000001", 0, ShardContent([rows[2]], []), clock=lambda: T0 + timedelta(hours=2))
    assert [m["samples"]["line"][0] for m in markers_in_commit_order(storage, "d")] == [1, 2, 4, 3]


def test_what_the_report_holds_does_not_grow_with_the_samples(monkeypatch):
    monkeypatch.setattr(histograms, "EXACT_LIMIT", 1000)
    held = {}
    for size in (20_000, 200_000):
        built = markers(range(1, size + 1), per=1024)
        tracemalloc.start()
        try:
            samples = DatasetSamples("d", lines=size)
            for marker in built:
                samples.add_marker(marker)
            held[size], _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del built
    # A bit per slot in the ledger (22.5 kB more) and a few growing counters; no per-sample list.
    assert held[200_000] - held[20_000] < 64 * 1024, held


def test_the_report_of_a_run_reads_every_marker_once(tmp_path):
    storage = LocalStorage(tmp_path)
    for n, marker in enumerate(markers(range(1, 1001))):
        rows = [{**{k: marker["samples"][k][i] for k in marker["samples"]}, "dataset": "d", "prompt_ids": [1],
                 "output_ids": [2]} for i in range(len(marker["samples"]["line"]))]
        commit_shard(storage, "d", f"w000-t-{n:06d}", 0, ShardContent(rows, []),
                     clock=lambda n=n: T0 + timedelta(minutes=n))
    storage.put("run.json", orjson.dumps({"spec": {"datasets": [{"name": "d"}]}, "datasets": {"d": {"rows": 1000}},
                                          "context_length": 8192}))
    report = build_report(load_ledger(storage))
    assert report["datasets"]["d"]["samples"] == 1000 and report["overall"]["samples"] == 1000
    assert report["overall"]["completion_tokens"] == report["datasets"]["d"]["completion_tokens"]
    assert report["overall"]["order_drift"] is None


def test_the_scatter_keeps_every_point_up_to_its_limit_then_the_same_sample_in_any_order():
    from tokenmill_runner.report.stream import ReasoningPoints

    slots = np.arange(1, 5001, dtype=np.int64)
    small = ReasoningPoints(limit=10_000)
    small.add(slots, slots, 2 * slots)
    assert not small.sampled and sorted(small.reasoning.tolist()) == slots.tolist()
    forward, backward = ReasoningPoints(limit=300), ReasoningPoints(limit=300)
    for part in np.array_split(slots, 17):
        forward.add(part, part, 2 * part)
    for part in np.array_split(slots[::-1], 5):
        backward.add(part, part, 2 * part)
    assert forward.sampled and forward.seen == 5000 and len(forward.reasoning) == 300
    assert sorted(forward.reasoning.tolist()) == sorted(backward.reasoning.tolist())
    assert (forward.answer == 2 * forward.reasoning).all(), "pairs stay together"


def test_conversations_count_their_turns_as_generations_and_their_stop_reasons():
    # Two conversations (3 turns ending truncated while reasoning; 2 turns complete) and one single-turn sample.
    cut = {"sample_id": "c1", "line": 1, "sample_index": 0, "prompt_tokens": 900, "completion_tokens": 700,
           "finish_reason": "length", "matched_stop": None, "reasoning_end": None, "reasoning_end_token_id": None,
           "has_tool_call": True, "max_new_tokens": 500, "latency_s": 1.0, "turn_count": 3,
           "stop_reason": "truncated", "last_turn_tokens": 500, "reasoning_turns": 2}
    whole = {**cut, "sample_id": "c2", "line": 2, "completion_tokens": 300, "finish_reason": "stop",
             "matched_stop": 9, "reasoning_end": 40, "reasoning_end_token_id": 50, "turn_count": 2,
             "stop_reason": "complete", "last_turn_tokens": 120, "reasoning_turns": 2}
    single = {**sample(3, random.Random(0)), "completion_tokens": 100, "finish_reason": "stop", "reasoning_end": 30}
    marker = build_marker("d", "w000-t-000001", 0, ShardContent([cut, whole, single], []), 0)
    ledger = DatasetSamples("d", lines=3)
    ledger.add_marker(marker)
    report = dataset_report(ledger, 32768, True)
    assert report["conversations"]["count"] == 2 and report["conversations"]["turns_total"] == 5
    assert report["conversations"]["stop_reasons"] == {"complete": 1, "truncated": 1}
    assert report["completion_tokens_total"] == 700 + 300 + 100  # conversations count every turn's tokens
    assert report["truncated"]["share"] == pytest.approx(1 / 6)  # 6 generations, the last turn of c1 cut
    assert report["truncated"]["at_cap"] == 1  # c1's last turn hit its cap of 500 (its total 700 is not a turn)
    assert report["reasoning"]["present"] == 5 and report["reasoning"]["present_share"] == pytest.approx(5 / 6)
    assert report["reasoning"]["answer_tokens"]["max"] == 120 - 40 - 1 - 1  # the last turn's answer, stop excluded
    single_only = DatasetSamples("d", lines=1)
    single_only.add_marker(build_marker("d", "w000-t-000002", 0, ShardContent([single], []), 0))
    assert dataset_report(single_only, 32768, True)["conversations"] is None
    assert "turn_count" not in build_marker("d", "x", 0, ShardContent([single], []), 0)["samples"]


def test_the_prefix_cache_share_and_reasoning_disagreements_per_dataset():
    """cached_tokens of prompt tokens sent (a conversation's over all its turns); markers from before these columns
    are left out of the share, not counted as misses."""
    rng = random.Random(3)
    hit = {**sample(1, rng), "prompt_tokens": 100, "cached_tokens": 99, "sent_prompt_tokens": 100,
           "reasoning_disagreements": 0}
    miss = {**sample(2, rng), "prompt_tokens": 100, "cached_tokens": 0, "sent_prompt_tokens": 100,
            "reasoning_disagreements": 1}
    talk = {**sample(3, rng), "prompt_tokens": 300, "cached_tokens": 250, "sent_prompt_tokens": 600,
            "reasoning_disagreements": 2}
    old = sample(4, rng)  # a marker written before cached_tokens was recorded
    ledger = DatasetSamples("d", lines=4)
    ledger.add_marker(build_marker("d", "w000-t-000001", 0, ShardContent([hit, miss, talk], []), 0))
    ledger.add_marker(build_marker("d", "w000-t-000002", 0, ShardContent([old], []), 0))
    report = dataset_report(ledger, 32768, True)
    assert report["prefix_cache"] == {"cached_tokens": 349, "prompt_tokens_sent": 800,
                                      "share": pytest.approx(349 / 800), "samples": 3}
    assert report["reasoning_tokens_disagree"] == 3
    before = DatasetSamples("d", lines=1)
    before.add_marker(build_marker("d", "w000-t-000003", 0, ShardContent([old], []), 0))
    assert dataset_report(before, 32768, True)["prefix_cache"]["share"] is None


def test_disagreeing_reasoning_counts_warn_and_an_input_mismatch_fails(tmp_path):
    from tokenmill_runner.report.markdown import render
    from tokenmill_runner.report.validation import Thresholds, dataset_findings

    rng = random.Random(4)
    rows = [{**sample(line, rng), "cached_tokens": 10, "sent_prompt_tokens": 40, "reasoning_disagreements": line % 2}
            for line in range(1, 5)]
    ledger = DatasetSamples("d", lines=5)
    ledger.add_marker(build_marker("d", "w000-t-000001", 0, ShardContent(rows, [
        {"line": 5, "sample_index": 0, "sample_id": "s5", "reason": "input_mismatch"}]), 0))
    report = dataset_report(ledger, 32768, True)
    findings = {f["check"]: f for f in dataset_findings("d", report, Thresholds(), "</think>")}
    assert findings["reasoning_tokens"]["level"] == "warn" and findings["reasoning_tokens"]["value"] == 2
    assert findings["input_ids"]["level"] == "fail" and findings["input_ids"]["value"] == 1
    page = render({"name": "x", "output_uri": "o", "verdict": "fail", "context_length": 32768, "generated_at": "t",
                   "findings": list(findings.values()), "tokenizer": {}, "datasets": {"d": report}, "overall": report},
                  [])
    assert "| d | 25.0% | 40 | 160 | 2 |" in page
