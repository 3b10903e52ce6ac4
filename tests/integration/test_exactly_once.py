"""Exactly once per input line, proven by killing `tokenmill run` (SIGKILL, a real subprocess) at chosen steps of
the commit protocol, deterministically (TOKENMILL_FAULT, runner/tokenmill_runner/store/faults.py), with duplicate sample
ids far apart; and runs that gave samples up or lost their servers never end looking like success."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.recount import as_counter, recount
from tokenmill_runner.generate.results import ServersUnavailable
from tokenmill_runner.generate.summary import EXIT_GIVEN_UP, EXIT_OK, EXIT_SERVERS_UNAVAILABLE, exit_code
from tokenmill_runner.prepare import prepare
from tokenmill_runner.spec.config import RunnerConfig
from tokenmill_runner.spec.resource import load_spec_file
from tokenmill_runner.store.faults import FAULT_ENV
from tokenmill_runner.store.ledger import RETRYABLE_REASONS, Slot
from tokenmill_runner.store.marker_names import shard_id_of
from tokenmill_runner.store.markers import marker_keys, read_markers
from tokenmill_runner.store.shards import leftovers, read_ledger
from tokenmill_runner.store.storage import LocalStorage, open_storage
from tokenmill_runner.store.token_counts import dataset_frequencies

from .test_run import assert_exactly_once, committed_errors, malformed_rows
from .workloads import chat, spec_document, write_jsonl, write_spec

FIRED = re.compile(rf"{FAULT_ENV}: (\S+) reached at (\S+),")


@pytest.fixture
def sim(demo_model: Path):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    # Short outputs at a high time scale: each run takes seconds, and a request never outlives 25 commits.
    with SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0, max_running_requests=32)) as server:
        yield server


def run_cli(spec: Path, out: Path, server: str, fault: str | None = None, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-m", "tokenmill_runner.cli", "-q", "run", str(spec), "--out", str(out),
                           "--server", server, *extra], capture_output=True, text=True, env=env, timeout=300)


def killed_at(done: subprocess.CompletedProcess, rule: str) -> str:
    """The object the fault point named; fails unless the run died of SIGKILL at exactly that rule."""
    assert done.returncode == -signal.SIGKILL, f"{rule} never fired (exit {done.returncode}): {done.stderr[-2000:]}"
    found = FIRED.search(done.stderr)
    assert found and found.group(1) == rule, done.stderr[-2000:]
    return found.group(2)


def outcomes_per_line(storage: LocalStorage, dataset: str) -> Counter[int]:
    """How many committed outcomes (rows and error records) name each line, over every marker."""
    lines: Counter[int] = Counter()
    for marker in read_markers(storage, dataset):
        lines.update(marker["samples"]["line"])
        lines.update(marker["failed"]["line"])
    return lines


def source_with_duplicates_far_apart(lines: int, duplicates: dict[int, int]) -> list[dict[str, Any]]:
    """`lines` chat rows; duplicates maps a line to the earlier line whose sample id it repeats."""
    return [chat(duplicates.get(line, line)) for line in range(1, lines + 1)]


def test_a_kill_between_a_duplicates_error_and_its_marker_loses_nothing(tmp_path, demo_model, sim):
    # Lines 5 and 900 share a sample id, 895 lines (about 36 shards) apart. The review's bug: line 5's row commits,
    # the runner dies before line 900's duplicate error commits, and on restart line 900 counted as done by id.
    write_jsonl(tmp_path / "p.jsonl", source_with_duplicates_far_apart(1000, {900: 5}))
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "p", "source": "p.jsonl"}], "out",
        runner={"concurrency": 16, "shardMaxSamples": 25, "shardMaxSeconds": 30}))
    out = tmp_path / "out"
    storage = LocalStorage(out)
    # The only error of this source is line 900's, so the first error-file write is the one that holds it.
    errors_key = killed_at(run_cli(spec, out, sim.url, "kill-after:errors:1"), "kill-after:errors:1")
    assert storage.exists(errors_key) and shard_id_of(errors_key) not in committed_shards(storage, "p")
    assert [(e["line"], e["reason"]) for e in map(orjson.loads, storage.get(errors_key).splitlines())] == \
        [(900, "duplicate_sample_id")]
    ledger = read_ledger(storage, "p", 1000)
    assert ledger.outcome(Slot(5)) == "row", "line 5's row was committed before the kill"
    assert ledger.outcome(Slot(900)) is None, "line 900's outcome was not"

    done = run_cli(spec, out, sim.url)
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    assert outcomes_per_line(storage, "p") == Counter(range(1, 1001))
    assert [(e["line"], e["reason"]) for e in committed_errors(storage, "p")] == [(900, "duplicate_sample_id")]
    assert "already appeared on line 5" in committed_errors(storage, "p")[0]["message"]
    assert_exactly_once(storage, "p", {f"s{i:04d}" for i in range(1, 1001) if i != 900})
    assert not list(leftovers(storage, "p"))


# Each kill lands at the named write of that process's commits; the store must show exactly that step's effect.
KILLS = [
    ("kill-after:errors:1", "errors file written, marker not"),
    ("kill-after:counts:2", "data and loss-token counts written, marker not"),
    ("kill-before:data:2", "nothing of that shard written"),
    ("kill-after:data:3", "data written, errors and marker not"),
    ("kill-before:marker:3", "data and errors written, marker not"),
    ("kill-after:marker:2", "marker written: the shard counts"),
]


def committed_shards(storage: LocalStorage, dataset: str) -> set[str]:
    """Shard ids with a commit marker (markers are named <time>-<shard id>.json, marker_names.py)."""
    return {shard_id_of(key) for key in marker_keys(storage, dataset)}


def check_kill_point(storage: LocalStorage, rule: str, key: str) -> None:
    shard_id = shard_id_of(key)
    committed = shard_id in committed_shards(storage, "p")
    written = [k for k in (f"p/shards/{shard_id}.parquet", f"p/errors/{shard_id}.jsonl") if storage.exists(k)]
    if rule.startswith("kill-before:data"):
        assert not storage.exists(key) and not committed
    elif rule.startswith("kill-before:marker"):
        assert "/commits/" in key and shard_id_of(key) == shard_id and not committed and written
        assert set(written) <= set(leftovers(storage, "p"))
    elif rule.startswith("kill-after:marker"):
        assert storage.exists(key) and committed and any(m["shard_id"] == shard_id for m in read_markers(storage, "p"))
    else:
        assert storage.exists(key) and not committed, (rule, key)
        assert key in set(leftovers(storage, "p")), "an uncommitted write is a leftover, invisible to readers"


def test_kills_at_every_step_of_the_commit_protocol_lose_and_duplicate_nothing(tmp_path, demo_model, sim):
    rows, expected_errors, good = malformed_rows()  # lines 1-30: one bad row of each kind, a duplicate at 13
    rows += source_with_duplicates_far_apart(1000, {700: 40, 990: 31})[30:]
    good |= {f"s{i:04d}" for i in range(31, 1001) if i not in (700, 990)}
    expected_errors |= {700: "duplicate_sample_id", 990: "duplicate_sample_id"}
    write_jsonl(tmp_path / "p.jsonl", rows)
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "p", "source": "p.jsonl"}], "out", server={"contextLength": 4096},
        runner={"concurrency": 16, "shardMaxSamples": 25, "shardMaxSeconds": 1}))
    out = tmp_path / "out"
    storage = LocalStorage(out)
    for rule, effect in KILLS:
        key = killed_at(run_cli(spec, out, sim.url, rule), rule)
        check_kill_point(storage, rule, key)
        print(f"{rule}: {key} ({effect})", file=sys.stderr)

    final = run_cli(spec, out, sim.url)
    assert final.returncode == EXIT_OK, final.stderr[-3000:]
    assert outcomes_per_line(storage, "p") == Counter(range(1, 1001)), "every line exactly one final outcome"
    assert_exactly_once(storage, "p", good)
    assert {e["line"]: e["reason"] for e in committed_errors(storage, "p")} == expected_errors
    assert not list(leftovers(storage, "p")) and not [p for p in out.rglob("*") if ".tmp-" in p.name]
    report = orjson.loads(storage.get("report/report.json"))
    loss_tokens, _ = recount(storage, "p")  # from the shards' rows, each slot once
    assert as_counter(dataset_frequencies(storage, "p")) == loss_tokens, "the counts written with the shards"
    assert report["vocabulary"]["datasets"]["p"]["loss_tokens"] == sum(loss_tokens.values())
    report = report["datasets"]["p"]
    assert (report["slots"], report["samples"], report["errors"]) == (1000, len(good), len(expected_errors))
    assert report["without_outcome"] == 0 and report["given_up"] == 0
    assert re.search(r"^p\s+1000\s+\d+\s+\d+", final.stdout, re.MULTILINE), final.stdout


def test_given_up_samples_exit_3_until_retried(tmp_path, demo_model, sim):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(20)] + [b"{broken"])
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "p", "source": "p.jsonl"}], "out",
        runner={"concurrency": 8, "maxAttempts": 2, "shardMaxSamples": 5, "shardMaxSeconds": 1}))
    out = tmp_path / "out"
    # A live server that aborts every request (finish_reason abort: SGLang's answer when it drops a request).
    aborting = SimConfig(model_path=str(demo_model), time_scale=5000.0, fault_abort_rate=1.0)
    with SimServer(aborting) as broken:
        gave_up = run_cli(spec, out, broken.url)
    assert gave_up.returncode == EXIT_GIVEN_UP, gave_up.stderr[-2000:]
    line = re.search(r"^20 samples given up: (\w+) 20; run again with `tokenmill run --retry-failed` .*"
                     r"tokenmill\.io/retry-failed.*$", gave_up.stdout, re.MULTILINE)
    assert line and line.group(1) in RETRYABLE_REASONS, gave_up.stdout
    report = orjson.loads(LocalStorage(out).get("report/report.json"))
    assert report["verdict"] == "fail"
    [given_up] = [f for f in report["findings"] if f["check"] == "given_up"]
    assert given_up["value"] == 20 and "--retry-failed" in given_up["message"]
    assert not [f for f in report["findings"] if f["check"] == "errors"], "1 bad line of 21 is not an input problem"

    again = run_cli(spec, out, sim.url)
    assert again.returncode == EXIT_GIVEN_UP, "a plain rerun skips given-up samples and still says so"
    assert re.search(r"^20 samples given up", again.stdout, re.MULTILINE)
    retried = run_cli(spec, out, sim.url, None, "--retry-failed")
    assert retried.returncode == EXIT_OK, retried.stdout + retried.stderr[-2000:]
    assert "given up" not in retried.stdout
    report = orjson.loads(LocalStorage(out).get("report/report.json"))
    assert not [f for f in report["findings"] if f["check"] in ("given_up", "complete")]
    assert report["datasets"]["p"]["errors_by_reason"] == {"invalid_json": 1}


class OutageAfter:
    """Stands in for the client when its outage budget runs out after `answers` answers: it raises
    ServersUnavailable, as the client does when no server was live for longer than the budget (a-client.md)."""

    def __init__(self, client: Any, answers: int) -> None:
        self.client, self.answers, self.answered = client, answers, 0

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], seed_for: Any = None,
                       affinity: Any = None) -> Any:
        if self.answered >= self.answers:
            raise ServersUnavailable("no server was live for 7200 s (spec.runner outage budget)")
        self.answered += 1
        return await self.client.generate(input_ids, sampling_params, seed_for, affinity)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_servers_unavailable_past_the_budget_stop_the_run_without_writing_anything_off(tmp_path, demo_model, sim):
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(100)])
    spec = load_spec_file(write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "p", "source": "p.jsonl"}], "out",
        runner={"concurrency": 8, "shardMaxSamples": 10, "shardMaxSeconds": 1}))).spec
    config = RunnerConfig(spec=spec, servers=[sim.url], output_uri=str(tmp_path / "out"))

    async def run(answers: int | None):
        runner = await prepare(config, api_key=None)
        if answers is not None:
            runner.client = OutageAfter(runner.client, answers)
        return await runner.run()

    stopped = asyncio.run(run(30))
    assert exit_code(stopped) == EXIT_SERVERS_UNAVAILABLE and "7200 s" in (stopped.servers_unavailable or "")
    storage = open_storage(str(tmp_path / "out"))
    ledger = read_ledger(storage, "p", 100)
    assert ledger.failed == 0, "an outage writes nothing off"
    assert 0 < ledger.completed <= 30 and stopped.datasets[0].without_outcome == 100 - ledger.completed
    finished = asyncio.run(run(None))
    assert exit_code(finished) == EXIT_OK and finished.datasets[0].skipped == ledger.completed
    assert_exactly_once(storage, "p", {f"s{i:04d}" for i in range(100)})
    assert read_ledger(storage, "p", 100).failed == 0
