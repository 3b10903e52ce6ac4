"""The report's statistics, checked against values computed here, independently, from the shards' rows."""

from __future__ import annotations

import math
import random
import struct

import orjson
import pytest

from tokenmill_runner.report.files import load_ledger, write_report
from tokenmill_runner.report.validation import build_report
from tokenmill_runner.stats.distributions import mann_whitney
from tokenmill_runner.store.ledger import ShardContent
from tokenmill_runner.store.shards import commit_shard, read_committed_rows
from tokenmill_runner.store.storage import LocalStorage

END, TOOL, EOS = 50, 60, 9


def run_json(datasets, end_id=END, validation=None) -> dict:
    return {"name": "crafted", "context_length": 8192,
            "spec": {"datasets": [{"name": d} for d in datasets], "validation": validation or {}},
            "tokenizer": {"reasoning_end_token": "</think>", "reasoning_end_id": end_id, "tool_call_id": TOOL,
                          "eos_token_ids": [EOS], "eos_tokens": {str(EOS): "<|im_end|>"}}}


def make_row(dataset: str, i: int, length: int, cap: int, reasoning: int | None, tool: bool = False) -> dict:
    finish = "length" if length >= cap else "stop"
    length = min(length, cap)
    output = [7] * length
    if reasoning is not None and reasoning < length - 1:
        output[reasoning] = END
    else:
        reasoning = None
    if tool and reasoning is not None and reasoning + 2 < length - 1:
        output[reasoning + 2] = TOOL
    if finish == "stop":
        output[-1] = EOS
    return {"sample_id": f"{dataset}-{i}", "dataset": dataset, "line": i + 1, "prompt_ids": [1] * (10 + i % 50),
            "output_ids": output, "prompt_tokens": 10 + i % 50, "completion_tokens": length, "finish_reason": finish,
            "matched_stop": EOS if finish == "stop" else None, "reasoning_end": reasoning,
            "has_tool_call": TOOL in output, "max_new_tokens": cap, "latency_s": 0.1 * (i % 7), "attempts": 1}


def commit_rows(storage, dataset, rows, per_shard=37, errors=()):
    for n, start in enumerate(range(0, len(rows), per_shard)):
        commit_shard(storage, dataset, f"w000-t-{n:06d}", 0, ShardContent(rows[start:start + per_shard], []))
    if errors:
        commit_shard(storage, dataset, "w000-t-err", 0, ShardContent([], list(errors)))


