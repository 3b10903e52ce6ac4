"""Readers of commit markers pay for what is new: time-ordered names, incremental listing, checkpoints that verify."""

from __future__ import annotations

import tracemalloc
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tokenmill_runner.store.checkpoints import CheckpointError, decode, encode
from tokenmill_runner.store.commit_index import DatasetIndex, rates
from tokenmill_runner.store.index_store import (
    catch_up,
    load_index,
    open_index,
    sweep,
    take_checkpoint,
    write_checkpoint,
)
from tokenmill_runner.store.ledger import DatasetLedger, Slot
from tokenmill_runner.store.marker_names import (
    MAX_CLOCK_SKEW,
    OVERLAP,
    marker_name,
    shard_id_of,
    split_marker_name,
    time_key,
)
from tokenmill_runner.store.markers import marker_keys
from tokenmill_runner.store.shards import leftovers
from tokenmill_runner.store.storage import LocalStorage

from .counting_storage import CountingStorage, commit_lines

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def commit(storage, seq: int, lines: range, at: datetime, errors: list[dict[str, Any]] = ()) -> dict[str, Any]:
    return commit_lines(storage, "d", seq, lines, at, errors)


def test_marker_names_sort_by_commit_time_and_keep_the_shard_id():
    early = marker_name(T0, "w007-ffff-000009")
    late = marker_name(T0 + timedelta(microseconds=1), "w000-0000-000001")
    assert early < late, "key order is time order, whatever the worker"
    assert split_marker_name(early) == ("20261129T120000.000000Z", "w007-ffff-000009")
    assert split_marker_name("w000-abc-000001.json") == (None, "w000-abc-000001"), "old names still read"
    assert shard_id_of(f"d/commits/{early}.tmp-x1") == shard_id_of("d/shards/w007-ffff-000009.parquet") == \
        "w007-ffff-000009"
    assert "w000-abc-000001.json" > late, "old names sort after every time-named marker: incremental lists see them"


def test_a_commit_names_its_marker_by_the_time_just_before_the_put(tmp_path):
    storage = LocalStorage(tmp_path)
    marker = commit(storage, 1, range(1, 4), T0)
    [key] = marker_keys(storage, "d")
    assert key == f"d/commits/{time_key(T0)}-w000-t-000001.json"
    assert marker["committed_at"] == T0.isoformat()


def test_catch_up_reads_only_markers_it_has_not_folded(tmp_path):
    storage = CountingStorage(tmp_path)
    for seq in range(1, 41):
        commit(storage, seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(minutes=seq))
    index = DatasetIndex(DatasetLedger("d", 500))
    storage.reset()
    assert catch_up(storage, index).folded == 40 and len(storage.gets) == 40
    assert index.ledger.completed == 400 and index.horizon == time_key(T0 + timedelta(minutes=40) - OVERLAP)

    for seq in (41, 42):
        commit(storage, seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(minutes=seq))
    storage.reset()
    again = catch_up(storage, index)
    assert again.folded == 2 and [shard_id_of(key) for key in storage.gets] == ["w000-t-000041", "w000-t-000042"]
    # Only the overlap window is listed again (markers named at or after the horizon, minutes 25-40), never the
    # whole history.
    assert storage.listed == again.listed == 16 + 2
    assert index.ledger.completed == 420 and index.markers == 42


def test_a_limited_catch_up_reads_a_backlog_in_bounded_steps_each_marker_once(tmp_path):
    storage = CountingStorage(tmp_path)
    commit(storage, 1, range(1, 11), T0)
    index = DatasetIndex(DatasetLedger("d", 500))
    catch_up(storage, index, limit=3)
    assert index.markers == 1 and index.horizon, "no horizon yet: the first listing is whole, its limit unused"
    for seq in range(2, 32):  # a backlog of 30 markers past the horizon
        commit(storage, seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(seconds=seq))
    horizon, storage.gets, steps = index.horizon, [], []
    while True:
        caught = catch_up(storage, index, limit=12)
        steps.append((caught.read, caught.folded, caught.more))
        if not caught.more:
            break
        assert index.horizon == horizon, "the horizon waits until every marker after it is folded"
    assert steps == [(12, 12, True), (12, 12, True), (6, 6, False)]
    assert sorted(storage.gets) == sorted(set(storage.gets)) and len(storage.gets) == 30, "each marker read once"
    assert index.ledger.completed == 310 and index.horizon > horizon
    storage.reset()
    assert catch_up(storage, index, limit=12).read == 0 and storage.gets == []
    # A full listing reads every marker it lacks, whatever the limit: it comes before a run may end.
    whole = DatasetIndex(DatasetLedger("d", 500))
    whole.listed(index.newest, index.horizon)
    assert catch_up(storage, whole, full=True, limit=12).folded == 31 and whole.ledger.completed == 310


