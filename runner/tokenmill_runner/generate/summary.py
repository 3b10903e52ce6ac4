"""The closing summary of a run, per dataset: what the pipeline reports when it ends, its lines, and the exit code
that says how it ended. Pure."""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

# `tokenmill run` exit codes (docs/running.md, the exit-code table; the operator's Job failure policy relies on them).
EXIT_OK = 0  # every slot has a final outcome, and none was given up
EXIT_FAILED = 1  # an error stopped the run (the message says which); a rerun resumes from what is committed
EXIT_USAGE = 2  # a bad command line or spec: no retry can succeed
EXIT_GIVEN_UP = 3  # finished, but samples were given up for a server-side reason: rerun with --retry-failed
EXIT_SERVERS_UNAVAILABLE = 4  # no server was live for longer than the outage budget; nothing was written off
EXIT_NO_SAMPLES = 5  # finished, but a dataset has no sample: an empty source, or every row failed for its input
EXIT_LEASE_LOST = 6  # the run could no longer prove it holds the output's lease: it committed nothing after that
EXIT_STATES_PENDING = 7  # finished, but hidden states of another kind are still to capture against a relaunched server
EXIT_VERDICT = 8  # `tokenmill report`: the verdict is FAIL (or, with --fail-on warn, WARN)
EXIT_INTERRUPTED = 130  # SIGINT/SIGTERM: finished samples committed, the rest is redone on resume
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away (`| head`): 128 + SIGPIPE, as a shell reports such a command

# The one table of exit codes, for every command: `tokenmill --help` prints it, and the README holds the same rows
# (tests/integration/test_readme.py compares them).
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "done: the run settled with no sample given up; the report's verdict passed --fail-on; the export "
              "wrote records"),
    (EXIT_FAILED, "an error stopped the command (the message names it); a rerun of `run` resumes from what is "
                  "committed"),
    (EXIT_USAGE, "a bad command line, spec or path, named in the message (a flag, a spec field, a URI that is no "
                 "run's output, a missing source), refused before anything starts; or an output another live "
                 "run writes"),
    (EXIT_GIVEN_UP, "run: finished, but samples were given up (rerun with --retry-failed); offline export: "
                    "samples lack their hidden states"),
    (EXIT_SERVERS_UNAVAILABLE, "run: no server was live (at start-up within --server-wait, later past the "
                               "outage budget); nothing was written off, a rerun continues"),
    (EXIT_NO_SAMPLES, "run: a dataset has no sample (an empty source, or every row failed for its input); "
                      "export: nothing was written (every unit filtered, excluded or refused)"),
    (EXIT_LEASE_LOST, "run: another run took the output's lease; what was committed before counts"),
    (EXIT_STATES_PENDING, "run: hidden states of another kind are still to capture (relaunch the server as told)"),
    (EXIT_VERDICT, "report: the verdict is FAIL (with --fail-on warn: WARN or FAIL)"),
    (EXIT_INTERRUPTED, "interrupted (SIGINT/SIGTERM): finished samples are committed, the rest is redone on resume"),
    (EXIT_BROKEN_PIPE, "the reader of the output went away (`| head`): the output was cut short, nothing else "
                       "changed"),
)


def exit_code_table(width: int = 78) -> str:
    """The exit codes as `--help` prints them: one code per entry, its meaning wrapped under it."""
    lines = ["exit codes:"]
    for code, meaning in EXIT_CODES:
        lines.extend(textwrap.wrap(meaning, width, initial_indent=f"  {code:<4} ", subsequent_indent=" " * 7))
    return "\n".join(lines)

RETRY_HINT = ("run again with `tokenmill run --retry-failed` (on a cluster: annotate the DatasetGeneration "
              "tokenmill.io/retry-failed=<a new value>, or set spec.runner.retryFailed: true)")


@dataclass(frozen=True)
class DatasetSummary:
    name: str
    slots: int  # this worker's slots: its source lines x samples per prompt
    skipped: int  # slots with a final outcome before this run
    generated: int
    failed: dict[str, int]  # this run's failures by reason
    completion_tokens: int
    truncated: int
    median_completion: float | None
    mean_completion: float | None
    max_completion: int | None
    given_up: dict[str, int]  # this worker's slots given up (earlier runs' included), by reason
    completed: int = 0  # samples of the dataset committed with a row, earlier runs' and other workers' included
    source_rows: int | None = None  # rows of the source, every worker's (None: unknown)
    missing: int | None = None  # this worker's slots without an outcome in the ledger (`ledger.completeness`)

    @property
    def done(self) -> int:
        return self.skipped + self.generated + sum(self.failed.values())

    @property
    def without_outcome(self) -> int:
        """Slots of this worker with no final outcome: the ledger's count, the one the report and the operator
        make, when the pipeline has it; else the slots this run met."""
        if self.missing is not None:
            return self.missing
        return max(self.slots - self.done, 0)


