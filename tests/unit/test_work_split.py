"""The one split of the work (store/work_split.py): every slot has exactly one owner among the current workers,
whatever count committed it, and the stream's row filter is the same rule."""

from __future__ import annotations

import pytest

from tokenmill_runner.source.prompts import Prompt, RowError, belongs_to_worker
from tokenmill_runner.store.work_split import WorkShare

IDS = [f"s{i:04d}" for i in range(200)]


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_every_sample_has_exactly_one_owner_at_every_count(count):
    for sid in IDS:
        assert sum(WorkShare(index, count).owns(sid, 7) for index in range(count)) == 1
    # Each worker gets a share (a hash split, not a range): nobody idles at 200 ids.
    assert all(any(WorkShare(index, count).owns(sid, 7) for sid in IDS) for index in range(count))


def test_the_owner_depends_on_the_id_and_the_current_count_only():
    # The line (a row committed elsewhere, or a slot of a later sample index) never moves a sample with a valid id.
    assert all(WorkShare(0, 3).owner(sid, 1) == WorkShare(0, 3).owner(sid, 99) for sid in IDS)
    # A row refused before its id was read is split by its line.
    assert [WorkShare(0, 3).owner(None, line) for line in (3, 4, 5)] == [0, 1, 2]


def test_the_stream_s_row_filter_is_the_same_rule():
    prompt = Prompt(5, "s0042", [{"role": "user", "content": "x"}], None)
    refused = RowError(6, None, "invalid_sample_id", "line 6: no id")
    for count in (1, 2, 3, 4):
        for index in range(count):
            assert belongs_to_worker(prompt, index, count) == WorkShare(index, count).owns("s0042", 5)
            assert belongs_to_worker(refused, index, count) == WorkShare(index, count).owns(None, 6)


def test_an_index_outside_the_count_is_refused():
    with pytest.raises(ValueError, match="worker index 3"):
        WorkShare(3, 3)