def percentile(values, q):
    data = sorted(values)
    position = (len(data) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return data[low] + (data[high] - data[low]) * (position - low)


@pytest.fixture
def crafted(tmp_path):
    storage = LocalStorage(tmp_path)
    rng = random.Random(7)
    lengths = [int(rng.lognormvariate(math.log(470), 1.6)) + 1 for _ in range(400)]
    rows = [make_row("glaive", i, n, 2048, reasoning=(None if i % 10 == 0 else n // 2), tool=i % 3 == 0)
            for i, n in enumerate(lengths)]
    commit_rows(storage, "glaive", rows, errors=[
        {"dataset": "glaive", "line": 999, "sample_id": None, "reason": "invalid_json", "message": "line 999"},
        {"dataset": "glaive", "line": 1000, "sample_id": "x", "reason": "prompt_too_long", "message": "line 1000"}])
    storage.put("run.json", orjson.dumps(run_json(["glaive"])))
    return storage


def test_distribution_and_shares_match_the_rows(crafted):
    report = build_report(load_ledger(crafted))
    rows = list(read_committed_rows(crafted, "glaive"))
    completions = [r["completion_tokens"] for r in rows]
    got = report["datasets"]["glaive"]
    dist = got["completion_tokens"]
    assert dist["count"] == len(rows) == 400
    assert dist["mean"] == pytest.approx(sum(completions) / len(completions))
    for q in (10, 25, 75, 90, 95, 99):
        assert dist[f"p{q}"] == pytest.approx(percentile(completions, q)), q
    assert dist["median"] == pytest.approx(percentile(completions, 50))
    assert dist["max"] == max(completions) == 2048
    mean = sum(completions) / len(completions)
    assert dist["stdev"] == pytest.approx(math.sqrt(sum((c - mean) ** 2 for c in completions) / (len(completions) - 1)))
    shares = got["length_shares"]
    assert shares["under_100"] == pytest.approx(sum(c < 100 for c in completions) / 400)
    assert shares["under_500"] == pytest.approx(sum(c < 500 for c in completions) / 400)
    assert shares["over_1000"] == pytest.approx(sum(c > 1000 for c in completions) / 400)
    assert shares["over_5000"] == 0.0
    truncated = [r for r in rows if r["finish_reason"] == "length"]
    assert got["truncated"]["count"] == len(truncated) > 0
    assert got["truncated"]["at_cap"] == sum(r["completion_tokens"] >= r["max_new_tokens"] for r in rows)
    assert got["truncated"]["caps"] == [2048]
    assert got["finish_reasons"] == {"stop": 400 - len(truncated), "length": len(truncated)}
    assert got["stop_tokens"] == {f"<|im_end|> ({EOS})": 400 - len(truncated)}
    assert got["errors_by_reason"] == {"invalid_json": 1, "prompt_too_long": 1}
    assert got["error_share"] == pytest.approx(2 / 402)
    assert got["tool_calls"]["share"] == pytest.approx(sum(r["has_tool_call"] for r in rows) / 400)
    prompt = got["prompt_tokens"]
    assert prompt["max"] == max(r["prompt_tokens"] for r in rows)
    assert got["context_budget"]["max_prompt_plus_cap"] == max(r["prompt_tokens"] for r in rows) + 2048


def test_reasoning_present_absent_truncated(crafted):
    got = build_report(load_ledger(crafted))["datasets"]["glaive"]["reasoning"]
    rows = list(read_committed_rows(crafted, "glaive"))
    with_end = [r for r in rows if END in r["output_ids"]]
    assert got["present"] == len(with_end)
    assert got["present_share"] == pytest.approx(len(with_end) / 400)
    reasoning = [r["output_ids"].index(END) for r in with_end]
    answers = [len(r["output_ids"]) - r["output_ids"].index(END) - 1 - (r["output_ids"][-1] == EOS) for r in with_end]
    assert got["reasoning_tokens"]["median"] == pytest.approx(percentile(reasoning, 50))
    assert got["answer_tokens"]["p90"] == pytest.approx(percentile(answers, 90))
    truncated_reasoning = [r for r in rows if END not in r["output_ids"] and r["finish_reason"] == "length"]
    assert got["truncated_while_reasoning"] == len(truncated_reasoning)


def test_order_drift_detected_when_injected(tmp_path):
    storage = LocalStorage(tmp_path)
    rng = random.Random(1)
    first = [int(rng.lognormvariate(math.log(250), 0.8)) + 1 for _ in range(100)]
    rest = [int(rng.lognormvariate(math.log(900), 0.8)) + 1 for _ in range(388)]
    rows = [make_row("b", i, n, 100000, reasoning=n // 2) for i, n in enumerate(first + rest)]
    commit_rows(storage, "b", rows)
    storage.put("run.json", orjson.dumps(run_json(["b"])))
    report = build_report(load_ledger(storage))
    drift = report["datasets"]["b"]["order_drift"]
    assert drift["significant"] and drift["first_n"] == 100 and drift["rest_n"] == 388
    assert drift["first_mean"] == pytest.approx(sum(first) / 100)
    assert drift["rest_mean"] == pytest.approx(sum(rest) / 388)
    [finding] = [f for f in report["findings"] if f["check"] == "order_drift"]
    assert "first 100 committed samples average" in finding["message"] and finding["level"] == "warn"


def test_no_drift_reported_when_order_is_random(crafted):
    report = build_report(load_ledger(crafted))
    assert report["datasets"]["glaive"]["order_drift"]["significant"] is False
    assert not [f for f in report["findings"] if f["check"] == "order_drift"]


def test_mann_whitney_against_a_hand_computed_case():
    # U for [1, 2, 3] vs [4, 5, 6, 7]: every first value is below every second, U1 = 0.
    z, p = mann_whitney([1, 2, 3], [4, 5, 6, 7])
    expected_z = (0 - 3 * 4 / 2) / math.sqrt(3 * 4 * (3 + 4 + 1) / 12)
    assert z == pytest.approx(expected_z)
    assert p == pytest.approx(math.erfc(abs(expected_z) / math.sqrt(2)))


def test_truncation_checked_against_the_dataset_threshold(tmp_path):
    storage = LocalStorage(tmp_path)
    rows = [make_row("r", i, 5000 if i < 30 else 100 + i, 4096, reasoning=10) for i in range(200)]
    commit_rows(storage, "r", rows)
    storage.put("run.json", orjson.dumps(run_json(["r"], validation={"maxTruncatedFraction": "0.1"})))
    report = build_report(load_ledger(storage))
    assert report["datasets"]["r"]["truncated"]["share"] == pytest.approx(30 / 200)
    [finding] = [f for f in report["findings"] if f["check"] == "truncated"]
    assert finding["level"] == "warn" and "4096" in finding["message"] and finding["threshold"] == 0.1
    assert report["verdict"] == "warn"


def test_broken_reasoning_fails_with_the_likely_causes(tmp_path):
    storage = LocalStorage(tmp_path)
    rows = [make_row("b5", i, 300 + i, 8192, reasoning=None) for i in range(150)]  # end token stripped
    commit_rows(storage, "b5", rows)
    storage.put("run.json", orjson.dumps(run_json(["b5"])))
    report = build_report(load_ledger(storage))
    assert report["verdict"] == "fail"
    [finding] = [f for f in report["findings"] if f["check"] == "reasoning"]
    assert finding["level"] == "fail"
    for cause in ("reasoning parser", "chat API", "endToken"):
        assert cause in finding["message"]


def test_healthy_run_passes(tmp_path):
    storage = LocalStorage(tmp_path)
    rng = random.Random(3)
    rows = [make_row("ok", i, rng.randint(200, 3000), 8192, reasoning=100) for i in range(300)]
    commit_rows(storage, "ok", rows)
    storage.put("run.json", orjson.dumps(run_json(["ok"])))
    report = build_report(load_ledger(storage))
    assert report["verdict"] == "pass", report["findings"]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_files_one_png_per_dataset(crafted, tmp_path):
    commit_rows(crafted, "second", [make_row("second", i, 100 + i, 512, reasoning=5) for i in range(50)])
    crafted.put("run.json", orjson.dumps(run_json(["glaive", "second"])))
    report, written = write_report(crafted)
    assert sorted(p.rsplit("/", 1)[-1] for p in written) == ["glaive.png", "report.json", "report.md", "second.png",
                                                             "vocabulary.png"]
    for name in ("glaive", "second"):
        assert png_size(crafted.get(f"report/{name}.png")) == (1400, 560)
    stored = orjson.loads(crafted.get("report/report.json"))
    assert stored["schema"] == "tokenmill.report/v1" and stored["verdict"] == report["verdict"]
    markdown = crafted.get("report/report.md").decode()
    assert "| glaive | 400 |" in markdown and "![glaive.png](glaive.png)" in markdown
    assert png_size(crafted.get("report/vocabulary.png")) == (1400, 560) and "## Draft vocabulary coverage" in markdown
    assert report["overall"]["completion_tokens"]["count"] == 450


def run_json_with_rows(rows: dict[str, int]) -> dict:
    run = run_json(list(rows))
    run["datasets"] = {name: {"rows": count} for name, count in rows.items()}
    return run


def healthy_rows(dataset: str, lines: range) -> list[dict]:
    # Lengths in no particular order: a run that looks fine but for the check under test (no order drift).
    return [make_row(dataset, i, random.Random(i).randint(200, 3000), 8192, reasoning=50) for i in lines]


def failure(dataset: str, line: int, reason: str) -> dict:
    return {"dataset": dataset, "line": line, "sample_index": 0, "sample_id": f"{dataset}-{line - 1}",
            "reason": reason, "message": f"line {line}: {reason}"}


def test_a_half_done_run_fails_against_the_run_json_totals(tmp_path):
    # Before, the verdict ignored run.json's totals: 200 of 300 lines committed, and the report passed.
    storage = LocalStorage(tmp_path)
    storage.put("run.json", orjson.dumps(run_json_with_rows({"ok": 300})))
    commit_rows(storage, "ok", healthy_rows("ok", range(200)))
    report = build_report(load_ledger(storage))
    assert report["verdict"] == "fail" and report["datasets"]["ok"]["without_outcome"] == 100
    [finding] = [f for f in report["findings"] if f["check"] == "complete"]
    assert finding["message"].startswith("ok: 100 of 300 slots of the current layout have no outcome (100 lines lack "
                                         "sample 0)")
    assert report["overall"]["slots"] == 300 and report["overall"]["without_outcome"] == 100

    commit_shard(storage, "ok", "w000-u-000001", 0, ShardContent(healthy_rows("ok", range(200, 300)), []))
    done = build_report(load_ledger(storage))
    assert done["verdict"] == "pass", done["findings"]


def test_given_up_samples_fail_the_report_apart_from_input_errors(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.put("run.json", orjson.dumps(run_json_with_rows({"ok": 322})))
    commit_rows(storage, "ok", healthy_rows("ok", range(300)), errors=[
        *(failure("ok", line, "retries_exhausted") for line in range(301, 318)),
        *(failure("ok", line, "bad_response") for line in range(318, 321)),
        failure("ok", 321, "invalid_json"), failure("ok", 322, "prompt_too_long")])
    report = build_report(load_ledger(storage))
    got = report["datasets"]["ok"]
    assert (got["errors"], got["input_errors"], got["given_up"]) == (22, 2, 20)
    assert got["given_up_by_reason"] == {"bad_response": 3, "retries_exhausted": 17}
    assert got["error_share"] == pytest.approx(2 / 322) and got["without_outcome"] == 0
    assert report["verdict"] == "fail"
    [finding] = [f for f in report["findings"] if f["level"] != "pass"]
    assert finding["check"] == "given_up" and finding["value"] == 20
    assert "20 samples given up for a server-side reason (bad_response 3, retries_exhausted 17)" in finding["message"]
    assert "--retry-failed" in finding["message"]

    # `--retry-failed` generated them: each line counts once, by its last outcome.
    retried = [make_row("ok", line - 1, 300, 8192, reasoning=50) for line in range(301, 321)]
    commit_shard(storage, "ok", "w000-r-000001", 0, ShardContent(retried, []))
    after = build_report(load_ledger(storage))
    assert after["datasets"]["ok"]["given_up"] == 0 and after["datasets"]["ok"]["samples"] == 320
    assert after["verdict"] == "pass", after["findings"]


def test_a_lowered_samples_count_is_judged_by_slot_not_by_count(tmp_path):
    # Issue 19: 40 lines at samples 4 with 80 slots committed (lines 1-20, every index), then samples lowered to 2.
    # 80 committed outcomes >= 40 x 2 slots, yet lines 21-40 have neither sample 0 nor 1: the report must fail.
    storage = LocalStorage(tmp_path)
    run = run_json(["d"])
    run["datasets"] = {"d": {"rows": 40, "samples": 2}}
    storage.put("run.json", orjson.dumps(run))
    rows = [dict(row, sample_index=index) for index in range(4) for row in healthy_rows("d", range(20))]
    commit_rows(storage, "d", rows)
    report = build_report(load_ledger(storage))
    outcome = report["datasets"]["d"]
    assert (outcome["slots"], outcome["without_outcome"], outcome["missing_by_sample_index"]) == (80, 40, [20, 20])
    assert outcome["outside_layout"] == 40  # samples 2 and 3 of lines 1-20: kept, not counted
    [finding] = [f for f in report["findings"] if f["check"] == "complete"]
    assert finding["level"] == "fail" and "20 lines lack sample 0, 20 lines lack sample 1" in finding["message"]
    assert report["verdict"] == "fail"


def test_plots_span_the_data_show_the_median_and_compare_like_with_like(tmp_path):
    """Read at a glance (fails on f9665d2): the length axis starts near the shortest output, not at 10^0; the median
    line carries its value; a multi-turn dataset's per-conversation totals are not drawn against the per-turn cap;
    a dataset with no sample says so instead of drawing empty axes with an empty legend."""
    import matplotlib.pyplot as plt
    import numpy as np

    from tokenmill_runner.report.plots import dataset_figure
    from tokenmill_runner.report.stream import DatasetSamples

    single = DatasetSamples("single")
    single.completions.add(np.arange(50, 2050, 10, dtype=np.int64))
    conversations = DatasetSamples("conversations")
    conversations.completions.add(np.asarray([900, 12000, 30000], dtype=np.int64))
    conversations.turns.add(np.asarray([3, 4, 5], dtype=np.int64))
    empty = DatasetSamples("empty")
    figures = [dataset_figure(s.name, s, [10240]) for s in (single, conversations, empty)]
    try:
        histogram = figures[0].axes[0]
        assert 40 < histogram.get_xlim()[0] < 50
        labels = [text.get_text() for text in histogram.get_legend().get_texts()]
        assert "median 1,045" in labels and "maxNewTokens 10,240" in labels
        totals = figures[1].axes[0]
        assert all(10240 not in np.atleast_1d(line.get_xdata()) for line in totals.get_lines())
        assert any("per turn" in text.get_text() for text in totals.get_legend().get_texts())
        nothing = figures[2].axes[0]
        assert nothing.get_legend() is None and "no committed samples" in [t.get_text() for t in nothing.texts]
    finally:
        for figure in figures:
            plt.close(figure)
