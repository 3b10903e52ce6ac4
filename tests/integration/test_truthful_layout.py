"""The last ways a run could claim what is not so, tried as a user meets them (issue 29, scenarios 2-4 and the
report/export side of 1): real `tokenmill` subprocesses against the simulator over HTTP, on a local output folder.

- a JSONL source with one blank line settles: `tokenmill run` exits 0, the report passes, the operator's progress
  calls it settled (before: the layout counted rows, completeness checked lines 1..rows, and the last line was
  outside it for ever);
- worker 1 of 2 alone leaves no run.json: the report fails and `export --exclude-findings fail` exports nothing
  as good (before: no layout, no completeness check, verdict pass);
- a source edited to the same size (row 1,500 of 2,000 removed, one of the same byte length appended) is refused
  before a request is sent, naming the dataset, with every commit kept (before: size and first 64 KiB agreed);
- a marker whose shard is gone and a slot committed twice are report findings, and export skips the one and names
  the other instead of dying.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from tokenmill_runner.generate.summary import EXIT_OK, EXIT_USAGE, EXIT_VERDICT
from tokenmill_runner.store.manifest import read_manifest
from tokenmill_runner.store.marker_names import marker_name
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.storage import LocalStorage

from .test_exactly_once import killed_at, run_cli
from .workloads import chat, spec_document, write_jsonl, write_spec

LINES = 40


@pytest.fixture
def sim(demo_model: Path):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    with SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0, max_running_requests=32)) as server:
        yield server


def spec(tmp_path: Path, demo_model: Path, name: str = "it", **runner) -> Path:
    document = spec_document(demo_model, [{"name": "p", "source": "p.jsonl"}], "out",
                             runner={"concurrency": 16, "shardMaxSamples": 10, "shardMaxSeconds": 30, **runner})
    document["metadata"]["name"] = name
    return write_spec(tmp_path / f"{name}.yaml", document)


def tokenmill(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", *args], capture_output=True, text=True,
                          timeout=300)


def report(out: Path) -> dict:
    done = tokenmill("report", str(out))
    result = orjson.loads((out / "report" / "report.json").read_bytes())
    # The exit code says the verdict: 8 on FAIL, so a pipeline can gate on it (docs/running.md, exit codes).
    assert done.returncode == (EXIT_VERDICT if result["verdict"] == "fail" else EXIT_OK), done.stderr
    return result


def checks(result: dict, level: str) -> set[str]:
    return {f["check"] for f in result["findings"] if f["level"] == level}


def test_a_jsonl_source_with_a_blank_line_settles_and_passes_everywhere(tmp_path, demo_model, sim):
    # Scenario 3: line 11 is blank, so the 40 rows are on lines 1-10 and 12-41.
    rows = [orjson.dumps(chat(i)) for i in range(LINES)]
    write_jsonl(tmp_path / "p.jsonl", [*rows[:10], b"", *rows[10:]])
    out = tmp_path / "out"
    done = run_cli(spec(tmp_path, demo_model), out, sim.url)
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    layout = read_manifest(LocalStorage(out)).datasets["p"]  # type: ignore[union-attr]
    assert (layout.rows, layout.last_line, layout.skipped_lines) == (LINES, LINES + 1, 1)
    result = report(out)
    assert result["verdict"] != "fail" and "complete" not in checks(result, "fail"), result["findings"]
    dataset = result["datasets"]["p"]
    assert (dataset["slots"], dataset["without_outcome"], dataset["skipped_lines"]) == (LINES, 0, 1)

    # The operator judges the same output with the same completeness.
    from tokenmill_operator.observe.gather import OutputIndex, observe_progress

    facts, _ = observe_progress(LocalStorage(out), OutputIndex(), datetime.now(UTC), None, full=True)
    assert facts is not None and facts.settled, facts and facts.missing
    assert (facts.overall.completed, facts.overall.total) == (LINES, LINES)

    # And a rerun (what a failing report used to advise) has nothing left to do.
    again = run_cli(spec(tmp_path, demo_model), out, sim.url)
    assert again.returncode == EXIT_OK, again.stderr[-2000:]
    assert sum(len(m["samples"]["line"]) for m in read_markers(LocalStorage(out), "p")) == LINES


def test_worker_1_of_2_alone_does_not_pass_and_is_not_exported_as_good(tmp_path, demo_model, sim):
    # Scenario 2: worker 0's pod never started; worker 1 finishes its half. Only worker 0 records the layout.
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(LINES)])
    out = tmp_path / "out"
    done = run_cli(spec(tmp_path, demo_model), out, sim.url, None, "--workers", "2", "--worker-index", "1")
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    committed = sum(len(m["samples"]["line"]) for m in read_markers(LocalStorage(out), "p"))
    assert 0 < committed < LINES
    assert not (out / "run.json").exists()
    result = report(out)
    assert result["verdict"] == "fail"
    [finding] = [f for f in result["findings"] if f["check"] == "complete"]
    assert finding["level"] == "fail" and "run.json missing: worker 0 never recorded the layout" in finding["message"]

    dest = tmp_path / "export"
    exported = tokenmill("-q", "export", str(out), "--format", "specforge", str(dest), "--exclude-findings", "fail")
    written = [path for path in dest.rglob("*.jsonl") if path.stat().st_size] if dest.exists() else []
    assert exported.returncode != EXIT_OK or not written, "a half-done output must not be exported as good"


def test_a_source_edited_to_the_same_size_is_refused_and_nothing_committed_is_lost(tmp_path, demo_model, sim):
    # Scenario 4: 2,000 rows of one byte length; row 1,500 removed and one of the same length appended keeps the
    # size and the first 64 KiB, and would move every later committed outcome onto another prompt.
    source = tmp_path / "p.jsonl"
    rows = [orjson.dumps(chat(i, f"Question {i:05d}: what is {i:05d} squared? Explain.")) for i in range(2000)]
    assert len({len(row) for row in rows}) == 1
    write_jsonl(source, rows)
    out = tmp_path / "out"
    document = spec(tmp_path, demo_model, shardMaxSamples=50)
    killed_at(run_cli(document, out, sim.url, "kill-after:marker:3"), "kill-after:marker:3")

    def committed() -> list[str]:
        # The markers, not a killed marker write's temporary file: a later start of the worker deletes that
        # leftover (shards.leftovers), which commits nothing and loses nothing (a CI run caught the kill mid-write).
        return sorted(path.name for path in (out / "p" / "commits").iterdir() if path.suffix == ".json")

    before = committed()
    size = source.stat().st_size
    appended = orjson.dumps(chat(2000, "Question 02000: what is 02000 squared? Explain."))
    write_jsonl(source, [*rows[:1499], *rows[1500:], appended])
    assert source.stat().st_size == size

    refused = run_cli(document, out, sim.url)
    assert refused.returncode == EXIT_USAGE, refused.stderr[-2000:]
    assert "datasets[p].source" in refused.stderr and "hash of all its bytes differs" in refused.stderr
    assert "another output URI" in refused.stderr
    assert committed() == before, "no commit is lost"

    # Putting the original back resumes (a re-scan finds the same content).
    write_jsonl(source, rows)
    resumed = run_cli(document, out, sim.url)
    assert resumed.returncode == EXIT_OK, resumed.stderr[-2000:]


def test_a_dangling_marker_fails_the_report_and_a_slot_committed_twice_warns_and_export_survives_both(
        tmp_path, demo_model, sim):
    # Scenario 1's aftermath, as two writers leave it: a marker whose shard the other writer deleted as a
    # "leftover", and a slot committed by both.
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(LINES)])
    out = tmp_path / "out"
    done = run_cli(spec(tmp_path, demo_model), out, sim.url)
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    markers = read_markers(LocalStorage(out), "p")
    gone, twice = markers[0], markers[1]
    (out / "p" / gone["data"]).unlink()
    copy_id = "w000-second-writer-0000"
    shutil.copy(out / "p" / twice["data"], out / "p" / "shards" / f"{copy_id}.parquet")
    copy = {**twice, "shard_id": copy_id, "data": f"shards/{copy_id}.parquet", "errors": None}
    (out / "p" / "commits" / marker_name(datetime.now(UTC), copy_id)).write_bytes(orjson.dumps(copy))

    result = report(out)
    assert result["verdict"] == "fail"
    [dangling] = [f for f in result["findings"] if f["check"] == "dangling"]
    assert dangling["level"] == "fail" and f"p/{gone['data']}" in dangling["message"]
    [duplicates] = [f for f in result["findings"] if f["check"] == "duplicates"]
    assert duplicates["level"] == "warn" and duplicates["value"] == len(twice["samples"]["line"])
    assert result["datasets"]["p"]["samples"] == LINES, "each slot counts once"

    dest = tmp_path / "export"
    exported = tokenmill("export", str(out), "--format", "specforge", str(dest))
    assert exported.returncode == EXIT_OK, exported.stderr[-2000:]
    assert f"p/{gone['data']}" in exported.stdout + exported.stderr
    manifest = orjson.loads((dest / "export.json").read_bytes())
    counts = manifest["counts"]["datasets"]["p"]
    assert counts["dangling_files"] == [f"p/{gone['data']}"]
    assert counts["duplicate_slots"] == len(twice["samples"]["line"])
    assert counts["units"] == LINES - len(gone["samples"]["line"])