@dataclass(frozen=True)
class RunSummary:
    output_uri: str
    datasets: list[DatasetSummary]
    elapsed_s: float
    retries: int
    interrupted: bool
    concurrency: int
    context_length: int
    servers_unavailable: str | None = None  # why the run stopped waiting for a live server, if it did
    workers: int = 1

    @property
    def given_up(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for dataset in self.datasets:
            total.update(dataset.given_up)
        return total

    @property
    def without_outcome(self) -> int:
        return sum(d.without_outcome for d in self.datasets)


def exit_code(summary: RunSummary) -> int:
    if summary.interrupted:
        return EXIT_INTERRUPTED
    if summary.servers_unavailable is not None:
        return EXIT_SERVERS_UNAVAILABLE
    if summary.without_outcome:
        return EXIT_FAILED
    if summary.given_up:
        return EXIT_GIVEN_UP
    if without_samples(summary):
        return EXIT_NO_SAMPLES
    return EXIT_OK


def without_samples(summary: RunSummary) -> list[str]:
    """Why datasets ended with no sample at all, one line each: the report says FAIL, and so must the exit code (CI
    that reads only the exit code would call an empty or unreadable source a success). With several workers only an
    empty source counts: another worker may hold every good row of the dataset."""
    lines = []
    for d in summary.datasets:
        if d.source_rows == 0:
            lines.append(f"{d.name}: its source holds no rows (an empty file, or only blank lines)")
        elif summary.workers == 1 and d.slots and not (d.completed or d.generated):
            reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(d.failed.items()))
            lines.append(f"{d.name}: every row failed for its input ({reasons or 'in an earlier run'}); see "
                         f"{d.name}/errors/ for each line and reason")
    return lines


def given_up_line(given_up: Counter[str] | dict[str, int]) -> str:
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(given_up.items(), key=lambda i: (-i[1], i[0])))
    total = sum(given_up.values())
    return f"{total} sample{'s' if total != 1 else ''} given up: {reasons}; {RETRY_HINT}"


def iter_summary_lines(summary: RunSummary) -> Iterator[str]:
    header = f"{'dataset':<20} {'slots':>7} {'done before':>11} {'generated':>9} {'failed':>6} " \
             f"{'tokens':>11} {'median':>7} {'mean':>7} {'max':>6} {'truncated':>9}"
    yield header
    for d in summary.datasets:
        median = f"{d.median_completion:.0f}" if d.median_completion is not None else "-"
        mean = f"{d.mean_completion:.0f}" if d.mean_completion is not None else "-"
        yield (f"{d.name:<20} {d.slots:>7} {d.skipped:>11} {d.generated:>9} {sum(d.failed.values()):>6} "
               f"{d.completion_tokens:>11,} {median:>7} {mean:>7} {d.max_completion or '-':>6} {d.truncated:>9}")
        for reason, count in sorted(d.failed.items()):
            yield f"    failed: {reason}: {count}"
    yield (f"{summary.retries} retries, concurrency {summary.concurrency}, context length "
           f"{summary.context_length}, {summary.elapsed_s:.1f}s")
    yield f"output: {summary.output_uri}"
    yield from _ending_lines(summary)


def _ending_lines(summary: RunSummary) -> Iterator[str]:
    missing = summary.without_outcome
    if summary.servers_unavailable is not None:
        yield (f"stopped: {summary.servers_unavailable}. Nothing was written off: {missing} samples are not done "
               "yet; run again (a restarted Job pod does) to continue once a server is up")
    elif summary.interrupted:
        yield f"interrupted: {missing} samples are not done yet; run again to continue"
    elif missing:
        yield f"error: {missing} lines have no outcome although the stream ended; run again to continue"
    elif not summary.given_up:
        for line in without_samples(summary):
            yield f"error: no samples: {line}"
    if summary.given_up:
        yield given_up_line(summary.given_up)