def test_a_sweep_lists_in_steps_reads_within_its_limit_and_resumes_where_it_stopped(tmp_path):
    storage = CountingStorage(tmp_path)
    markers = [commit(storage, seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(seconds=seq))
               for seq in range(1, 6)]
    index = DatasetIndex(DatasetLedger("d", 100))
    index.fold("w000-t-000002", markers[1])  # folded before: listed, never read again
    after, steps = None, []
    while True:
        storage.reset()
        caught = sweep(storage, index, after, names=2, limit=1)
        steps.append((storage.listed, [shard_id_of(key)[-1] for key in storage.gets], caught.more))
        after = caught.after or after
        if not caught.more:
            break
    # At most 2 names listed and 1 marker read a step (a name listed past the read limit is listed again by the
    # next step, which starts after the last name dealt with); the last step lists fewer names than it may.
    assert steps == [(2, ["1"], True), (2, ["3"], True), (2, ["4"], True), (1, ["5"], False)], steps
    assert index.ledger.completed == 50 and index.horizon == "", "a sweep leaves the horizon to catch_up"


def test_a_straggler_older_than_the_overlap_is_caught_by_a_full_listing(tmp_path):
    storage = LocalStorage(tmp_path)
    commit(storage, 1, range(1, 11), T0)
    commit(storage, 2, range(11, 21), T0 + timedelta(hours=1))
    index = DatasetIndex(DatasetLedger("d", 100))
    catch_up(storage, index)
    # A PUT that finished long after its name was chosen (retried past the overlap): an incremental list misses it.
    commit(storage, 3, range(21, 31), T0 + timedelta(minutes=20))
    assert catch_up(storage, index).folded == 0 and not index.ledger.is_done(Slot(21))
    assert catch_up(storage, index, full=True).folded == 1 and index.ledger.is_done(Slot(21))


def test_a_checkpoint_round_trips_everything_a_reader_needs(tmp_path):
    storage = LocalStorage(tmp_path)
    commit(storage, 1, range(1, 11), T0, errors=[{"dataset": "d", "line": 50, "sample_index": 0, "sample_id": None,
                                                  "reason": "retries_exhausted", "message": "down"}])
    commit(storage, 2, range(11, 21), T0 + timedelta(minutes=5))
    index, _ = open_index(storage, "d", 60)
    restored = decode(encode(index, "op", T0), "d")
    assert (restored.ledger.completed, restored.ledger.completion_tokens, restored.ledger.given_up()) == \
        (20, 200, {"retries_exhausted": 1})
    assert restored.ledger.outcome(Slot(50)) == "retries_exhausted" and restored.ledger.outcome(Slot(21)) is None
    assert restored.knows("w000-t-000001") and not restored.knows("w000-t-000003")
    assert (restored.horizon, restored.newest, restored.last_commit) == (index.horizon, index.newest,
                                                                         T0 + timedelta(minutes=5))
    assert rates(list(restored.recent), T0 + timedelta(minutes=6), None) == rates(list(index.recent),
                                                                                 T0 + timedelta(minutes=6), None)


def test_a_checkpoint_of_fewer_samples_per_prompt_is_widened_not_thrown_away(tmp_path):
    # samples raised from 1 to 4: the checkpoint is still used (no full refold), each outcome stays on its slot.
    storage = LocalStorage(tmp_path)
    commit(storage, 1, range(1, 11), T0, errors=[{"dataset": "d", "line": 12, "sample_index": 0, "sample_id": None,
                                                  "reason": "invalid_json", "message": "bad"}])
    index, _ = open_index(storage, "d", 20)
    wide = decode(encode(index, "op", T0), "d", samples_per_prompt=4)
    assert wide.ledger.samples_per_prompt == 4 and wide.markers == 1
    assert [wide.ledger.outcome(Slot(line, 0)) for line in (1, 10, 11, 12)] == ["row", "row", None, "invalid_json"]
    assert not any(wide.ledger.is_done(Slot(line, i)) for line in (1, 12) for i in (1, 2, 3))
    assert (wide.ledger.completed, wide.ledger.failed) == (10, 1)


def test_a_resume_reads_the_checkpoint_and_only_the_markers_after_it(tmp_path):
    storage = CountingStorage(tmp_path)
    for seq in range(1, 31):
        commit(storage, seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(minutes=seq))
    index, _ = open_index(storage, "d", 400)
    write_checkpoint(storage, index, "w000", T0)
    for seq in range(31, 34):
        commit(storage, seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(minutes=seq))
    storage.reset()
    resumed, caught = open_index(storage, "d", 400)
    markers_read = [key for key in storage.gets if "/commits/" in key]
    assert caught.folded == 3 and len(markers_read) == 3, "30 markers are in the checkpoint"
    assert resumed.ledger.completed == 330 and resumed.markers == 33


