"""The ledger's fold: one final outcome per slot, whatever order or how often markers arrive (ledger-design.md)."""

from __future__ import annotations

import itertools
import tracemalloc
from typing import Any

import numpy as np
import pytest

from tokenmill_runner.store.ledger import (
    RETRYABLE_REASONS,
    DatasetLedger,
    MarkerError,
    ShardContent,
    Slot,
    build_marker,
    effective_failures,
)


def marker(shard: str, rows: list[tuple[int, int]] = (), failures: list[tuple[int, str]] = (),
           finish: str = "stop", index: int | None = 0) -> dict[str, Any]:
    """A marker as build_marker writes it: rows as (line, completion tokens), failures as (line, reason)."""
    content = ShardContent(
        [{"sample_id": f"s{line}", "line": line, "sample_index": index, "completion_tokens": tokens,
          "finish_reason": finish} for line, tokens in rows],
        [{"line": line, "sample_index": index, "sample_id": f"s{line}", "reason": reason} for line, reason in failures],
    )
    built = build_marker("d", shard, 0, content, 0)
    if index is None:  # a version-1 marker: no sample_index anywhere
        built["version"] = 1
        del built["samples"]["sample_index"], built["failed"]["sample_index"]
    return built


def state(ledger: DatasetLedger) -> tuple[Any, ...]:
    return (ledger.completed, ledger.completion_tokens, ledger.truncated, ledger.final_failures(),
            dict(ledger.failed_slots()))


def test_folding_the_same_marker_twice_counts_nothing_twice():
    first = marker("a", rows=[(1, 10), (2, 20)], failures=[(3, "invalid_json")], finish="length")
    once = DatasetLedger("d", 5).fold_all([first])
    twice = DatasetLedger("d", 5).fold_all([first, first])
    assert state(once) == state(twice) == (2, 30, 2, {"invalid_json": 1}, {Slot(3): "invalid_json"})


def test_two_markers_naming_the_same_slot_count_it_once():
    ledger = DatasetLedger("d", 5).fold_all([marker("a", rows=[(1, 10)]), marker("b", rows=[(1, 99), (2, 5)])])
    assert ledger.completed == 2 and ledger.completion_tokens == 15  # the first row of slot 1 counts


def test_the_outcome_does_not_depend_on_the_order_of_the_markers():
    markers = [
        marker("a", failures=[(1, "retries_exhausted"), (2, "retries_exhausted"), (4, "bad_response")]),
        marker("b", rows=[(1, 7)]),  # line 1 retried and generated
        marker("c", failures=[(2, "server_rejected")]),  # line 2 retried and refused for its input: final
        marker("d", failures=[(3, "invalid_json")], rows=[(5, 3)]),
    ]
    seen = set()
    for order in itertools.permutations(markers):
        ledger = DatasetLedger("d", 5).fold_all(order)
        seen.add(repr(state(ledger)))
        assert ledger.outcome(Slot(1)) == "row" and ledger.outcome(Slot(2)) == "server_rejected"
        assert ledger.given_up() == {"bad_response": 1}
    assert len(seen) == 1, seen


def test_a_failure_never_replaces_a_row():
    for order in (["row", "fail"], ["fail", "row"]):
        parts = {"row": marker("r", rows=[(4, 12)]), "fail": marker("f", failures=[(4, "retries_exhausted")])}
        ledger = DatasetLedger("d", 4).fold_all(parts[name] for name in order)
        assert ledger.outcome(Slot(4)) == "row" and ledger.failed == 0 and ledger.completed == 1


