"""How a run ended, said by its exit code and its last summary lines (ledger-design.md: 0/1/3/4/130)."""

from __future__ import annotations

from tokenmill_runner.generate.summary import (
    EXIT_FAILED,
    EXIT_GIVEN_UP,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SERVERS_UNAVAILABLE,
    DatasetSummary,
    RunSummary,
    exit_code,
    iter_summary_lines,
)


def dataset(name: str = "d", rows: int = 10, generated: int = 10, failed: dict | None = None,
            given_up: dict | None = None, skipped: int = 0) -> DatasetSummary:
    return DatasetSummary(name=name, slots=rows, skipped=skipped, generated=generated, failed=failed or {},
                          completion_tokens=100, truncated=0, median_completion=10.0, mean_completion=10.0,
                          max_completion=10, given_up=given_up or {})


def run(*datasets: DatasetSummary, interrupted: bool = False, unavailable: str | None = None) -> RunSummary:
    return RunSummary(output_uri="out", datasets=list(datasets), elapsed_s=1.0, retries=0, interrupted=interrupted,
                      concurrency=4, context_length=4096, servers_unavailable=unavailable)


def test_a_complete_run_without_given_up_samples_exits_0():
    summary = run(dataset(generated=8, failed={"invalid_json": 1, "prompt_too_long": 1}))
    assert exit_code(summary) == EXIT_OK
    assert not any("given up" in line for line in iter_summary_lines(summary)), "input errors are not given up"


def test_given_up_samples_exit_3_with_counts_per_reason_and_how_to_retry():
    summary = run(dataset("a", generated=6, failed={"retries_exhausted": 3, "invalid_json": 1},
                          given_up={"retries_exhausted": 3}),
                  dataset("b", generated=5, skipped=5, given_up={"retries_exhausted": 2, "bad_response": 1}))
    assert exit_code(summary) == EXIT_GIVEN_UP
    last = list(iter_summary_lines(summary))[-1]
    assert last.startswith("6 samples given up: retries_exhausted 5, bad_response 1; run again with "
                           "`tokenmill run --retry-failed`")
    assert "tokenmill.io/retry-failed" in last and "spec.runner.retryFailed" in last


def test_servers_unavailable_exit_4_and_say_nothing_was_written_off():
    summary = run(dataset(rows=10, generated=4), unavailable="no server was live for 7200 s")
    assert exit_code(summary) == EXIT_SERVERS_UNAVAILABLE
    lines = list(iter_summary_lines(summary))
    assert any(line.startswith("stopped: no server was live for 7200 s. Nothing was written off: 6 samples are "
                               "not done yet") for line in lines), lines


def test_interrupted_wins_and_a_stream_that_left_lines_without_outcome_is_an_error():
    assert exit_code(run(dataset(generated=3), interrupted=True)) == EXIT_INTERRUPTED
    incomplete = run(dataset(rows=10, generated=9))
    assert exit_code(incomplete) == EXIT_FAILED
    assert list(iter_summary_lines(incomplete))[-1].startswith("error: 1 lines have no outcome")


def test_a_dataset_without_a_single_sample_exits_5_but_another_workers_share_may_hold_them():
    from dataclasses import replace

    from tokenmill_runner.generate.summary import EXIT_NO_SAMPLES

    all_failed = dataset(rows=2, generated=0, failed={"invalid_json": 1, "empty_messages": 1})
    summary = run(dataset(name="ok"), all_failed)
    assert exit_code(summary) == EXIT_NO_SAMPLES
    assert list(iter_summary_lines(summary))[-1] == ("error: no samples: d: every row failed for its input "
                                                     "(empty_messages 1, invalid_json 1); see d/errors/ for each "
                                                     "line and reason")
    # A rerun that finds the failures committed says so too; one committed sample anywhere is enough.
    assert exit_code(run(dataset(rows=2, generated=0, skipped=2))) == EXIT_NO_SAMPLES
    assert exit_code(run(replace(all_failed, completed=1))) == EXIT_OK
    # With several workers this one's rows may all be bad while another's are good: only an empty source counts.
    assert exit_code(replace(summary, workers=2)) == EXIT_OK
    empty = replace(dataset(rows=0, generated=0), source_rows=0)
    assert exit_code(replace(run(empty), workers=2)) == EXIT_NO_SAMPLES


def test_a_worker_judges_its_own_share_of_the_states_and_says_which_pass_is_left():
    # store/completion.py over this worker's share: its slots from the summary, each kind's coverage of its samples.
    from tokenmill_runner.generate.summary import EXIT_STATES_PENDING, share_completion
    from tokenmill_runner.store.completion import StateCoverage

    summary = run(dataset(generated=10))
    aux, final = StateCoverage("aux", 10, 10), StateCoverage("final", 10, 0)
    assert exit_code(summary, share_completion(summary, (aux,)), "aux") == EXIT_OK
    # SpecForge's layout after the aux pass: the final states need the server relaunched.
    assert exit_code(summary, share_completion(summary, (aux, final)), "aux") == EXIT_STATES_PENDING
    # This pass's own kind still missing after it ran: work left undone, never "another pass".
    assert exit_code(summary, share_completion(summary, (StateCoverage("aux", 10, 9), final)), "aux") == EXIT_FAILED
    # Captures that failed (recorded: what no retry fixed) are given up, before the other kind's pass.
    failed = StateCoverage("aux", 10, 9, failed=1)
    assert exit_code(summary, share_completion(summary, (failed, final)), "aux") == EXIT_GIVEN_UP
    # An interrupted run says so whatever its states.
    assert exit_code(run(dataset(generated=10), interrupted=True), share_completion(summary, (failed,))) == \
        EXIT_INTERRUPTED
