"""One definition of done (store/completion.py): every slot settled and every artifact present and aligned; the
verdict the exit code, the report and the operator read."""

from __future__ import annotations

import pytest

from tokenmill_runner.store.completion import Completion, StateCoverage, combine, coverage

EXPECTED = {("a", 0): 10, ("b", 0): 12, ("c", 0): None, ("d", 0): 8}


def test_coverage_counts_each_committed_sample_once_by_what_it_has():
    found = coverage("aux", EXPECTED, [(("a", 0), 10), (("b", 0), 11), (("c", 0), 99), (("gone", 0), 5)],
                     failed={("a", 0), ("d", 0), ("other", 0)}, describe=lambda ref: ref[0])
    # a: states (its stale failure record does not count); b: misaligned; c: a conversation, any length; d: failed.
    assert (found.samples, found.captured, found.misaligned, found.failed, found.missing, found.uncounted) == \
        (4, 2, 1, 1, 0, 1)
    assert found.examples == ("b: 11 states for 12 tokens",) and not found.complete
    # Listed, not read (tokens None): counted as captured.
    listed = coverage("aux", EXPECTED, [(("a", 0), None), (("b", 0), None)], failed=())
    assert (listed.captured, listed.missing) == (2, 2)


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