def test_is_done_skips_final_outcomes_and_retries_only_given_up_ones():
    ledger = DatasetLedger("d", 4).fold_all([marker("a", rows=[(1, 5)], failures=[(2, "retries_exhausted"),
                                                                                   (3, "duplicate_sample_id")])])
    assert [ledger.is_done(Slot(line)) for line in (1, 2, 3, 4)] == [True, True, True, False]
    assert [ledger.is_done(Slot(line), retry_failed=True) for line in (1, 2, 3, 4)] == [True, False, True, False]
    assert ledger.is_given_up(Slot(2)) and not ledger.is_given_up(Slot(3)) and not ledger.is_given_up(Slot(1))
    assert ledger.given_up() == {"retries_exhausted": 1}
    assert ledger.final_failures() == {"retries_exhausted": 1, "duplicate_sample_id": 1}
    assert ledger.settled == 3


def test_every_reason_the_design_calls_server_side_is_retryable():
    assert {"retries_exhausted", "bad_response", "outage_timeout", "nan_output"} <= RETRYABLE_REASONS
    assert not {"invalid_json", "prompt_too_long", "server_rejected", "duplicate_sample_id"} & RETRYABLE_REASONS


def test_version_1_markers_read_as_sample_index_0():
    old = marker("a", rows=[(1, 3)], failures=[(2, "invalid_json")], index=None)
    ledger = DatasetLedger("d", 2).fold_all([old])
    assert ledger.outcome(Slot(1, 0)) == "row" and ledger.outcome(Slot(2, 0)) == "invalid_json"


def test_the_sample_index_is_part_of_the_slot():
    ledger = DatasetLedger("d", 2, samples_per_prompt=3)
    ledger.fold(marker("a", rows=[(1, 3)], index=2))
    ledger.fold(marker("b", failures=[(1, "retries_exhausted")], index=0))
    assert [ledger.outcome(Slot(1, i)) for i in range(3)] == ["retries_exhausted", None, "row"]
    assert dict(ledger.failed_slots()) == {Slot(1, 0): "retries_exhausted"}
    with pytest.raises(MarkerError, match=r"commit marker d/commits/c.json: samples names .*sample index outside 0..63"):
        ledger.fold(marker("c", rows=[(1, 3)], index=64))


def test_a_higher_sample_index_widens_the_layout_and_keeps_every_outcome():
    # samples raised from 2 to 4 between runs (or a reader that does not know n): what was committed stays where it is.
    ledger = DatasetLedger("d", 3, samples_per_prompt=2)
    ledger.fold(marker("a", rows=[(1, 5), (3, 7)], index=1))
    ledger.fold(marker("b", failures=[(2, "retries_exhausted"), (3, "invalid_json")], index=0))
    before = {(line, i): ledger.outcome(Slot(line, i)) for line in (1, 2, 3) for i in (0, 1)}
    assert ledger.outcome(Slot(1, 3)) is None and not ledger.is_done(Slot(1, 3))
    ledger.fold(marker("c", rows=[(2, 9)], index=3))
    assert ledger.samples_per_prompt == 4
    assert {(line, i): ledger.outcome(Slot(line, i)) for line in (1, 2, 3) for i in (0, 1)} == before
    assert ledger.outcome(Slot(2, 3)) == "row" and ledger.outcome(Slot(2, 2)) is None
    assert (ledger.completed, ledger.failed) == (3, 2)
    assert dict(ledger.failed_slots()) == {Slot(2, 0): "retries_exhausted", Slot(3, 0): "invalid_json"}
    header, arrays = ledger.state()
    again = DatasetLedger.from_state(header, arrays)
    assert [again.outcome(Slot(line, i)) for line in (1, 2, 3) for i in range(4)] == \
        [ledger.outcome(Slot(line, i)) for line in (1, 2, 3) for i in range(4)]


def test_lines_beyond_the_row_count_grow_the_ledger():
    # A JSONL source with blank lines numbers its rows past the row count.
    ledger = DatasetLedger("d", 3).fold_all([marker("a", rows=[(1, 1), (1000, 2)], failures=[(5000, "invalid_json")])])
    assert ledger.outcome(Slot(1000)) == "row" and ledger.outcome(Slot(5000)) == "invalid_json"
    assert not ledger.is_done(Slot(4999)) and not ledger.is_done(Slot(10**9))
    assert ledger.completed == 2 and ledger.failed == 1


