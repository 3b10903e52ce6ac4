"""Issue 29: a taken-over writer's marker PUT already past its fence (a SIGSTOP between the fence and the write, a
PUT held in flight) lands after the takeover. No write of the taker can refuse it on S3, so the taker seals the old
run token first (store/seals.py) and every reader counts only the markers the seal names."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.fake_clock import FakeClock
from tokenmill_runner.store.index_store import open_index, write_checkpoint
from tokenmill_runner.store.lease import LEASE, LeaseKeeper, acquire, read_versioned
from tokenmill_runner.store.lease_rules import Lease, LeaseTimes
from tokenmill_runner.store.ledger import ShardContent, Slot
from tokenmill_runner.store.manifest import Owner
from tokenmill_runner.store.markers import list_commits, read_markers
from tokenmill_runner.store.seals import encode_seal, read_seals, seal_key, seal_tokens
from tokenmill_runner.store.shards import commit_shard, leftovers, read_ledger
from tokenmill_runner.store.storage import LocalStorage

from .counting_storage import rows

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TIMES = LeaseTimes(stale_s=120.0)
A, B = Owner(kind="cli", name="a"), Owner(kind="cli", name="b")


def take(storage, owner, token, **kwargs):
    clock = FakeClock()
    return acquire(storage, owner, f"host:1:{token}", token, times=TIMES, clock=clock, sleep=clock.sleep, **kwargs)


def commit(storage, token: str, seq: int, lines: range, minute: int) -> None:
    at = T0 + timedelta(minutes=minute)
    commit_shard(storage, "d", f"w000-{token}-{seq:06d}", 0, ShardContent(rows("d", lines), []), clock=lambda: at)


def slots(storage) -> list[int]:
    return sorted(line for marker in read_markers(storage, "d") for line in marker["samples"]["line"])


def test_a_marker_landing_after_a_takeover_counts_for_nobody_and_its_slots_are_the_taker_s(tmp_path):
    storage = LocalStorage(tmp_path)
    take(storage, A, "aaaa")
    commit(storage, "aaaa", 1, range(1, 4), 1)
    taker = take(storage, B, "bbbb", take_over=True)
    assert taker.lease.sealing == (), "sealed before acquire returns: the first renewal drops the list"
    stored = read_versioned(storage)
    assert stored is not None and stored[0] is not None and stored[0].sealing == ("aaaa",), \
        "until it is sealed, the record keeps the tokens for a taker that dies sealing"
    seals = read_seals(storage, "d")
    assert set(seals.sealed) == {"aaaa"}
    assert seals.counts("commits", "w000-aaaa-000001") and not seals.counts("commits", "w000-aaaa-000002")

    commit(storage, "aaaa", 2, range(4, 7), 2)  # the old writer's marker PUT, past its fence before the takeover
    listed = list(list_commits(storage, "d"))
    assert [(entry.shard_id, entry.late) for entry in listed] == [("w000-aaaa-000001", False),
                                                                   ("w000-aaaa-000002", True)]
    ledger = read_ledger(storage, "d", 9)
    assert ledger.outcome(Slot(4, 0)) is None, "the late marker's slots are not done: the taker generates them"
    index, caught = open_index(storage, "d", 9)
    assert caught.late == 1 and not index.ledger.is_done(Slot(5, 0))
    assert "d/shards/w000-aaaa-000002.parquet" in set(leftovers(storage, "d")), "its data is an unmarked leftover"

    commit(storage, "bbbb", 1, range(4, 10), 3)
    assert slots(storage) == list(range(1, 10)), "every slot once: none counted twice"


def test_a_checkpoint_that_folded_a_late_marker_is_folded_again_without_it(tmp_path, caplog):
    storage = LocalStorage(tmp_path)
    commit(storage, "aaaa", 1, range(1, 4), 1)
    commit(storage, "aaaa", 2, range(4, 7), 2)
    index, _ = open_index(storage, "d", 9)
    write_checkpoint(storage, index, "w000")  # a reader folded marker 2 in the gap before the seal was written
    storage.put_new(seal_key("d", "aaaa"), encode_seal("aaaa", {"commits": ["w000-aaaa-000001"]}, "host:1:bbbb", T0))
    again, caught = open_index(storage, "d", 9)
    assert "folding every marker again" in caplog.text
    assert caught.late == 1 and again.ledger.completed == 3 and again.ledger.outcome(Slot(4, 0)) is None


def test_the_first_seal_of_a_token_wins(tmp_path):
    storage = LocalStorage(tmp_path)
    commit(storage, "aaaa", 1, range(1, 4), 1)
    storage.put("plots/report.md", b"not a dataset")
    assert seal_tokens(storage, storage, ["aaaa"], "host:1:bbbb") == 1
    assert list(storage.list("plots/")) == ["plots/report.md"], "only dataset folders are sealed"
    commit(storage, "aaaa", 2, range(4, 7), 2)
    assert seal_tokens(storage, storage, ["aaaa"], "host:1:cccc") == 0, "a second taker keeps the first seal"
    seals = read_seals(storage, "d")
    assert seals.counts("commits", "w000-aaaa-000001") and not seals.counts("commits", "w000-aaaa-000002")


def test_a_taker_that_died_while_sealing_leaves_the_tokens_to_the_next_one(tmp_path):
    storage = LocalStorage(tmp_path)
    commit(storage, "aaaa", 1, range(1, 4), 1)
    storage.put(LEASE, Lease(B, "elsewhere:1:bbbb", T0, T0, ("bbbb",), sealing=("aaaa",)).encode(TIMES))
    taker = take(storage, Owner(kind="cli", name="c"), "cccc")  # stale while watched: bbbb may be alive too
    assert set(read_seals(storage, "d").sealed) == {"aaaa", "bbbb"}
    keeper = LeaseKeeper(storage, taker, times=TIMES, every_s=3600)
    keeper.renew()
    stored = read_versioned(storage)
    assert stored is not None and stored[0] is not None and stored[0].sealing == ()


def test_a_taken_over_writer_s_late_state_marker_and_failure_record_count_for_nobody(tmp_path):
    # Review, suspected: state files and their markers were keyed by sample, not fenced by token: a taken-over
    # writer's late capture replaced the taker's committed objects, and seals covered shard markers only.
    import numpy as np

    from tokenmill_runner.facts.hidden_states import StateShape
    from tokenmill_runner.store.hidden_states import (
        captured_keys,
        commit_states,
        failed_keys,
        record_failure,
        sample_key,
        state_markers,
    )
    from tokenmill_runner.store.ownership import Fence

    storage = LocalStorage(tmp_path)
    shape, values = StateShape(1, 4, "bfloat16"), np.zeros(2 * 4)
    take(storage, A, "aaaa")
    commit(storage, "aaaa", 1, range(1, 4), 1)
    old, new = Fence.unleased("aaaa"), Fence.unleased("bbbb")
    commit_states(storage, "d", "s1", 0, [1, 2], values, shape, old)
    take(storage, B, "bbbb", take_over=True)
    seals = read_seals(storage, "d")
    assert seals.counts("hidden_commits", f"{sample_key('s1', 0)}-aaaa")
    assert seals.sealed["aaaa"]["hidden_commits"].size == 1
    commit_states(storage, "d", "s2", 0, [1, 2], values, shape, new)
    committed = {key: storage.identity(key) for key in storage.list("d/") if "/hidden_" in key}
    # The old writer's capture of s2 and its failure record for s3 land late, after the seal.
    commit_states(storage, "d", "s2", 0, [1, 2], values + 1, shape, old)
    record_failure(storage, "d", "s3", 0, "HTTP 503", old)
    assert {key: storage.identity(key) for key in committed} == committed, "no committed object was replaced"
    assert captured_keys(storage, "d") == {sample_key("s1", 0), sample_key("s2", 0)}
    assert failed_keys(storage, "d") == set()
    assert [m["file"] for m in state_markers(storage, "d") if m["sample_id"] == "s2"] == \
        [f"hidden_states/{sample_key('s2', 0)}-bbbb.safetensors"]
