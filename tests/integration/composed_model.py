"""The lifecycle model (lifecycle_model.py) of a DatasetGeneration: runner Jobs of 1 to 4 workers (each Job of its own
parallelism, as after an edit of spec.runner.parallelism), the hidden-state passes (the aux layers, and SpecForge's
final state on a server relaunched for it, the pass chosen by the operator's own decision), a worker killed at every
step of the commit protocol and of the capture pass, servers that answer 503 and drop connections, a dead replica
beside a live one, retries (the operator's annotation: --retry-failed), and a worker whose marker is in flight while
another owner takes the output over. Every process is the real `tokenmill run`; the operator's decisions are its real
`decide` over what its real gather functions read.

The invariants are docs/reliability.md's three rules, checked against a recount made from the store (the records
through the one listing that applies the seals, each slot's owner from the source's lines), not through the exit
codes, the report or the decisions under test:
- ownership: no slot has two rows, no marker names a missing file (the parent's invariants), and no state marker names
  a file that is missing or of another size;
- one split: after a Job none of whose workers died, every slot is settled and every committed sample has the states
  of each pass so far, or their capture recorded as failed: nothing is left without an owner;
- one definition of done: a worker that exits 0 leaves its share (store/work_split.py, recounted from the source)
  settled with nothing given up and every state there; a report that passes, and an operator that says Succeeded,
  mean the whole run is complete; the operator moves to the final-state pass only once every committed sample has its
  aux states.

Used by tests/integration/test_lifecycle_model.py (a fixed order of the steps, then a seeded draw under a wall-clock
budget).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from tokenmill_operator.act.report import write_report_status
from tokenmill_operator.decide.facts import JobState, Observed
from tokenmill_operator.decide.lifecycle import decide
from tokenmill_operator.decide.states_passes import passes_of
from tokenmill_operator.decide.status import DatasetGenerationStatus, StatesPass
from tokenmill_operator.observe.gather import observe_progress, states_completion
from tokenmill_runner.facts.hidden_states import kinds_needed
from tokenmill_runner.report.files import compute_report
from tokenmill_runner.spec.resource import load_spec_file
from tokenmill_runner.store.hidden_states import KINDS, captured_keys, failed_keys, sample_key, state_markers
from tokenmill_runner.store.ledger import RETRYABLE_REASONS
from tokenmill_runner.store.manifest import read_manifest
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.storage import LocalStorage
from tokenmill_runner.store.work_split import WorkShare

from .lifecycle_model import (
    EXIT_GIVEN_UP,
    EXIT_LEASE_LOST,
    EXIT_OK,
    EXIT_USAGE,
    MODEL,
    RUN_TIMEOUT_S,
    LifecycleModel,
    ended_run_passes,
)

DEAD = "http://127.0.0.1:9"  # nothing listens: a replica that is down for the whole Job
JOB_FAULTS = [None, "kill-after:data:1", "kill-before:marker:2", "kill-after:marker:1", "kill-before:states:1",
              "kill-after:states:2", "kill-before:states-marker:1", "kill-before:final-states:1",
              "kill-after:final-marker:1"]
SERVERS = ["one", "dead+live", "flaky"]
RETRIES = [None, "annotation", "spec"]  # --retry-failed: after the retry annotation, or from spec.runner.retryFailed
STATES = [None, "aux", "specforge"]


def small_model(folder: Path) -> Path:
    """The demo model with a hidden size of 64: its states (what each capture answers as JSON, and what the runner
    parses) are 16 times smaller than the demo's 1,024; its tokenizer and template are the demo's."""
    shutil.copytree(MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "intermediate_size": 128}))
    return folder


def listed(storage: LocalStorage, dataset: str, kind: str, failures: bool = False) -> set[str]:
    """The sample keys with a counted state marker (or failure record) of `kind`: through the one listing that
    applies the seals (a taken-over writer's late record counts for nobody), as the parent's recount reads shard
    markers through `read_markers`."""
    return (failed_keys if failures else captured_keys)(storage, dataset, KINDS[kind])


class ComposedModel(LifecycleModel):
    aux_url: str = ""  # a simulator serving the aux layers (the first pass's server)
    final_url: str = ""  # one started with --enable-return-hidden-states alone (the final pass's)
    flaky_url: str = ""  # an aux server answering 503 and dropping connections now and then
    deadline: float | None = None  # time.monotonic() past which no more runner Jobs start (the draw's budget)
    # run_job steps over the whole draw: the budget never stops the first, so how long the steps before it took on a
    # loaded machine cannot leave a draw without one (a CI run drew none in 45 s)
    jobs_run: int = 0
    model_path: Path | None = None  # the model the servers serve (small_model: states of a narrow hidden size)

    def __init__(self) -> None:
        super().__init__()
        if self.model_path is not None:
            self.model = self.model_path
        self.max_new_tokens = 48  # every committed sample is captured once per pass: short samples keep it cheap
        self.states_pass = "aux"  # the operator's pass: the first one until its decision moves on
        self.jobs = 0

    # -- the world -----------------------------------------------------------------------------------------------
    def _in_budget(self) -> bool:
        return self.deadline is None or time.monotonic() < self.deadline

    def _kinds(self) -> list[str]:
        """The kinds of states the spec asks for, up to the pass in progress."""
        if self.hidden_states is None:
            return []
        needed = kinds_needed(list(self.hidden_states.get("layouts") or []))
        return needed[:needed.index(self.states_pass) + 1]

    def _two_passes(self) -> bool:
        return self.hidden_states is not None and len(kinds_needed(list(self.hidden_states.get("layouts") or []))) > 1

    def _servers(self, servers: str) -> list[str]:
        live = self.final_url if self.states_pass == "final" else self.aux_url
        if servers == "flaky" and self.states_pass == "aux":
            return [self.flaky_url]
        return [DEAD, live] if servers == "dead+live" else [live]

    def _worker(self, index: int, count: int, job: str, servers: list[str], fault: str | None = None,
                retry: bool = False, release: Path | None = None) -> subprocess.Popen[str]:
        """Worker `index` of a runner Job of `count`, with the operator's flags (manifests.runner_args). Its output
        goes to files (a pipe nobody reads while the others run could fill and block it), but for a worker whose
        stall is watched for (`release`): its stderr is a pipe."""
        command, env = self._command(servers[0], fault)
        for url in servers[1:]:
            command += ["--server", url]
        command += ["--owner-uid", "uid-model", "--workers", str(count), "--worker-index", str(index),
                    "--job-hash", job]
        if self._two_passes():
            command += ["--states-pass", self.states_pass]
        if retry:
            command.append("--retry-failed")
        if release is not None:
            env["TOKENMILL_FAULT_RELEASE"] = str(release)
            return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        log = self.root / f"{job}-w{index}.log"
        with log.open("w") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)

    def _ended(self, process: subprocess.Popen[str], job: str, index: int) -> tuple[int, str]:
        code = process.wait(timeout=RUN_TIMEOUT_S)
        return code, (self.root / f"{job}-w{index}.log").read_text()

    def _restart_passes(self) -> None:
        """A spec edit or a retry: the operator starts again from the first pass (states_passes.current_pass)."""
        self.states_pass = "aux"

    # -- the recount ------------------------------------------------------------------------------------------
    def _sample_ids(self, name: str) -> dict[int, str | None]:
        """Each line's sample id as the source holds it now (None: a row without a valid one)."""
        ids: dict[int, str | None] = {}
        for line, text in enumerate((self.root / f"{name}.jsonl").read_text().splitlines(), start=1):
            try:
                row = json.loads(text) if text.strip() else None
            except json.JSONDecodeError:
                row = None
            sid = row.get("sample_id") if isinstance(row, dict) else None
            ids[line] = sid if isinstance(sid, str) and sid else None
        return ids

    def _outcomes(self, name: str) -> tuple[dict[tuple[int, int], str], dict[tuple[int, int], str]]:
        """(row's sample key per slot, final failure reason per slot without a row), from the markers."""
        rows: dict[tuple[int, int], str] = {}
        failures: dict[tuple[int, int], str] = {}
        for marker in read_markers(self.storage, name):
            samples, failed = marker["samples"], marker["failed"]
            indices = samples.get("sample_index") or [0] * len(samples["line"])
            for sid, line, index in zip(samples["sample_id"], samples["line"], indices, strict=True):
                rows[(line, index)] = sample_key(sid, index)
            indices = failed.get("sample_index") or [0] * len(failed["line"])
            for line, index, reason in zip(failed["line"], indices, failed["reason"], strict=True):
                if failures.get((line, index)) not in (None, *RETRYABLE_REASONS):
                    continue  # nothing runs a slot again after a failure caused by its input
                failures[(line, index)] = reason
        return rows, {slot: reason for slot, reason in failures.items() if slot not in rows}

    def _lacking(self, share: WorkShare | None = None, kinds: list[str] | None = None,
                 failed_states_count: bool = True) -> list[str]:
        """What the run (or `share` of it) lacks by the recount: slots without an outcome, slots given up, committed
        samples without the states of `kinds` (a recorded capture failure counts as an outcome when
        `failed_states_count`, else as lacking)."""
        manifest = read_manifest(self.storage)
        assert manifest is not None
        lacking: list[str] = []
        for name, layout in manifest.datasets.items():
            ids = self._sample_ids(name)
            within = layout.within()
            rows, failures = self._outcomes(name)
            for line in range(1, layout.last_line + 1):
                if (within is not None and not within[line - 1]) or (
                        share is not None and share.owner(ids.get(line), line) != share.index):
                    continue
                for index in range(layout.samples):
                    slot = (line, index)
                    if slot not in rows and slot not in failures:
                        lacking.append(f"{name} {slot}: no outcome")
                    elif failures.get(slot) in RETRYABLE_REASONS:
                        lacking.append(f"{name} {slot}: given up ({failures[slot]})")
            owned = {key for (line, _), key in rows.items()
                     if share is None or share.owner(ids.get(line), line) == share.index}
            for kind in kinds if kinds is not None else self._kinds():
                have = listed(self.storage, name, kind) | (listed(self.storage, name, kind, failures=True)
                                                           if failed_states_count else set())
                lacking += [f"{name} {key[:8]}: no {kind} states" for key in sorted(owned - have)]
        return lacking

    # -- what users, clusters and the operator do -----------------------------------------------------------------
    @rule(states=st.sampled_from(STATES))
    def ask_for_states(self, states: str | None) -> None:
        """spec.hiddenStates set, changed or removed: the next Job captures what every committed sample lacks."""
        self.hidden_states = None if states is None else {"layouts": ["specforge"] if states == "specforge" else []}
        self._restart_passes()
        self._note(f"states:{states}")

    @rule(name=st.sampled_from(["a", "b"]), samples=st.integers(1, 3), limit=st.sampled_from([None, 4, 8]),
          toggle=st.booleans())
    def edit(self, name: str, samples: int, limit: int | None, toggle: bool) -> None:
        super().edit(name, samples, limit, toggle)
        self._restart_passes()

    @precondition(lambda self: self._in_budget() or not ComposedModel.jobs_run)
    @rule(workers=st.integers(1, 4), killed=st.integers(0, 3), fault=st.sampled_from(JOB_FAULTS),
          servers=st.sampled_from(SERVERS), retry=st.sampled_from(RETRIES))
    def run_job(self, workers: int, killed: int, fault: str | None, servers: str, retry: str | None) -> None:
        """A runner Job of `workers` (each its own process, started together); worker `killed` (modulo the count)
        dies at `fault`; with --retry-failed after the operator's retry annotation (the run starts again from the
        first pass) or from spec.runner.retryFailed (every pass's Job has it); then the operator's decision on the
        ended Job."""
        ComposedModel.jobs_run += 1
        self.jobs += 1
        job = f"job-{self.jobs}"
        if retry == "annotation":
            self._restart_passes()
        replaced = self._replaced()
        urls = self._servers(servers)
        killed %= workers
        started = [self._worker(i, workers, job, urls, fault if i == killed else None, retry is not None)
                   for i in range(workers)]
        ended = [self._ended(process, job, index) for index, process in enumerate(started)]
        codes = [code for code, _ in ended]
        self._note(f"job:{workers}w:{self.states_pass}:{servers}:{fault or 'none'}")
        if replaced:
            assert all(code == EXIT_USAGE for code in codes), ended
            return
        self._recorded_now()
        for index, (code, stderr) in enumerate(ended):
            if code == -9 and index == killed and fault:
                continue
            assert code in (EXIT_OK, EXIT_GIVEN_UP), f"worker {index} of {workers}: exit {code}: {stderr[-1500:]}"
            if code == EXIT_OK:  # the one definition of done, for the worker's share
                lacking = self._lacking(WorkShare(index, workers), failed_states_count=False)
                assert not lacking, f"worker {index} of {workers} exited 0, yet its share lacks {lacking[:5]}"
        if all(code in (EXIT_OK, EXIT_GIVEN_UP) for code in codes):  # the one split: nothing left without an owner
            lacking = [item for item in self._lacking() if "given up" not in item]
            assert not lacking, f"a Job of {workers} ended with no worker lost, yet the run lacks {lacking[:5]}"
        self._operator_after(job, codes)

    def _operator_after(self, job: str, codes: list[int]) -> None:
        """The operator's pass once the Job ended: its next states pass only with every aux state there, Reporting
        only when settled, Succeeded only when complete (the recount)."""
        now = datetime.now(UTC)
        *_, (progress, manifest) = ended_run_passes(self.storage, self.operator, now)
        if progress is None or manifest is None:
            return
        spec = load_spec_file(self._spec()).spec
        passes = passes_of(spec)
        current = StatesPass(kind=self.states_pass, run="1:", since=now.isoformat()) if passes else None
        completion = None
        if spec.hidden_states is not None and progress.settled_by(job):
            completion = states_completion(self.storage, manifest.dataset_names, list(spec.hidden_states.layouts),
                                           progress.overall.given_up)
        failed = any(code != EXIT_OK for code in codes)
        state = JobState(succeeded=codes.count(EXIT_OK), failed=len(codes) - codes.count(EXIT_OK), complete=not failed,
                         failed_message="runner Job failed (FailedIndexes)" if failed else None, hash=job)
        observed = Observed(generation=1, now=now, suspended=False, previous=DatasetGenerationStatus(), name="model",
                            job=state, progress=progress, states_passes=passes, states_pass=current,
                            completion=completion)
        decision = decide(observed)
        moved = decision.status.states_pass
        if current is not None and moved is not None and moved.kind != current.kind:
            lacking = self._lacking(kinds=[current.kind], failed_states_count=False)
            assert not lacking, f"the operator moved to the {moved.kind} pass, yet {lacking[:5]}"
            self.states_pass = moved.kind
            self._note("operator:next_pass")
        if decision.write_report:
            self._assert_settled("the operator decided to report")
            ended = decide(replace(observed, remembered_report=write_report_status(self.storage)))
            self._note(f"operator:{ended.status.phase}")
            if ended.status.phase == "Succeeded":
                lacking = self._lacking(kinds=kinds_needed(list(spec.hidden_states.layouts))
                                        if spec.hidden_states else [], failed_states_count=False)
                assert not lacking, f"the operator says Succeeded, yet the run lacks {lacking[:5]}"
            assert ended.server_replicas == 0 and ended.delete_server, "a terminal run holds GPUs"

    @precondition(lambda self: self._in_budget())
    @rule(workers=st.integers(1, 4))
    def marker_in_flight_taken_over(self, workers: int) -> None:
        """A Job's worker 0 passes its fence and its first commit record's PUT waits (a PUT held in flight); the
        other workers end; another owner takes the output over (--take-over) and finishes; then the PUT lands: it
        counts for nobody, and the worker exits 6 (review of f9665d2, bug 1: with several workers)."""
        self.jobs += 1
        job = f"job-{self.jobs}"
        replaced = self._replaced()
        release = self.root / f"release-{self.jobs}"
        urls = self._servers("one")
        stalled = self._worker(0, workers, job, urls, "stall-before:fenced:1", release=release)
        others = [self._worker(i, workers, job, urls) for i in range(1, workers)]
        assert stalled.stderr is not None
        announced = ""
        while "stall-before:fenced:1 reached" not in announced:
            line = stalled.stderr.readline()
            announced += line
            if not line:
                break
        ended = [self._ended(process, job, index) for index, process in enumerate(others, start=1)]
        try:
            taker = None
            if "reached" in announced:  # else it ended without a commit record: nothing in flight
                command, env = self._command(urls[-1])
                taker = subprocess.run([*command, "--take-over"], capture_output=True, text=True, env=env,
                                       timeout=RUN_TIMEOUT_S)
        finally:
            release.touch()
        code, rest = stalled.wait(timeout=RUN_TIMEOUT_S), stalled.communicate()[1]
        self._note(f"marker_in_flight_taken_over:{workers}w")
        if replaced:
            return
        self._recorded_now()
        assert all(code in (EXIT_OK, EXIT_GIVEN_UP) for code, _ in ended), ended
        if taker is not None:
            # A run of SpecForge's layout without --states-pass ends 7 (the final pass is to run): not a failure.
            assert taker.returncode in (EXIT_OK, EXIT_GIVEN_UP, 7), taker.stderr[-1500:]
            assert code == EXIT_LEASE_LOST, announced + rest[-1500:]
        self._restart_passes()

    # The lease races of one CLI owner (lifecycle_model.py's) are the parent's to explore; here every run is a
    # DatasetGeneration's runner Job (whose workers share the lease and leave it to go stale).
    def run(self, fault: str | None) -> None:  # type: ignore[override]
        raise NotImplementedError

    run_to_the_end = outage = second_writer = lease_from_the_future = two_runs_at_once = run
    paused_writer_taken_over = cut_off_writer_taken_over = operator_decides_the_job_ended = run

    # -- invariants -------------------------------------------------------------------------------------------
    @invariant()
    def no_state_marker_names_a_missing_or_other_file(self) -> None:
        for name in ("a", "b"):
            for kind in KINDS.values():
                for marker in state_markers(self.storage, name, kind):  # the counted ones, one per sample
                    file = self.out / name / marker["file"]
                    assert file.is_file() and file.stat().st_size == marker["bytes"], f"{name}: {file} is not it"

    @invariant()
    def a_report_that_passes_means_the_run_is_complete(self) -> None:
        if not (self.out / "run.json").exists():
            return
        computed = compute_report(self.storage)
        report, ledger = computed.report, computed.ledger
        if report["verdict"] != "fail":
            states = (ledger.run.get("spec") or {}).get("hiddenStates")  # what the run recorded, not the next edit
            lacking = self._lacking(kinds=kinds_needed(list(states.get("layouts") or [])) if states else [],
                                    failed_states_count=False)
            assert not lacking, f"the report's verdict is {report['verdict']}, yet the run lacks {lacking[:5]}"