def test_a_broken_marker_is_refused_naming_the_shard_and_the_field():
    ledger = DatasetLedger("d")
    with pytest.raises(MarkerError, match=r"d/commits/x.json: no 'samples'/'failed'"):
        ledger.fold({"shard_id": "x"})
    bad = marker("y", rows=[(1, 1)])
    bad["samples"]["line"] = ["one"]
    with pytest.raises(MarkerError, match=r"d/commits/y.json: samples.line/sample_index are not integers"):
        ledger.fold(bad)
    short = marker("z", failures=[(1, "invalid_json"), (2, "invalid_json")])
    short["failed"]["reason"] = ["invalid_json"]
    with pytest.raises(MarkerError, match=r"d/commits/z.json: failed.reason has 1 entries for 2 lines"):
        ledger.fold(short)
    zero = marker("w", rows=[(0, 1)])
    with pytest.raises(MarkerError, match=r"d/commits/w.json: samples names a line below 1"):
        ledger.fold(zero)


def test_a_ledger_holds_about_a_byte_per_slot_whatever_it_folds():
    # Issue 14 scales to 10M prompts: the per-slot state must not be Python objects per sample.
    markers = [marker(f"m{shard}", rows=[(line, 1) for line in range(shard * 1000 + 1, shard * 1000 + 991)],
                      failures=[(line, "invalid_json") for line in range(shard * 1000 + 991, shard * 1000 + 1001)])
               for shard in range(200)]
    tracemalloc.start()
    try:
        ledger = DatasetLedger("d", 200_000).fold_all(markers)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ledger.completed == 198_000 and ledger.failed == 2000
    assert held < 1.5 * 200_000, f"{held} bytes held for 200k slots"


def test_effective_failures_keeps_its_meaning_for_existing_callers():
    markers = [marker("a", failures=[(1, "retries_exhausted"), (2, "invalid_json")]), marker("b", rows=[(1, 4)])]
    assert effective_failures(markers) == {Slot(2): "invalid_json"}


def test_the_last_retry_round_a_slot_failed_in_survives_order_widening_and_checkpoints():
    # Seeds are per --retry-failed round (seeds.py): a slot given up in round 1 is run next in round 2, never again
    # with round 1's seeds. Markers of earlier releases carry no round (round 0).
    def failed_in(shard: str, line: int, retry_round: int) -> dict[str, Any]:
        content = ShardContent([], [{"line": line, "sample_index": 1, "sample_id": f"s{line}",
                                     "reason": "nan_output", "retry_round": retry_round}])
        return build_marker("d", shard, 0, content, 0)

    first, second, plain = failed_in("a", 2, 0), failed_in("b", 2, 1), marker("c", failures=[(3, "nan_output")])
    assert "retry_round" not in first["failed"] and "retry_round" not in plain["failed"]
    assert second["failed"]["retry_round"] == [1]
    for order in itertools.permutations([first, second, plain]):
        ledger = DatasetLedger("d", 4, samples_per_prompt=2).fold_all(order)
        assert (ledger.retry_round(Slot(2, 1)), ledger.retry_round(Slot(3, 0)), ledger.retry_round(Slot(9, 0))) \
            == (1, 0, 0)
    ledger.fold(second)
    assert ledger.retry_round(Slot(2, 1)) == 1, "folding a marker again changes nothing"
    ledger.widen(4)
    assert ledger.retry_round(Slot(2, 1)) == 1 and ledger.retry_round(Slot(2, 0)) == 0
    header, arrays = ledger.state()
    assert DatasetLedger.from_state(header, arrays).retry_round(Slot(2, 1)) == 1
    del arrays["round_positions"], arrays["rounds"]  # a checkpoint written before rounds were recorded
    assert DatasetLedger.from_state(header, arrays).retry_round(Slot(2, 1)) == 0

