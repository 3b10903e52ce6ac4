"""A model of a run's lifecycle for hypothesis' stateful testing: random interleavings of what users and clusters do
to a run (spec edits, kills at every kill point of the commit protocol, operator restarts, server outages, a second
writer, a replaced source, two runs started together, a writer paused between a shard's data and its marker
and taken over, a lease whose holder's clock runs a day ahead), driving the real `tokenmill run` (a subprocess against the simulator), the real ledger,
run manifest and report, and the operator's real observation and decision functions. After every step the
invariants of docs/reliability.md must hold; they are checked against a recount made straight from the commit
markers, not through the code under test.

Used by tests/integration/test_lifecycle_model.py (a fixed seed, a small budget) and hack/bench/bench_lifecycle_model.py
(long, printing how many steps and states it explored).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import yaml
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenmill_operator.decide.facts import JobState, Observed, ProgressFacts
from tokenmill_operator.decide.lifecycle import condition_status, decide
from tokenmill_operator.decide.status import DatasetGenerationStatus
from tokenmill_operator.observe import gather
from tokenmill_operator.observe.gather import OutputIndex, observe_progress
from tokenmill_runner.report.files import load_ledger
from tokenmill_runner.report.validation import build_report
from tokenmill_runner.store.faults import FAULT_ENV, RELEASE_ENV
from tokenmill_runner.store.lease import LEASE, Lease, LeaseKeeper, LeaseTimes, acquire
from tokenmill_runner.store.manifest import Owner, RunManifest, read_manifest
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.storage import LocalStorage

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "demo-model"
LINES = 12
BAD_LINE = 5  # an invalid row: every run records its error, a final outcome of its slots
KILL_POINTS = [None, "kill-after:data:1", "kill-after:errors:1", "kill-before:marker:2", "kill-after:marker:1",
               "kill-after:marker:3"]
# The operator's passes once a Job ended, its full listing of the markers a step a pass (gather.SWEEP_NAMES names,
# MARKERS_PER_PASS reads): a model's few markers take one or two, or a few dozen at the bounds of
# `operator_decides_the_job_ended` (a restarted operator counting them from the first).
PASSES_TO_LIST = 200
RUN_TIMEOUT_S = 180  # every run ends within this, whatever was done to it (the bound the model checks)
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_GIVEN_UP, EXIT_SERVERS_DOWN, EXIT_LEASE_LOST = 0, 1, 2, 3, 4, 6
# The lease's periods for the model's runs: renewals every 2 s, so a watcher sees a live holder renew within 2 s and
# a gone one's lease is free after 12 s of watching.
LEASE_STALE_S = 12.0


class Counts:
    """What the machine explored, over every example (the bench prints it)."""

    steps: Counter[str] = Counter()
    states: set[tuple[Any, ...]] = set()


# The invalid row is long, so that a same-size edit after it lies past the first 64 KiB (which the identity check of
# a87e82b compared, with the size, and nothing else).
BAD_ROW = '{"sample_id": "broken", "messages": [' + " " * (70 * 1024)
# Versions of a source: the original, another file under the same name, the original with blank lines, and the
# original with a row removed and one of the same byte length appended (the size and the first 64 KiB unchanged).
VERSIONS = (0, 1, 2, 3)
EDITED_LINE = 8


def _row(dataset: str, line: int, version: int) -> str:
    text = f"{dataset} question {line} (version {version}): what is {line} + {version}?"
    return json.dumps({"sample_id": f"{dataset}-{line}", "messages": [{"role": "user", "content": text}]})


def source_rows(dataset: str, version: int) -> list[str]:
    """The source's lines ("" a blank one)."""
    rows = [BAD_ROW if line == BAD_LINE else _row(dataset, line, int(version == 1)) for line in range(1, LINES + 1)]
    if version == 2:
        return [*rows[:3], "", *rows[3:], ""]
    if version == 3:
        removed = rows.pop(EDITED_LINE - 1)
        empty = {"sample_id": f"{dataset}-new", "messages": [{"role": "user", "content": ""}]}
        empty["messages"][0]["content"] = "z" * (len(removed) - len(json.dumps(empty)))
        return [*rows, json.dumps(empty)]
    return rows


def recount(storage: LocalStorage, dataset: str) -> tuple[Counter[tuple[int, int]], set[tuple[int, int]]]:
    """(rows per slot, slots with any outcome) straight from the dataset's commit markers."""
    rows: Counter[tuple[int, int]] = Counter()
    settled: set[tuple[int, int]] = set()
    for marker in read_markers(storage, dataset):
        samples, failed = marker["samples"], marker["failed"]
        slots = list(zip(samples["line"], samples.get("sample_index") or [0] * len(samples["line"]), strict=True))
        rows.update(slots)
        settled.update(slots)
        settled.update(zip(failed["line"], failed.get("sample_index") or [0] * len(failed["line"]), strict=True))
    return rows, settled


