"""One definition of done (store/completion.py): every slot settled and every artifact present and aligned; the
verdict the exit code, the report and the operator read."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill_runner.store.completion import Completion, StateCoverage, combine, coverage

# Committed samples a, b, c, d as sorted 64-bit keys (store/hidden_states.state_key) and their lengths (-1: a
# conversation, whose length the marker cannot tell).
A, B, C, D, GONE = 10, 20, 30, 40, 99
KEYS, LENGTHS = np.array([A, B, C, D], dtype=np.uint64), np.array([10, 12, -1, 8], dtype=np.int64)


def test_coverage_counts_each_committed_sample_once_by_what_it_has():
    states = [("a", A, 10, 100, "bfloat16"), ("b", B, 11, 110, "bfloat16"), ("c", C, 99, 990, "bfloat16"),
              ("gone", GONE, 5, 50, "bfloat16"), ("a again", A, 10, 100, "bfloat16")]
    found = coverage("aux", KEYS, LENGTHS, states, failed=np.array([A, D, 77], dtype=np.uint64))
    # a: states (its stale failure record does not count); b: misaligned; c: a conversation, any length; d: failed.
    assert (found.samples, found.captured, found.misaligned, found.failed, found.missing, found.uncounted) == \
        (4, 2, 1, 1, 0, 1)
    assert found.examples == ("b: 11 states for 12 tokens",) and not found.complete
    assert (found.state_bytes, found.state_tokens, found.dtypes) == (1200, 120, ("bfloat16",)), "each sample once"
    # Listed, not read (tokens None): counted as captured, never misaligned.
    listed = coverage("aux", KEYS, LENGTHS, [("", A, None, 0, ""), ("", B, None, 0, "")], np.empty(0, np.uint64))
    assert (listed.captured, listed.missing, listed.misaligned) == (2, 2, 0)


@pytest.mark.parametrize(("completion", "verdict", "retryable"), [
    (Completion(0), "complete", 0),
    (Completion(3), "pending", 0),
    (Completion(0, 2), "given_up", 2),
    (Completion(0, 0, (StateCoverage("aux", 4, 3),)), "pending", 1),
    (Completion(0, 0, (StateCoverage("aux", 4, 3, failed=1),)), "given_up", 1),
    (Completion(0, 0, (StateCoverage("aux", 4, 3, misaligned=1),)), "given_up", 0),
    # Missing states win over given-up slots: a plain rerun still has work.
    (Completion(0, 2, (StateCoverage("aux", 4, 4), StateCoverage("final", 4, 0))), "pending", 6),
])
def test_the_verdict_and_what_a_retry_runs(completion, verdict, retryable):
    assert completion.verdict == verdict
    assert completion.complete == (verdict == "complete")
    assert completion.retryable == retryable


def test_a_pass_moves_on_only_when_its_kind_is_complete_and_every_slot_settled():
    aux_done = Completion(0, 0, (StateCoverage("aux", 4, 4), StateCoverage("final", 4, 0)))
    assert aux_done.kind_done("aux") and not aux_done.kind_done("final")
    assert aux_done.pending_kinds() == ["final"]
    assert not Completion(1, 0, (StateCoverage("aux", 4, 4),)).kind_done("aux"), "slots still open"
    assert not Completion(0, 0, (StateCoverage("aux", 4, 3, failed=1),)).kind_done("aux"), "a failed capture"


def test_datasets_combine_kind_by_kind():
    whole = combine([Completion(1, 2, (StateCoverage("aux", 4, 4),)),
                     Completion(0, 1, (StateCoverage("aux", 6, 5, failed=1),))])
    assert whole == Completion(1, 3, (StateCoverage("aux", 10, 9, failed=1),))
    assert "1 slots without an outcome" in whole.describe() and "1 aux captures failed" in whole.describe()
