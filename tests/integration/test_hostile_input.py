"""Careless and hostile input, run as a user runs it: `tokenmill run`, `inspect` and `export` in a child process
against the built-in simulator (docs/security.md; the cases of ../shared/reference/security-1006bac.md)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import open_storage

from .workloads import chat, spec_document, write_jsonl, write_spec

CLI = [sys.executable, "-m", "tokenmill_runner.cli"]
RSS_LIMIT_KB = 1536 * 1024  # a small run peaks near 250 MB; the unbounded reader passed 1.5 GB on an 8 MB line


def tokenmill(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def run_spec(tmp_path: Path, rows: list[Any] | None = None, source: Path | None = None, name: str = "d",
             **spec: Any) -> tuple[Path, Path]:
    source = source or write_jsonl(tmp_path / "p.jsonl", rows or [])
    document = spec_document(Path(__file__).resolve().parents[2] / "examples" / "demo-model",
                             [{"name": name, "source": str(source)}], str(tmp_path / "out"), **spec)
    document["spec"]["sampling"]["maxNewTokens"] = 64
    return write_spec(tmp_path / "spec.yaml", document), tmp_path / "out"


def committed_ids(out: Path, dataset: str = "d") -> set[str]:
    return {row["sample_id"] for row in read_committed_rows(open_storage(str(out)), dataset)}


def errors(out: Path, dataset: str = "d") -> list[dict[str, Any]]:
    return [orjson.loads(line) for path in sorted((out / dataset / "errors").glob("*.jsonl"))
            for line in path.read_bytes().splitlines()]


def peak_rss_kb(args: list[str]) -> tuple[int, int, bool]:
    """(exit code, peak RSS in kB, killed) of `tokenmill ARGS`, measured by peak_rss.py (why a process between:
    its docstring); the run is killed once its RSS passes RSS_LIMIT_KB."""
    measured = subprocess.run([sys.executable, str(Path(__file__).with_name("peak_rss.py")), str(RSS_LIMIT_KB),
                               *CLI, "-q", *args], capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(measured.stdout)
    return result["code"], result["peak_kb"], result["killed"]


def huge_line(path: Path, megabytes: int) -> Path:
    """A valid row whose one user message is `megabytes` of real words, between two good rows. Written a megabyte at
    a time, so that pytest never holds the line."""
    words = b"the quick brown fox jumps over the lazy dog " * (1024 * 1024 // 44)
    with path.open("wb") as handle:
        handle.write(orjson.dumps(chat(1)) + b"\n")
        handle.write(b'{"sample_id":"huge","messages":[{"role":"user","content":"')
        for _ in range(megabytes):
            handle.write(words)
        handle.write(b'"}]}\n' + orjson.dumps(chat(3)) + b"\n")
    return path


def test_a_huge_line_is_refused_unread_with_memory_independent_of_its_size(tmp_path):
    peaks = {}
    for megabytes in (8, 64):
        folder = tmp_path / f"mb{megabytes}"
        folder.mkdir()
        spec, out = run_spec(folder, source=huge_line(folder / "p.jsonl", megabytes))
        code, peaks[megabytes], killed = peak_rss_kb(["run", str(spec)])
        assert not killed, f"a {megabytes} MB line took the run past {RSS_LIMIT_KB} kB"
        assert code == 0
        assert committed_ids(out) == {"s0001", "s0003"}, "the neighbours of the huge line commit"
        [error] = errors(out)
        assert error["line"] == 2 and error["reason"] == "prompt_too_long"
        assert "over the 524288 bytes" in error["message"] and "32768-token context" in error["message"]
    # Eight times the line, the same memory: nothing of the line is held beyond the bound (16 bytes per token).
    assert abs(peaks[64] - peaks[8]) < 48 * 1024, peaks


def test_a_spec_beyond_the_bounds_is_refused_before_anything_runs(tmp_path):
    for path, value in [("runner.concurrency", 10_000_000), ("server.replicas", -1), ("server.nodes", 100_000),
                        ("sampling.maxNewTokens", 2**70), ("runner.shardMaxSamples", 10**9),
                        ("runner.shardMaxSeconds", 10**9)]:
        spec, out = run_spec(tmp_path, [chat(1)])
        document = yaml.safe_load(spec.read_text())
        section, key = path.split(".")
        document["spec"].setdefault(section, {})[key] = value
        spec.write_text(yaml.safe_dump(document))
        run = tokenmill("run", str(spec))
        assert run.returncode == 2, (path, run.stderr[-2000:])
        assert f"spec.{path}" in run.stderr and "than or equal to" in run.stderr, run.stderr
        assert not out.exists()


def test_compressed_files_and_a_bom_are_read_as_their_rows(tmp_path):
    rows = b"".join(orjson.dumps(chat(i)) + b"\n" for i in range(1, 6))
    cases = {"g.jsonl.gz": gzip.compress(rows), "gz-named-plain.jsonl": gzip.compress(rows),
             "bom.jsonl": b"\xef\xbb\xbf" + rows}
    stream = pa.BufferOutputStream()
    with pa.CompressedOutputStream(stream, "zstd") as compressed:
        compressed.write(rows)
    cases["z.jsonl.zst"] = stream.getvalue().to_pybytes()
    for name, data in cases.items():
        folder = tmp_path / name.replace(".", "-")
        folder.mkdir()
        (folder / name).write_bytes(data)
        spec, out = run_spec(folder, source=folder / name)
        run = tokenmill("-q", "run", str(spec))
        assert run.returncode == 0, (name, run.stdout[-2000:], run.stderr[-2000:])
        assert committed_ids(out) == {f"s{i:04d}" for i in range(1, 6)}, name


def test_an_empty_source_or_one_whose_every_row_failed_exits_5_with_the_reason(tmp_path):
    (tmp_path / "empty").mkdir()
    spec, _ = run_spec(tmp_path / "empty", source=write_jsonl(tmp_path / "empty" / "p.jsonl", [b"", b"  "]))
    empty = tokenmill("-q", "run", str(spec))
    assert empty.returncode == 5, empty.stdout[-2000:]
    assert "error: no samples: d: its source holds no rows" in empty.stdout

    (tmp_path / "bad").mkdir()
    spec, _ = run_spec(tmp_path / "bad", [b"{not json", {"messages": "hello"}])
    bad = tokenmill("-q", "run", str(spec))
    assert bad.returncode == 5, bad.stdout[-2000:]
    assert "every row failed for its input (empty_messages 1, invalid_json 1)" in bad.stdout


def test_a_truncated_parquet_file_is_refused_naming_the_file_and_the_dataset(tmp_path):
    table = pa.table({"sample_id": ["a", "b"], "prompt": ["one", "two"]})
    pq.write_table(table, tmp_path / "p.parquet")
    data = (tmp_path / "p.parquet").read_bytes()
    (tmp_path / "p.parquet").write_bytes(data[:len(data) // 2])
    spec, _ = run_spec(tmp_path, source=tmp_path / "p.parquet", name="halfway")
    run = tokenmill("-q", "run", str(spec))
    assert run.returncode == 2, run.stderr
    assert "spec.datasets[0] (halfway)" in run.stderr and f"{tmp_path / 'p.parquet'} is not a readable Parquet" \
        in run.stderr


def test_a_dataset_name_with_a_trailing_newline_is_refused(tmp_path):
    spec, out = run_spec(tmp_path, [chat(1)], name="ok\n")
    run = tokenmill("run", str(spec))
    assert run.returncode == 2 and "dataset name 'ok\\n'" in run.stderr
    assert not out.exists()


def test_a_sample_id_cannot_forge_a_log_line(tmp_path):
    forged = "x\n2026-12-01 00:00:00,000 ERROR tokenmill: FORGED LOG LINE"
    spec, _ = run_spec(tmp_path, [chat(1), {"sample_id": forged, "messages": [{"role": "bogus", "content": "hi"}]}])
    run = tokenmill("run", str(spec))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "FORGED LOG LINE" in run.stderr
    assert not any(line.startswith("2026-12-01 00:00:00,000 ERROR") for line in run.stderr.splitlines())
    assert "x\\n2026-12-01" in run.stderr


def evil_tokenizer(tmp_path: Path) -> tuple[Path, Path]:
    """The demo tokenizer with an auto_map into a module that leaves a file behind when it is imported."""
    evil = tmp_path / "evilmodel"
    shutil.copytree(Path(__file__).resolve().parents[2] / "examples" / "demo-model", evil)
    marker = tmp_path / "PWNED"
    config = json.loads((evil / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "evil_tok.EvilTokenizer"]}
    (evil / "tokenizer_config.json").write_text(json.dumps(config))
    (evil / "evil_tok.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    return evil, marker


def test_inspect_and_export_run_remote_code_only_with_the_flag_never_because_run_json_says_so(tmp_path):
    spec, out = run_spec(tmp_path, [chat(1), chat(2)])
    assert tokenmill("-q", "run", str(spec)).returncode == 0
    evil, marker = evil_tokenizer(tmp_path)
    run_json = json.loads((out / "run.json").read_text())  # what anyone who can write the output can do
    run_json["spec"]["model"]["trustRemoteCode"] = True
    run_json["tokenizer"]["location"] = str(evil)
    (out / "run.json").write_text(json.dumps(run_json))

    inspect = tokenmill("inspect", str(out), "--random", "1")
    export = tokenmill("export", str(out), str(tmp_path / "exported"), "--format", "specforge-text")
    for refused in (inspect, export):
        assert refused.returncode == 1
        assert f"the tokenizer at {evil} runs its own Python code; pass --trust-remote-code" in refused.stderr
    assert not marker.exists(), "the repository's code ran"

    trusted = tokenmill("inspect", str(out), "--random", "1", "--trust-remote-code")
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert marker.exists(), "with the flag, the person running the command chose to run it"


def test_botocore_debug_logging_never_prints_the_session_token(tmp_path, s3_endpoint, s3_bucket):
    token = "SESSIONTOKENsessiontoken999"
    secret = "SECRETKEYsecretkey0001"
    spec, _ = run_spec(tmp_path, [chat(1), chat(2)])
    env = {"AWS_ACCESS_KEY_ID": "AKIATESTKEYID0001", "AWS_SECRET_ACCESS_KEY": secret, "AWS_SESSION_TOKEN": token}
    run = tokenmill("-vv", "run", str(spec), "--out", f"s3://{s3_bucket}/secrun/", "--s3-endpoint", s3_endpoint,
                    env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "x-amz-security-token" in run.stderr.lower(), "botocore logged its headers"
    assert token not in run.stderr and secret not in run.stderr and token not in run.stdout