def ended_run_passes(storage: LocalStorage, operator: OutputIndex,
                     now: datetime) -> Iterator[tuple[ProgressFacts | None, RunManifest | None]]:
    """The operator's passes once the runner Job ended (`full`), until its full listing of the markers reached the
    end (or there is no run.json): what each pass observed."""
    for _ in range(PASSES_TO_LIST):
        progress, manifest = observe_progress(storage, operator, now, now, full=True)
        yield progress, manifest
        if manifest is None or (progress is not None and not progress.listing_incomplete):
            return  # (no progress but a run.json: the operator is counting the markers, `OutputIndex.counting`)
    raise AssertionError(f"the full listing did not end in {PASSES_TO_LIST} passes")


class LifecycleModel(RuleBasedStateMachine):
    server_url: str = ""  # the simulator every run talks to (set by whoever runs the machine)

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tokenmill-model-"))
        self.out = self.root / "out"
        self.storage = LocalStorage(self.out)
        self.layout: dict[str, dict[str, Any]] = {"a": {"samples": 1, "limit": None}}
        self.versions = {"a": 0, "b": 0}
        self.recorded: dict[str, int] = {}  # the source version run.json records per dataset (kept when retired)
        self.operator = OutputIndex()
        self.lease_steps: set[str] = set()  # the lease's races, each at most once per example (they wait seconds)
        self.hidden_states: dict[str, Any] | None = None  # spec.hiddenStates (composed_model.py asks for them)
        self.model, self.max_new_tokens = MODEL, 512
        for name in self.versions:
            self._write_source(name)

    # -- the world ---------------------------------------------------------------------------------------------
    def _write_source(self, name: str) -> None:
        (self.root / f"{name}.jsonl").write_text("\n".join(source_rows(name, self.versions[name])) + "\n")

    def _spec(self, **runner: Any) -> Path:
        datasets = [{"name": name, "source": f"{name}.jsonl", "samples": d["samples"],
                     **({"limit": d["limit"]} if d["limit"] else {})} for name, d in sorted(self.layout.items())]
        document = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "model"},
                    "spec": {"model": {"path": str(self.model)}, "sampling": {"maxNewTokens": self.max_new_tokens},
                             "datasets": datasets,
                             "runner": {"concurrency": 8, "shardMaxSamples": 4, "shardMaxSeconds": 30,
                                        "maxAttempts": 3, **runner},
                             "output": {"uri": "out"}}}
        if self.hidden_states is not None:
            document["spec"]["hiddenStates"] = self.hidden_states
        path = self.root / "spec.yaml"
        path.write_text(yaml.safe_dump(document))
        return path

    def _command(self, server: str, fault: str | None = None, **runner: Any) -> tuple[list[str], dict[str, str]]:
        env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
        env["TOKENMILL_LEASE_STALE_SECONDS"] = str(LEASE_STALE_S)
        if fault:
            env[FAULT_ENV] = fault
        return ([sys.executable, "-m", "tokenmill_runner.cli", "-q", "run", str(self._spec(**runner)),
                 "--out", str(self.out), "--server", server, "--server-wait", "2"], env)

    def _run(self, server: str, fault: str | None = None, **runner: Any) -> subprocess.CompletedProcess[str]:
        command, env = self._command(server, fault, **runner)
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)

    def _start(self, fault: str | None = None, machine: str | None = None,
               release: Path | None = None, **runner: Any) -> subprocess.Popen[str]:
        command, env = self._command(self.server_url, fault, **runner)
        if release:
            env[RELEASE_ENV] = str(release)
        if machine:  # its own cache folder: to the other runs, a process of another machine
            env["TOKENMILL_CACHE"] = str(self.root / f"cache-{machine}")
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def _replaced(self) -> bool:
        """A dataset of the spec whose source is not the one its commits were made against: the run must refuse."""
        return any(self.recorded.get(name, self.versions[name]) != self.versions[name]
                   and recount(self.storage, name)[1] for name in self.layout)

    def _recorded_now(self) -> None:
        """A run that got past its checks recorded each dataset's source in run.json."""
        self.recorded.update({name: self.versions[name] for name in self.layout})

    def _note(self, step: str) -> None:
        Counts.steps[step] += 1
        Counts.states.add((step, tuple(sorted((n, d["samples"], d["limit"]) for n, d in self.layout.items())),
                           tuple(sorted(self.versions.items()))))

    # -- what users and clusters do -----------------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        self._note("start")

    @rule(name=st.sampled_from(["a", "b"]), samples=st.integers(1, 3), limit=st.sampled_from([None, 4, 8]),
          toggle=st.booleans())
    def edit(self, name: str, samples: int, limit: int | None, toggle: bool) -> None:
        """samples and limit up or down; a dataset added or removed."""
        if toggle and name in self.layout and len(self.layout) > 1:
            del self.layout[name]
        elif toggle or name not in self.layout:
            self.layout.setdefault(name, {"samples": 1, "limit": None})
        if name in self.layout:
            self.layout[name] = {"samples": samples, "limit": limit}
        self._note("edit")

    @rule(name=st.sampled_from(["a", "b"]), version=st.sampled_from(VERSIONS))
    def replace_or_restore_source(self, name: str, version: int) -> None:
        """Another file under the same name, blank lines added, a same-size edit, or the original back."""
        self.versions[name] = version
        self._write_source(name)
        self._note(["restore_source", "replace_source", "blank_lines", "same_size_edit"][version])

    @rule()
    def run_to_the_end(self) -> None:
        self.run(None)

    @rule(fault=st.sampled_from(KILL_POINTS[1:]))
    def run(self, fault: str | None) -> None:
        replaced = self._replaced()
        done = self._run(self.server_url, fault)
        self._note(f"run:{fault or 'to the end'}")
        if replaced:
            assert done.returncode == EXIT_USAGE and ".source" in done.stderr, done.stderr[-1500:]
            return
        self._recorded_now()
        assert done.returncode in (EXIT_OK, EXIT_GIVEN_UP, -9), done.stderr[-1500:]
        if done.returncode == EXIT_OK:
            self._assert_settled("tokenmill run exited 0")

    @rule()
    def outage(self) -> None:
        """No server at all: the run waits, gives up on the servers and writes nothing off."""
        before, replaced = self._failures(), self._replaced()
        done = self._run("http://127.0.0.1:9", outageBudgetSeconds=1)
        self._note("outage")
        if replaced:
            assert done.returncode == EXIT_USAGE and ".source" in done.stderr, done.stderr[-1500:]
        else:
            self._recorded_now()
            assert done.returncode in (EXIT_FAILED, EXIT_SERVERS_DOWN), done.stderr[-1500:]
        assert self._failures() == before, "an outage wrote samples off"

    @rule(skew_s=st.sampled_from([0, -90, 90]))
    def second_writer(self, skew_s: int) -> None:
        """Another owner writes the output and renews its lease, its holder named after this host with a pid that
        does not exist, and its clock `skew_s` off this one's: the run watches, sees it renewed, is refused and
        commits nothing (staleness is the lease unchanged while watched, never a comparison of clocks)."""
        markers = len(list(self.out.glob("*/commits/*.json")))
        times = LeaseTimes(LEASE_STALE_S)
        owner, holder = Owner(kind="cli", name="intruder"), f"{socket.gethostname()}:999999999:intruder"
        if skew_s:
            done = self._run_against_a_skewed_holder(owner, holder, timedelta(seconds=skew_s), times)
        else:
            intruder = acquire(self.storage, owner, holder, times=times)
            with LeaseKeeper(self.storage, intruder, times=times):
                done = self._run(self.server_url)
        self._note(f"second_writer:{skew_s:+d}s")
        assert done.returncode == EXIT_USAGE and "tokenmill run 'intruder'" in done.stderr, done.stderr[-1500:]
        assert len(list(self.out.glob("*/commits/*.json"))) == markers

    def _run_against_a_skewed_holder(self, owner: Owner, holder: str, skew: timedelta,
                                     times: LeaseTimes) -> subprocess.CompletedProcess[str]:
        """A run while a holder whose clock is off by `skew` renews the lease every renewal period."""
        stop = threading.Event()

        def renew() -> None:
            acquired = datetime.now(UTC) + skew
            while True:
                now = datetime.now(UTC) + skew
                self.storage.put(LEASE, Lease(owner, holder, acquired, now).encode(times))
                if stop.wait(times.renew_every_s):
                    return

        keeper = threading.Thread(target=renew, daemon=True)
        keeper.start()
        try:
            return self._run(self.server_url)
        finally:
            stop.set()
            keeper.join()
            self.storage.delete(LEASE)  # the holder gone, its lease released

    @precondition(lambda self: "lease_from_the_future" not in self.lease_steps)
    @rule()
    def lease_from_the_future(self) -> None:
        """A gone writer's lease, renewed a day ahead by its clock: it is free once unchanged while watched."""
        self.lease_steps.add("lease_from_the_future")
        replaced = self._replaced()
        ahead = datetime.now(UTC) + timedelta(days=1)
        self.storage.put(LEASE, Lease(Owner(kind="cli", name="gone"), "elsewhere:1:x", ahead, ahead).encode())
        done = self._run(self.server_url)
        self._note("lease_from_the_future")
        if replaced:
            assert done.returncode == EXIT_USAGE and ".source" in done.stderr, done.stderr[-1500:]
            return
        self._recorded_now()
        assert done.returncode in (EXIT_OK, EXIT_GIVEN_UP), done.stderr[-1500:]

    @precondition(lambda self: "two_runs_at_once" not in self.lease_steps)
    @rule()
    def two_runs_at_once(self) -> None:
        """Two runs of this spec started together: one writes, the other is refused or comes after it."""
        self.lease_steps.add("two_runs_at_once")
        replaced = self._replaced()
        runs = [self._start(), self._start()]
        ended = [(run.wait(timeout=RUN_TIMEOUT_S), run.communicate()[1]) for run in runs]
        self._note("two_runs_at_once")
        if replaced:
            return
        self._recorded_now()
        codes = sorted(code for code, _ in ended)
        assert all(code in (EXIT_OK, EXIT_USAGE, EXIT_GIVEN_UP) for code in codes), ended
        assert EXIT_USAGE not in codes or any("is being written by" in err for _, err in ended), ended

    @precondition(lambda self: "paused_writer_taken_over" not in self.lease_steps)
    @rule()
    def paused_writer_taken_over(self) -> None:
        """A writer stops (SIGSTOP) between a shard's data and its marker; a second run takes the output over after
        the stale period and finishes; the first, resumed, commits nothing more and exits 6."""
        self.lease_steps.add("paused_writer_taken_over")
        replaced = self._replaced()
        # A SIGSTOP stops every thread: one caught inside another shard's marker PUT lands that marker after the
        # takeover, and the taker's seal makes it count for nobody (store/seals.py; a CI run without seals hit it).
        paused = self._start("pause-after:data:1", machine="elsewhere")
        _, status = os.waitpid(paused.pid, os.WUNTRACED)  # until it stopped, or ended (nothing to generate)
        if not os.WIFSTOPPED(status):
            paused.returncode = os.waitstatus_to_exitcode(status)
            paused.communicate()
            self._note("paused_writer:nothing")
            return
        try:
            taker = self._run(self.server_url)
        finally:
            paused.send_signal(signal.SIGCONT)
        code, stderr = paused.wait(timeout=RUN_TIMEOUT_S), paused.communicate()[1]
        self._note("paused_writer_taken_over")
        if replaced:
            return
        self._recorded_now()
        assert taker.returncode in (EXIT_OK, EXIT_GIVEN_UP), taker.stderr[-1500:]
        assert code == EXIT_LEASE_LOST and "lease lost" in stderr, stderr[-1500:]

    @precondition(lambda self: "cut_off_writer_taken_over" not in self.lease_steps)
    @rule()
    def cut_off_writer_taken_over(self) -> None:
        """A live writer whose PUTs hang after a shard's data (the store cut off: its renewals hang too); a second
        run takes the output over after the stale period and finishes; the first, its PUTs answered again, commits
        nothing more and exits 6."""
        self.lease_steps.add("cut_off_writer_taken_over")
        replaced = self._replaced()
        release = self.root / "store-reachable-again"
        release.unlink(missing_ok=True)
        writer = self._start("stall-after:data:1", machine="elsewhere", release=release)
        assert writer.stderr is not None
        announced = ""
        while "stall-after:data:1 reached" not in announced:  # or "": it ended without a shard (nothing to do)
            line = writer.stderr.readline()
            announced += line
            if not line:
                break
        if "stall-after:data:1 reached" not in announced:
            code, rest = writer.wait(timeout=RUN_TIMEOUT_S), writer.communicate()[1]
            self._note("cut_off_writer:nothing")
            assert replaced or code in (EXIT_OK, EXIT_GIVEN_UP), announced + rest[-1500:]
            return
        try:
            taker = self._run(self.server_url)
        finally:
            release.touch()
        code, stderr = writer.wait(timeout=RUN_TIMEOUT_S), writer.communicate()[1]
        self._note("cut_off_writer_taken_over")
        self._recorded_now()
        assert taker.returncode in (EXIT_OK, EXIT_GIVEN_UP), taker.stderr[-1500:]
        assert code == EXIT_LEASE_LOST and "lease lost" in stderr, stderr[-1500:]

    @precondition(lambda self: (self.out / "run.json").exists())
    @rule(restarted=st.booleans(), running=st.integers(0, 3), bounded=st.booleans())
    def operator_decides_the_job_ended(self, restarted: bool, running: int, bounded: bool) -> None:
        """The operator's passes (after a restart of the operator, or not) once the runner Job that wrote run.json
        ended, `running` of them before it ended: Reporting only when settled, and a terminal decision holds no GPU.
        `bounded`: 2 marker reads and 3 names a pass, so a restarted operator's count of the markers from the first,
        and the full listing, take passes of their own, the Job ending between them."""
        if restarted:
            self.operator = OutputIndex()
        now = datetime.now(UTC)
        bounds = dict(MARKERS_PER_PASS=2, SWEEP_NAMES=3) if bounded else {}
        with mock.patch.multiple(gather, **bounds):  # type: ignore[arg-type]
            for ordinal in range(running):
                decision = self._operator_pass(now, full=False)
                assert decision.status.phase not in ("Succeeded", "Failed") and not decision.write_report
                if self.operator.counting:  # its Job began 30 minutes ago: partial figures would look stalled
                    if ordinal == 0:
                        self._note("operator_counting")
                    assert condition_status(decision.status.conditions, "Stalled") != "True", decision
                    assert decision.status.progress == DatasetGenerationStatus().progress, "no partial figures"
            for progress, manifest in ended_run_passes(self.storage, self.operator, now):
                decision = self._decide(now, progress, manifest, JobState(
                    succeeded=1, complete=True, hash=manifest.spec_hash if manifest else None))
                # The count's and the full listing's steps, a pass each: nothing that ends the run before the last.
                assert not (progress is None or progress.listing_incomplete) or (
                    not decision.write_report and decision.status.phase not in ("Succeeded", "Failed")), decision
        self._note("operator_decides")
        if decision.write_report:
            self._assert_settled("the operator decided to report")
        if decision.status.phase in ("Succeeded", "Failed"):
            assert decision.server_replicas == 0 and decision.delete_server, "a terminal run holds GPUs"

    def _operator_pass(self, now: datetime, full: bool) -> Any:
        """A pass of the operator while the runner Job runs (as far as it knows)."""
        progress, manifest = observe_progress(self.storage, self.operator, now, now - timedelta(minutes=30), full=full)
        return self._decide(now, progress, manifest, JobState(active=1, hash=manifest.spec_hash if manifest else None),
                            started=now - timedelta(minutes=30))

    def _decide(self, now: datetime, progress: ProgressFacts | None, manifest: RunManifest | None, job: JobState,
                started: datetime | None = None) -> Any:
        assert manifest is not None, "run.json was there"
        return decide(Observed(generation=1, now=now, suspended=False, previous=DatasetGenerationStatus(),
                               name="model", job=job, job_started=started, progress=progress,
                               counting=progress is None and self.operator.counting))

    # -- invariants -------------------------------------------------------------------------------------------
    def _failures(self) -> int:
        return sum(len(m["failed"]["line"]) for name in ("a", "b") for m in read_markers(self.storage, name))

    def _assert_settled(self, why: str) -> None:
        manifest = read_manifest(self.storage)
        assert manifest is not None, why
        for name, layout in manifest.datasets.items():
            _, settled = recount(self.storage, name)
            within = layout.within()  # blank lines are no slot's line
            wanted = {(line, index) for line in range(1, layout.last_line + 1) if within is None or within[line - 1]
                      for index in range(layout.samples)}
            assert wanted <= settled, f"{why}, yet {name} lacks {sorted(wanted - settled)[:5]}"

    @invariant()
    def no_slot_has_two_rows(self) -> None:
        for name in ("a", "b"):
            rows, _ = recount(self.storage, name)
            assert all(count == 1 for count in rows.values()), f"{name}: {rows.most_common(3)}"

    @invariant()
    def no_marker_points_at_a_missing_file(self) -> None:
        for name in ("a", "b"):
            for marker in read_markers(self.storage, name):
                for key in (marker.get("data"), marker.get("errors")):
                    assert not key or (self.out / name / key).is_file(), f"{name}/{key} is gone"

    @invariant()
    def a_passing_report_means_every_slot_is_settled(self) -> None:
        if not (self.out / "run.json").exists():
            return
        report = build_report(load_ledger(self.storage))
        if report["verdict"] != "fail":
            self._assert_settled(f"the report's verdict is {report['verdict']}")
