"""The main job end to end over real HTTP (the simulator) and a real S3 server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from tokenmill_runner.generate.summary import RunSummary
from tokenmill_runner.prepare import prepare
from tokenmill_runner.spec.config import RunnerConfig
from tokenmill_runner.spec.resource import load_spec_file
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.shards import leftovers, read_committed_rows
from tokenmill_runner.store.storage import Storage, open_storage, s3_client

from .workloads import chat, spec_document, tool_chat, write_jsonl, write_spec


async def run_spec(spec_path: Path, servers: list[str], out: str, endpoint: str | None = None) -> RunSummary:
    spec = load_spec_file(spec_path).spec
    if endpoint:
        spec = spec.model_copy(update={"output": spec.output.model_copy(update={"endpoint": endpoint})})
    runner = await prepare(RunnerConfig(spec=spec, servers=servers, output_uri=out), api_key=None)
    return await runner.run()


def committed_errors(storage: Storage, dataset: str) -> list[dict[str, Any]]:
    records = []
    for marker in read_markers(storage, dataset):
        if marker["errors"]:
            records += [orjson.loads(line) for line in storage.get(f"{dataset}/{marker['errors']}").splitlines()]
    return records


def assert_exactly_once(storage: Storage, dataset: str, expected_ids: set[str]) -> list[dict[str, Any]]:
    rows = list(read_committed_rows(storage, dataset))
    counts = Counter(row["sample_id"] for row in rows)
    assert set(counts) == expected_ids, f"missing {expected_ids - set(counts)}, extra {set(counts) - expected_ids}"
    assert max(counts.values()) == 1, [sid for sid, n in counts.items() if n > 1]
    return rows


def test_local_run_is_token_exact(tmp_path, simulator, tokenizer, demo_model):
    write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(40)])
    write_jsonl(tmp_path / "tools.jsonl", [tool_chat(i) for i in range(40)])
    spec = write_spec(tmp_path / "spec.yaml", spec_document(demo_model, [
        {"name": "chat", "source": "chat.jsonl"},
        {"name": "tools", "source": "tools.jsonl", "sampling": {"maxNewTokens": 512}},
    ], "out"))
    summary = asyncio.run(run_spec(spec, [simulator.url], str(tmp_path / "out")))
    storage = open_storage(str(tmp_path / "out"))
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    tool_id = tokenizer.convert_tokens_to_ids("<|tool_calls_section_begin|>")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sources = {"chat": [chat(i) for i in range(40)], "tools": [tool_chat(i) for i in range(40)]}
    for dataset, prompts in sources.items():
        rows = assert_exactly_once(storage, dataset, {p["sample_id"] for p in prompts})
        by_id = {p["sample_id"]: p for p in prompts}
        for row in rows:
            prompt = by_id[row["sample_id"]]
            expected = tokenizer.apply_chat_template(prompt["messages"], tools=prompt.get("tools"),
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)
            assert row["prompt_ids"] == expected
            assert row["prompt_tokens"] == len(expected)
            assert len(row["output_ids"]) == row["completion_tokens"]
            if row["finish_reason"] == "stop":
                assert row["output_ids"][-1] == eos_id == row["matched_stop"]
            else:
                assert row["finish_reason"] == "length"
                assert row["completion_tokens"] == row["max_new_tokens"]
            end = row["reasoning_end"]
            # Reasoning ends at </think> or, as Kimi-K2.5 may, at the tool-call section opener: whichever is first.
            ends = [i for i, t in enumerate(row["output_ids"]) if t in (end_id, tool_id)]
            assert end == (ends[0] if ends else None)
            assert row["reasoning_end_token_id"] == (row["output_ids"][end] if end is not None else None)
            assert row["has_tool_call"] == (tool_id in row["output_ids"])
        assert all(row["max_new_tokens"] == (512 if dataset == "tools" else 2048) for row in rows)
    tool_rows = list(read_committed_rows(storage, "tools"))
    assert any(row["has_tool_call"] for row in tool_rows), "the simulator calls a declared tool in some outputs"
    assert [d.generated for d in summary.datasets] == [40, 40] and not summary.interrupted
    assert not list(leftovers(storage, "chat")) and not list(leftovers(storage, "tools"))
    metadata = orjson.loads(storage.get("run.json"))
    assert metadata["tokenizer"]["reasoning_end_id"] == end_id
    assert {name: d["rows"] for name, d in metadata["datasets"].items()} == {"chat": 40, "tools": 40}
    # The demo model's generation_config.json sets no sampling value: the spec's temperature, SGLang's defaults.
    assert metadata["datasets"]["chat"]["sampling"]["temperature"] == {"value": 0.6, "source": "spec"}
    assert metadata["datasets"]["chat"]["sampling"]["top_p"] == {"value": 1.0, "source": "sglang_default"}
    assert metadata["datasets"]["chat"]["chat_template_kwargs"] == {}


def test_second_run_skips_everything_committed(tmp_path, simulator, demo_model):
    write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(30)])
    spec = write_spec(tmp_path / "spec.yaml", spec_document(demo_model, [{"name": "chat", "source": "chat.jsonl"}],
                                                            "out"))
    first = asyncio.run(run_spec(spec, [simulator.url], str(tmp_path / "out")))
    second = asyncio.run(run_spec(spec, [simulator.url], str(tmp_path / "out")))
    assert first.datasets[0].generated == 30
    assert second.datasets[0].generated == 0 and second.datasets[0].skipped == 30
    assert_exactly_once(open_storage(str(tmp_path / "out")), "chat", {f"s{i:04d}" for i in range(30)})


def test_run_from_and_into_s3(tmp_path, simulator, demo_model, s3_endpoint, s3_bucket):
    client = s3_client(s3_endpoint)
    rows = [chat(i) for i in range(25)]
    client.put_object(Bucket=s3_bucket, Key="prompts/chat.jsonl",
                      Body=b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    out = f"s3://{s3_bucket}/runs/one/"
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "chat", "source": f"s3://{s3_bucket}/prompts/chat.jsonl"}], out))
    summary = asyncio.run(run_spec(spec, [simulator.url], out, endpoint=s3_endpoint))
    assert summary.output_uri == out
    storage = open_storage(out, s3_endpoint)
    assert_exactly_once(storage, "chat", {r["sample_id"] for r in rows})
    keys = set(storage.list("chat/"))
    assert any(k.startswith("chat/commits/") for k in keys) and any(k.startswith("chat/shards/") for k in keys)
    assert "run.json" in set(storage.list(""))


def malformed_rows() -> tuple[list[Any], dict[int, str], set[str]]:
    """Good rows interleaved with one bad row of each kind: (rows, {line: reason}, good sample ids)."""
    bad: dict[int, Any] = {
        3: (b'{"sample_id": "broken", "messages": [', "invalid_json"),
        5: ({"sample_id": "nomsg"}, "missing_messages"),
        7: ({"sample_id": "empty", "messages": []}, "empty_messages"),
        9: ({"sample_id": "role", "messages": [{"role": "bot", "content": "x"}]}, "unknown_role"),
        # Multi-part text is read (input format auto/openai); an image part is not: tokenmill sends text only.
        11: ({"sample_id": "parts", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]}]}, "unsupported_content"),
        13: ({"sample_id": "s0001", "messages": [{"role": "user", "content": "again"}]}, "duplicate_sample_id"),
        15: ({"sample_id": "long", "messages": [{"role": "user", "content": "tokens " * 5000}]}, "prompt_too_long"),
        17: ({"sample_id": "tmpl", "messages": [{"role": "user", "content": "x"},
                                                 {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
             "template_error"),
    }
    rows: list[Any] = []
    good: set[str] = set()
    for line in range(1, 31):
        if line in bad:
            rows.append(bad[line][0])
        else:
            row = chat(line)
            rows.append(row)
            good.add(row["sample_id"])
    return rows, {line: reason for line, (_, reason) in bad.items()}, good


def test_malformed_lines_are_recorded_and_good_lines_generated(tmp_path, simulator, demo_model):
    rows, expected_errors, good = malformed_rows()
    write_jsonl(tmp_path / "mixed.jsonl", rows)
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "mixed", "source": "mixed.jsonl"}], "out", server={"contextLength": 4096}))
    summary = asyncio.run(run_spec(spec, [simulator.url], str(tmp_path / "out")))
    storage = open_storage(str(tmp_path / "out"))
    assert_exactly_once(storage, "mixed", good)
    errors = committed_errors(storage, "mixed")
    assert {e["line"]: e["reason"] for e in errors} == expected_errors
    for error in errors:
        assert f"line {error['line']}" in error["message"]
    too_long = next(e for e in errors if e["reason"] == "prompt_too_long")
    assert "context length 4096" in too_long["message"] and "maxNewTokens" in too_long["message"]
    assert summary.datasets[0].failed == Counter(expected_errors.values())


def test_faults_are_retried_until_every_sample_is_present(tmp_path, demo_model):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(60)])
    spec = write_spec(tmp_path / "spec.yaml", spec_document(demo_model, [{"name": "chat", "source": "chat.jsonl"}],
                                                            "out"))
    faults = SimConfig(model_path=str(demo_model), time_scale=2000.0, max_running_requests=32, seed=3,
                       fault_503_rate=0.15, fault_reset_rate=0.1, fault_abort_rate=0.1)
    with SimServer(faults) as flaky, SimServer(SimConfig(model_path=str(demo_model), time_scale=2000.0)) as steady:
        summary = asyncio.run(run_spec(spec, [flaky.url, steady.url], str(tmp_path / "out")))
    assert summary.retries > 0
    assert summary.datasets[0].failed == {}
    assert_exactly_once(open_storage(str(tmp_path / "out")), "chat", {f"s{i:04d}" for i in range(60)})


def test_retry_failed_generates_what_was_given_up(tmp_path, demo_model):
    """Samples given up for a server-side reason (here: answers corrupted by NaN logits, "NaN happened", every
    time) stay failed on a plain rerun and are generated again with --retry-failed; bad input stays failed."""
    from tokenmill_runner.report.files import load_ledger
    from tokenmill_runner.report.validation import build_report
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(20)] + [b"{broken"])
    spec = load_spec_file(write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "p", "source": "p.jsonl"}], "out",
        runner={"concurrency": 8, "maxAttempts": 2, "shardMaxSamples": 4, "shardMaxSeconds": 1}))).spec
    out = str(tmp_path / "out")
    config = RunnerConfig(spec=spec, servers=["x"], output_uri=out)

    async def run_with(sim_config: SimConfig, retry_failed: bool) -> RunSummary:
        with SimServer(sim_config) as sim:
            update = {"servers": [sim.url], "retry_failed": retry_failed}
            return await (await prepare(config.model_copy(update=update), api_key=None)).run()

    corrupt = SimConfig(model_path=str(demo_model), time_scale=2000.0, fault_nan_rate=1.0)
    up = SimConfig(model_path=str(demo_model), time_scale=2000.0)
    given_up = asyncio.run(run_with(corrupt, retry_failed=False))
    assert given_up.datasets[0].failed == {"nan_output": 20, "invalid_json": 1}
    plain = asyncio.run(run_with(up, retry_failed=False))
    assert plain.datasets[0].generated == 0 and plain.datasets[0].skipped == 21, "failures are final by default"
    retried = asyncio.run(run_with(up, retry_failed=True))
    assert retried.datasets[0].generated == 20 and retried.datasets[0].skipped == 1  # invalid JSON stays failed
    storage = open_storage(out)
    assert_exactly_once(storage, "p", {f"s{i:04d}" for i in range(20)})
    report = build_report(load_ledger(storage))["datasets"]["p"]
    assert report["samples"] == 20 and report["errors_by_reason"] == {"invalid_json": 1}


def test_runner_metrics_count_what_happened(tmp_path, demo_model):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    rows, expected_errors, good = malformed_rows()
    write_jsonl(tmp_path / "p.jsonl", rows)
    spec = load_spec_file(write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "p", "source": "p.jsonl"}], "out", server={"contextLength": 4096}))).spec
    config = RunnerConfig(spec=spec, name="m", namespace="ns", servers=["x"], output_uri=str(tmp_path / "out"))

    async def go():
        with SimServer(SimConfig(model_path=str(demo_model), time_scale=2000.0, fault_503_rate=0.3, seed=5)) as sim:
            runner = await prepare(config.model_copy(update={"servers": [sim.url]}), api_key=None)
            summary = await runner.run()
        return runner.metrics.registry, summary

    registry, summary = asyncio.run(go())
    labels = {"dsgen": "m", "namespace": "ns", "dataset": "p", "worker": "0"}
    value = registry.get_sample_value
    assert value("tokenmill_runner_committed_samples_total", labels) == len(good)
    assert value("tokenmill_runner_requests_total", {**labels, "outcome": "ok"}) == len(good)
    assert value("tokenmill_runner_requests_total", {**labels, "outcome": "retried"}) == summary.retries > 0
    assert value("tokenmill_runner_failed_samples_total", {**labels, "reason": "duplicate_sample_id"}) == 1
    tokens = sum(r["completion_tokens"] for r in read_committed_rows(open_storage(str(tmp_path / "out")), "p"))
    assert value("tokenmill_runner_generated_tokens_total", labels) == tokens
    assert value("tokenmill_runner_samples_remaining", labels) == 0
    assert value("tokenmill_runner_in_flight_requests", {"dsgen": "m", "namespace": "ns", "worker": "0"}) == 0
    assert value("tokenmill_runner_request_latency_seconds_count", labels) == len(good)


def tokenmill(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "-q", *args], capture_output=True,
                          text=True, timeout=300)


def test_run_report_and_inspect_from_the_command_line_on_s3(tmp_path, demo_model, s3_endpoint, s3_bucket):
    rows = [tool_chat(i) for i in range(30)] + [chat(i) for i in range(30, 60)]
    write_jsonl(tmp_path / "p.jsonl", rows)
    out = f"s3://{s3_bucket}/cli/"
    spec = write_spec(tmp_path / "spec.yaml", spec_document(demo_model, [{"name": "mixed", "source": "p.jsonl"}],
                                                            out))
    run = tokenmill("run", str(spec), "--s3-endpoint", s3_endpoint, "--sim-time-scale", "2000")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Report verdict:" in run.stdout and f"{out}report/report.json" in run.stdout

    report = tokenmill("report", out, "--s3-endpoint", s3_endpoint)
    assert report.returncode == 0 and "| mixed | 60 |" in report.stdout

    inspected = tokenmill("inspect", out, "--s3-endpoint", s3_endpoint, "--random", "5", "--json")
    assert inspected.returncode == 0, inspected.stderr
    samples = orjson.loads(inspected.stdout)
    stored = {r["sample_id"]: r for r in read_committed_rows(open_storage(out, s3_endpoint), "mixed")}
    by_id = {r["sample_id"]: r for r in rows}
    assert len(samples) == 5
    for sample in samples:
        row = stored[sample["sample_id"]]
        assert [t for part in sample["output"] for t in part["ids"]] == row["output_ids"]
        parts = {part["name"]: part["text"] for part in sample["prompt"]}
        messages = {m["role"]: m["content"] for m in by_id[sample["sample_id"]]["messages"]}
        assert parts["user"] == messages["user"] and parts["system"] == messages["system"]
        if "tools" in by_id[sample["sample_id"]]:
            assert orjson.loads(parts["tools"]) == by_id[sample["sample_id"]]["tools"]
        names = [part["name"] for part in sample["output"]]
        assert names[-1] == "stop token" or sample["finish_reason"] == "length"
        if "tool calls" in names:
            assert "functions.get_weather" in sample["output"][names.index("tool calls")]["text"]

    longest = tokenmill("inspect", out, "--s3-endpoint", s3_endpoint, "--longest", "1")
    assert longest.returncode == 0 and "══ mixed · sample" in longest.stdout and "┌─ OUTPUT" in longest.stdout
