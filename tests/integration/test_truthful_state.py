"""What a run says about itself, tried as a user runs `tokenmill` (real subprocesses, the simulator over HTTP):
a lowered `samples` does not pass, a second writer on one output is refused naming the holder, and a source
replaced under committed work is refused instead of re-mapping outcomes (issue 19)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

from tokenmill_runner.generate.summary import EXIT_OK, EXIT_USAGE, EXIT_VERDICT
from tokenmill_runner.store.lease import LEASE, read_lease
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


def spec(tmp_path: Path, demo_model: Path, name: str, samples: int = 1, **runner) -> Path:
    document = spec_document(demo_model, [{"name": "p", "source": "p.jsonl", "samples": samples}], "out",
                             runner={"concurrency": 16, "shardMaxSamples": 10, "shardMaxSeconds": 30,
                                     **runner})
    document["metadata"]["name"] = name
    return write_spec(tmp_path / f"{name}-{samples}.yaml", document)


def report(out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "report", str(out)], capture_output=True,
                          text=True, timeout=300)
    result = orjson.loads((out / "report" / "report.json").read_bytes())
    # The exit code says the verdict: 8 on FAIL, so a pipeline can gate on it (docs/running.md, exit codes).
    assert done.returncode == (EXIT_VERDICT if result["verdict"] == "fail" else EXIT_OK), done.stderr
    return result


def test_a_run_killed_at_samples_4_and_rerun_at_samples_2_does_not_pass_while_lines_lack_samples(tmp_path, demo_model,
                                                                                                  sim):
    # Review 1, as a user: 40 prompts at samples 4, killed with 80 slots committed (8 shards of 10), rerun at
    # samples 2 against a server that is gone (it stops before generating anything): lines 21-40 lack samples 0-1.
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(LINES)])
    out = tmp_path / "out"
    killed_at(run_cli(spec(tmp_path, demo_model, "it", samples=4), out, sim.url, "kill-after:marker:8"),
              "kill-after:marker:8")
    # Commits run in parallel: a shard or two more may land between the 8th marker and the kill.
    committed = {(line, index) for m in read_markers(LocalStorage(out), "p")
                 for part in ("samples", "failed") for line, index in zip(m[part]["line"], m[part]["sample_index"], strict=True)}
    assert 80 <= len(committed) < 4 * LINES
    lacking = {(line, index) for line in range(1, LINES + 1) for index in (0, 1)} - committed
    lowered = spec(tmp_path, demo_model, "it", samples=2, outageBudgetSeconds=1)
    stopped = run_cli(lowered, out, "http://127.0.0.1:9", None, "--server-wait", "1")
    assert stopped.returncode != EXIT_OK
    result = report(out)
    dataset = result["datasets"]["p"]
    assert dataset["slots"] == 80 and dataset["without_outcome"] == sum(dataset["missing_by_sample_index"])
    assert dataset["without_outcome"] == len(lacking) > 0
    [finding] = [f for f in result["findings"] if f["check"] == "complete"]
    assert finding["level"] == "fail" and result["verdict"] == "fail"
    assert "lines lack sample 0" in finding["message"] and "lines lack sample 1" in finding["message"]


def test_a_second_run_on_an_output_being_written_is_refused_naming_the_holder(tmp_path, demo_model, demo_model_sim):
    # Review 3, as a user: two `tokenmill run` (another name, the same model) on one output. Before, both exited 0
    # and samples were committed twice. Now the second exits 2 naming the first, and the first commits each once.
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(LINES)])
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-m", "tokenmill_runner.cli", "-q", "run",
                              str(spec(tmp_path, demo_model, "first")), "--out", str(out),
                              "--server", demo_model_sim.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / LEASE).exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.1)
        second = run_cli(spec(tmp_path, demo_model, "second"), out, demo_model_sim.url)
        assert second.returncode == EXIT_USAGE, second.stderr[-2000:]
        assert "is being written by tokenmill run 'first'" in second.stderr and "--take-over" in second.stderr
        _, stderr = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == EXIT_OK, stderr[-2000:]
    slots = Counter(line for marker in read_markers(LocalStorage(out), "p") for line in marker["samples"]["line"])
    assert set(slots) == set(range(1, LINES + 1)) and set(slots.values()) == {1}, "every line committed once"
    assert read_lease(LocalStorage(out)) is None, "a finished process gives its lease up"
    assert orjson.loads((out / LEASE).read_bytes())["released"] is True


def test_a_source_replaced_under_committed_work_is_refused(tmp_path, demo_model, sim):
    # Review 12: the ledger is keyed by line; another file under the same name would re-map committed outcomes.
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(LINES)])
    out = tmp_path / "out"
    document = spec(tmp_path, demo_model, "it")
    killed_at(run_cli(document, out, sim.url, "kill-after:marker:2"), "kill-after:marker:2")
    write_jsonl(tmp_path / "p.jsonl", [chat(i, f"another question {i}") for i in range(LINES)])
    refused = run_cli(document, out, sim.url)
    assert refused.returncode == EXIT_USAGE
    assert "datasets[p].source" in refused.stderr and "its size changed" in refused.stderr
    assert re.search(r"since \d+ slots were committed against it", refused.stderr)
    assert "another output URI" in refused.stderr


@pytest.fixture
def demo_model_sim(demo_model: Path):
    """A slower simulator: a run takes long enough for a second one to meet it."""
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    with SimServer(SimConfig(model_path=str(demo_model), time_scale=100.0, max_running_requests=4)) as server:
        yield server

