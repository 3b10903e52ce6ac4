"""S3's bad minutes, through a fault-injecting proxy in front of the real test S3 server (moto's): 5xx answers, slow
answers, connections reset in the middle of an upload or a download, for prompts, tokenizer files and shards.
Nothing may be lost or written twice; a store down past the retry budget stops the run with a clear error, and a
rerun completes it."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.faults.s3_proxy import Rule, S3FaultProxy
from tokenmill_runner.source.reader import read_prompts
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.shards import leftovers, read_committed_rows
from tokenmill_runner.store.storage import S3Storage, StorageError, StorageRetry, open_storage, s3_client

from .test_run import assert_exactly_once, committed_errors, run_spec
from .workloads import chat, spec_document, write_spec


@pytest.fixture
def proxy(s3_endpoint: str):
    with S3FaultProxy(s3_endpoint) as running:
        yield running


def upload_jsonl(endpoint: str, bucket: str, key: str, rows: list) -> bytes:
    body = b"\n".join(orjson.dumps(row) for row in rows) + b"\n"
    s3_client(endpoint).put_object(Bucket=bucket, Key=key, Body=body)
    return body


def test_a_prompt_stream_broken_mid_body_resumes_from_its_byte_offset(proxy, s3_endpoint, s3_bucket):
    rows = [chat(i, f"Question {i}: " + "words " * (i % 50)) for i in range(3000)]
    body = upload_jsonl(s3_endpoint, s3_bucket, "prompts/p.jsonl", rows)
    proxy.add(Rule("status", method="GET", path=r"/prompts/p\.jsonl", times=1, status=503))
    proxy.add(Rule("reset_response", method="GET", path=r"/prompts/p\.jsonl", times=2, after_bytes=len(body) // 3))
    got = list(read_prompts(f"s3://{s3_bucket}/prompts/p.jsonl", "jsonl", proxy.url))
    assert [(p.line, p.sample_id) for p in got] == [(i + 1, f"s{i:04d}") for i in range(3000)]
    assert len(proxy.fired("status")) == 1 and len(proxy.fired("reset_response")) == 2
    resumed = [e.range for e in proxy.requests("GET", r"/prompts/p\.jsonl") if e.range]
    offsets = [int(r.removeprefix("bytes=").rstrip("-")) for r in resumed]
    # Each reset breaks the body a third of its size after where that GET started; the reader goes on from the
    # byte it reached, never from 0.
    assert len(offsets) == 2 and 0 < offsets[0] < offsets[1] < len(body), resumed


def test_tokenizer_files_survive_faults_and_a_truncated_cache_is_fetched_again(proxy, s3_endpoint, s3_bucket,
                                                                              demo_model, tmp_path, monkeypatch):
    from tokenmill_runner.render.pretokenize import fetch_tokenizer_files

    client = s3_client(s3_endpoint)
    files = {path.name: path.read_bytes() for path in Path(demo_model).iterdir() if path.is_file()}
    for name, data in files.items():
        client.put_object(Bucket=s3_bucket, Key=f"models/demo/{name}", Body=data)
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    proxy.add(Rule("status", method="GET", path=r"list-type=2", times=2, status=500))
    proxy.add(Rule("reset_response", method="GET", path=r"/models/demo/tokenizer\.json", times=1,
                   after_bytes=len(files["tokenizer.json"]) // 2))
    proxy.add(Rule("delay", method="GET", path=r"/models/demo/tokenizer_config\.json", delay_s=1.0))
    folder = fetch_tokenizer_files(f"s3://{s3_bucket}/models/demo/", proxy.url)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    assert proxy.fired("status") and proxy.fired("reset_response") and proxy.fired("delay")

    # A cache cut short (as the old non-atomic copy could leave it) is noticed by size and fetched again.
    (folder / "tokenizer.json").write_bytes(files["tokenizer.json"][:1000])
    gets_before = len(proxy.requests("GET", r"/models/demo/tokenizer\.json"))
    fetch_tokenizer_files(f"s3://{s3_bucket}/models/demo/", proxy.url)
    assert (folder / "tokenizer.json").read_bytes() == files["tokenizer.json"]
    assert len(proxy.requests("GET", r"/models/demo/tokenizer\.json")) == gets_before + 1
    assert len(proxy.requests("GET", r"/models/demo/config\.json")) == 1, "complete files are not fetched again"
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]


def test_shard_commits_survive_5xx_slow_answers_and_uploads_reset_midway(proxy, s3_endpoint, s3_bucket, tmp_path,
                                                                          demo_model, simulator):
    rows = [orjson.dumps(chat(i)) for i in range(120)] + [b"{broken"]
    s3_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="prompts/p.jsonl", Body=b"\n".join(rows) + b"\n")
    out = f"s3://{s3_bucket}/runs/faulty/"
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "p", "source": f"s3://{s3_bucket}/prompts/p.jsonl"}], out,
        runner={"concurrency": 16, "shardMaxSamples": 10, "shardMaxSeconds": 1, "maxAttempts": 8}))
    # Several failures of one object in a row: each is retried with backoff, none is given up.
    proxy.add(Rule("reset_request", method="PUT", path=r"/runs/faulty/p/shards/", times=5, after_bytes=300))
    proxy.add(Rule("status", method="PUT", path=r"/runs/faulty/p/commits/", times=6, status=503))
    proxy.add(Rule("status", method="PUT", path=r"/runs/faulty/p/errors/", times=4, status=500))
    proxy.add(Rule("delay", method="PUT", path=r"/runs/faulty/p/", skip=8, times=4, delay_s=1.5))
    proxy.add(Rule("status", method="GET", path=r"list-type=2", times=3, status=503))
    proxy.add(Rule("reset_response", method="GET", path=r"/prompts/p\.jsonl", times=2, after_bytes=4000))
    summary = asyncio.run(run_spec(spec, [simulator.url], out, endpoint=proxy.url))
    assert summary.datasets[0].generated == 120 and summary.datasets[0].failed == {"invalid_json": 1}
    for action, path in [("reset_request", "/shards/"), ("status", "/commits/"), ("status", "/errors/"),
                         ("delay", "/p/"), ("status", "list-type"), ("reset_response", "/prompts/")]:
        assert proxy.fired(action, path), f"{action} on {path} never fired"
    storage = open_storage(out, s3_endpoint)
    assert_exactly_once(storage, "p", {f"s{i:04d}" for i in range(120)})
    assert [e["line"] for e in committed_errors(storage, "p")] == [121]
    assert not list(leftovers(storage, "p"))


def tokenmill(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "-q", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_a_store_down_past_the_retry_budget_stops_the_run_and_a_rerun_completes(proxy, s3_endpoint, s3_bucket,
                                                                                  tmp_path, demo_model):
    upload_jsonl(s3_endpoint, s3_bucket, "prompts/p.jsonl", [chat(i) for i in range(60)])
    out = f"s3://{s3_bucket}/runs/down/"
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "p", "source": f"s3://{s3_bucket}/prompts/p.jsonl"}], out,
        runner={"concurrency": 8, "shardMaxSamples": 10, "shardMaxSeconds": 1}))
    # Two markers are written, then every marker write fails for good (shard data still arrives: leftovers).
    outage = proxy.add(Rule("status", method="PUT", path=r"/runs/down/p/commits/", skip=2, times=10**6, status=503))
    args = ("run", str(spec), "--s3-endpoint", proxy.url, "--sim-time-scale", "2000")
    down = tokenmill(*args, env={"TOKENMILL_STORAGE_RETRY_SECONDS": "3"})
    assert down.returncode == 1, down.stderr[-2000:]
    assert "cannot commit shard p/" in down.stderr, down.stderr[-2000:]
    assert re.search(r"cannot write s3://\S+/runs/down/p/\S+: still failing after [34]s", down.stderr)
    assert "the store is unavailable: nothing was lost, rerun to resume" in down.stderr
    assert outage.matched > outage.skip
    storage = open_storage(out, s3_endpoint)
    before = list(read_committed_rows(storage, "p"))
    assert 0 < len(before) <= 20 and len(read_markers(storage, "p")) == 2
    assert list(leftovers(storage, "p")), "shards whose marker never arrived are left over, invisible to readers"
    proxy.clear()
    up = tokenmill(*args)
    assert up.returncode == 0, up.stderr[-2000:]
    assert_exactly_once(storage, "p", {f"s{i:04d}" for i in range(60)})
    assert not list(leftovers(storage, "p"))


def test_an_unreadable_object_past_the_budget_raises_naming_it(proxy, s3_endpoint, s3_bucket):
    s3_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="run/x.json", Body=b"{}")
    storage = S3Storage(f"s3://{s3_bucket}/run/", endpoint=proxy.url, retry=StorageRetry(budget_s=2.0))
    proxy.add(Rule("status", method="GET", path=r"/run/x\.json", times=10**6, status=503))
    with pytest.raises(StorageError, match=rf"cannot read s3://{s3_bucket}/run/x.json: still failing after [23]s"):
        storage.get("x.json")
    proxy.clear()
    assert storage.get("x.json") == b"{}"
    missing = S3Storage(f"s3://{s3_bucket}/run/", endpoint=proxy.url, retry=StorageRetry(budget_s=60.0))
    with pytest.raises(StorageError, match="does not exist"):  # a missing object is not retried for a minute
        missing.get("nothing.json")