def test_a_torn_or_foreign_checkpoint_is_skipped_for_an_older_one(tmp_path):
    storage = LocalStorage(tmp_path)
    commit(storage, 1, range(1, 11), T0)
    index, _ = open_index(storage, "d", 20)
    good = write_checkpoint(storage, index, "w000", T0)
    commit(storage, 2, range(11, 21), T0 + timedelta(minutes=30))
    catch_up(storage, index)
    newer = write_checkpoint(storage, index, "op", T0)
    assert newer > good
    data = bytearray(storage.get(newer))
    data[-5] ^= 0xFF
    storage.put(newer, bytes(data))
    with pytest.raises(CheckpointError, match="digest"):
        decode(bytes(data), "d")
    with pytest.raises(CheckpointError, match="dataset 'd', not 'e'"):
        decode(storage.get(good), "e")
    loaded = load_index(storage, "d", 20)
    assert loaded.markers == 1 and loaded.ledger.completed == 10, "the newest that verifies is used"
    assert catch_up(storage, loaded, full=True).folded == 1 and loaded.ledger.completed == 20


def test_old_checkpoints_are_pruned_to_the_newest_few(tmp_path):
    storage = LocalStorage(tmp_path)
    index = DatasetIndex(DatasetLedger("d", 100))
    for seq in range(1, 7):
        commit(storage, seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(hours=seq))
        catch_up(storage, index)
        write_checkpoint(storage, index, "op", T0)
    kept = sorted(storage.list("d/index/"))
    assert len(kept) == 3 and load_index(storage, "d").markers == 6


def test_leftovers_are_found_from_the_index_without_listing_markers_again(tmp_path):
    storage = LocalStorage(tmp_path)
    commit(storage, 1, range(1, 11), T0)
    storage.put("d/shards/w000-t-000002.parquet", b"killed before its marker")
    storage.put("d/shards/w001-u-000001.parquet", b"another worker's")
    (tmp_path / "d/commits" / f"{time_key(T0)}-w000-t-000003.json.tmp-x").write_bytes(b"{")
    index, caught = open_index(storage, "d", 10)
    found = sorted(leftovers(storage, "d", 0, index.knows, caught.strays))
    assert found == sorted(leftovers(storage, "d", 0)) == [f"d/commits/{time_key(T0)}-w000-t-000003.json.tmp-x",
                                                           "d/shards/w000-t-000002.parquet"]


def test_the_ledger_holds_a_bit_per_slot_when_nothing_failed():
    ledger = DatasetLedger("d", 0)
    tracemalloc.start()
    try:
        for start in range(1, 1_000_001, 256):
            ledger.fold({"samples": {"line": list(range(start, min(start + 256, 1_000_001)))}, "failed": {}})
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ledger.completed == 1_000_000 and ledger.nbytes <= 1_000_000 // 8 * 2  # grown by doubling
    assert held < 300_000, f"{held} bytes for a million slots"


def test_a_writer_clock_far_ahead_does_not_hide_later_markers_of_correct_clocks(tmp_path):
    # Review 11b: one worker's clock an hour ahead moved the horizon past every correctly clocked worker's names.
    storage = CountingStorage(tmp_path)
    commit(storage, 1, range(1, 11), T0 + timedelta(hours=1))  # named by a clock one hour ahead
    index = DatasetIndex(DatasetLedger("d", 100))
    catch_up(storage, index, now=T0)
    assert index.ledger.completed == 10, "the marker from the future is folded all the same"
    assert index.horizon <= time_key(T0 + MAX_CLOCK_SKEW - OVERLAP)
    commit(storage, 2, range(11, 21), T0 + timedelta(minutes=1))  # a correct clock, committed just after
    assert catch_up(storage, index, now=T0 + timedelta(minutes=2)).folded == 1
    assert index.ledger.completed == 20


def test_a_checkpoint_snapshot_is_the_index_of_its_moment_whatever_folds_after_it(tmp_path):
    # Review 6: encoding happened in a thread while the loop kept folding; a fold in between gave a checkpoint that
    # knew a shard but lacked its outcomes. A snapshot copies what it writes.
    storage = LocalStorage(tmp_path)
    index = DatasetIndex(DatasetLedger("d", 100))
    first = commit(storage, 1, range(1, 11), T0)
    index.fold(first["shard_id"], first)
    taken = take_checkpoint(index, "w000", T0)
    second = commit(storage, 2, range(11, 21), T0, errors=[{"line": 30, "sample_index": 0, "reason": "invalid_json"}])
    index.fold(second["shard_id"], second)
    restored = decode(taken.encode(), "d")
    assert restored.markers == 1 and restored.knows(first["shard_id"]) and not restored.knows(second["shard_id"])
    assert restored.ledger.completed == 10 and restored.ledger.failed == 0
    assert index.since_checkpoint == 1, "the fold after the snapshot is still to be checkpointed"
