"""The output lease on the local folder store: conditional writes (exclusive create, replace-if-unchanged under a
lock), staleness judged only by watching on the observer's own clock, fencing before each marker, and cleaners that
keep another run's young unmarked files. The S3 races with real `tokenmill run` processes are in
tests/integration/test_lease_races.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta

import orjson
import pytest

from tests.fake_clock import FakeClock
from tokenmill_runner.store.lease import (
    LEASE,
    Lease,
    LeaseHeld,
    LeaseKeeper,
    LeaseLost,
    LeaseUnsupported,
    acquire,
    read_lease,
)
from tokenmill_runner.store.lease_rules import MAX_LEASE_BYTES, CleanRule, LeaseError, LeaseTimes, refusal
from tokenmill_runner.store.ledger import ShardContent
from tokenmill_runner.store.manifest import Owner
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.shards import clean_leftovers, commit_shard
from tokenmill_runner.store.storage import LocalStorage, PreconditionFailed

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
RESOURCE = Owner(kind="DatasetGeneration", name="b5", namespace="ml", uid="uid-1")
CLI = Owner(kind="cli", name="b5")
OTHER = Owner(kind="cli", name="other")
TIMES = LeaseTimes(stale_s=120.0)


def take(storage, owner=CLI, holder="laptop:1", clock=None, token="tok1", times=TIMES, **kwargs):
    clock = clock or FakeClock()
    return acquire(storage, owner, holder, token, times=times, clock=clock, sleep=clock.sleep, **kwargs)


def test_the_local_store_s_conditional_writes_let_exactly_one_of_two_racers_create_and_replace(tmp_path):
    storage = LocalStorage(tmp_path)
    wins: list[str] = []

    def create(name: str) -> None:
        try:
            storage.put_new("k", name.encode())
            wins.append(name)
        except PreconditionFailed:
            pass

    threads = [threading.Thread(target=create, args=(f"w{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wins) == 1 and storage.get("k") == wins[0].encode()
    data, version = storage.get_versioned("k", 100)
    replaced: list[str] = []

    def replace(name: str) -> None:
        try:
            storage.put_replacing("k", name.encode(), version)
            replaced.append(name)
        except PreconditionFailed:
            pass

    threads = [threading.Thread(target=replace, args=(f"r{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(replaced) == 1 and storage.get("k") == replaced[0].encode()
    with pytest.raises(PreconditionFailed):
        storage.put_replacing("gone", b"x", version)


def test_a_live_owner_is_refused_naming_the_holder_and_the_rules_never_read_its_clock():
    lease = Lease(RESOURCE, "pod-0", NOW - timedelta(hours=2), NOW + timedelta(days=3))  # renewed "in the future"
    why = refusal(lease, CLI, "laptop:1", unchanged_s=0.0, times=TIMES)
    assert why and "DatasetGeneration ml/b5 (uid uid-1)" in why and "--take-over" in why
    assert refusal(lease, CLI, "laptop:1", unchanged_s=119.0, times=TIMES)
    assert refusal(lease, CLI, "laptop:1", unchanged_s=120.0, times=TIMES) is None, "a lease from the future is " \
        "free once it stayed unchanged for the stale period"
    assert refusal(lease, CLI, "laptop:1", unchanged_s=0.0, take_over=True, times=TIMES) is None
    assert refusal(lease, RESOURCE, "pod-7 of the next Job", 0.0, times=TIMES) is None
    assert refusal(lease, RESOURCE.model_copy(update={"uid": "uid-2"}), "pod-0", 0.0, times=TIMES)
    process = Lease(CLI, "laptop:1", NOW, NOW)
    assert refusal(process, CLI, "laptop:1", 0.0, times=TIMES) is None
    assert refusal(process, CLI, "laptop:2", 0.0, times=TIMES)


def test_a_renewing_holder_keeps_the_output_whatever_its_clock_or_host_name_say(tmp_path):
    # Issue 29: a reader 90 s ahead (here: the holder's renewed_at 10 minutes behind), or a holder named after this
    # host with a pid that does not exist, used to be judged free. Only watching tells, and it sees renewals.
    storage = LocalStorage(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = f"{socket.gethostname()}:{gone.stdout.strip()}:abcd"
    behind = Lease(OTHER, holder, NOW, datetime.now(UTC) - timedelta(minutes=10))
    storage.put(LEASE, behind.encode())

    def renews() -> None:  # the live holder, renewing while the newcomer watches
        current = storage.get_versioned(LEASE, MAX_LEASE_BYTES)
        storage.put_replacing(LEASE, behind.renewed(datetime.now(UTC) - timedelta(minutes=10)).encode(), current[1])

    clock = FakeClock(on_sleep=renews)
    with pytest.raises(LeaseHeld, match="tokenmill run 'other'"):
        take(storage, clock=clock)
    assert clock.slept < TIMES.stale_s
    assert read_lease(storage).owner == OTHER


def test_a_lease_unchanged_for_the_stale_period_is_taken_and_its_young_leftovers_are_kept(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.put(LEASE, Lease(OTHER, "elsewhere:1:x", NOW, NOW + timedelta(hours=1), ("deadtoken",)).encode())
    clock = FakeClock()
    acquired = take(storage, clock=clock)
    assert clock.slept >= TIMES.stale_s
    assert read_lease(storage).holder == "laptop:1" and read_lease(storage).tokens == ("tok1",)
    assert acquired.clean.finished == frozenset(), "a paused holder's marker may still land: only age frees them"
    assert acquired.clean.store_now == storage.modified(LEASE)


def test_two_racing_acquirers_of_one_local_output_one_holds_it(tmp_path):
    storage = LocalStorage(tmp_path)
    results: list[object] = []
    barrier = threading.Barrier(2)

    def run(holder: str) -> None:
        clock = FakeClock()
        barrier.wait()
        try:
            results.append(acquire(storage, Owner(kind="cli", name=holder), holder, holder, times=TIMES,
                                   clock=clock, sleep=lambda s: (_ for _ in ()).throw(LeaseHeld("still watching"))))
        except LeaseHeld as error:
            results.append(error)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("one", "two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held = [r for r in results if not isinstance(r, LeaseHeld)]
    assert len(held) == 1 and read_lease(storage).holder == held[0].lease.holder


def test_a_process_releases_the_lease_and_the_next_run_takes_it_at_once(tmp_path):
    storage = LocalStorage(tmp_path)
    acquired = take(storage)
    keeper = LeaseKeeper(storage, acquired, times=TIMES, every_s=3600)
    with pytest.raises(LeaseHeld):
        take(storage, holder="laptop:2", clock=FakeClock(on_sleep=keeper.renew))
    with keeper:
        pass
    raw = orjson.loads(storage.get(LEASE))
    assert raw["released"] is True and read_lease(storage) is None
    clock = FakeClock()
    again = take(storage, holder="laptop:2", clock=clock)
    assert clock.slept == 0 and again.clean.finished == frozenset({"tok1"})


def test_a_take_over_wins_over_a_slow_renewal_and_the_taken_over_writer_commits_nothing_more(tmp_path):
    storage = LocalStorage(tmp_path)
    keeper = LeaseKeeper(storage, take(storage), times=TIMES, every_s=3600)
    clock = FakeClock()
    take(storage, owner=OTHER, holder="laptop:9", take_over=True, clock=clock)
    assert clock.slept == TIMES.take_over_wait_s, "the taker waits for the old writer's last commits"
    keeper.renew()  # the renewal that was slow: its If-Match names the version the take-over replaced
    assert keeper.lost.is_set() and "taken over" in keeper.why
    with pytest.raises(LeaseLost):
        keeper.prove()
    keeper.close()
    assert read_lease(storage).holder == "laptop:9", "the taker's lease stays"


def test_a_writer_whose_last_renewal_is_too_old_writes_no_marker(tmp_path):
    storage = LocalStorage(tmp_path)
    clock = FakeClock()
    keeper = LeaseKeeper(storage, take(storage, clock=clock), times=TIMES, clock=clock, every_s=3600)
    fence = keeper.commit_fence
    content = ShardContent([], [{"line": 1, "sample_index": 0, "reason": "invalid_json", "message": "x"}])
    commit_shard(storage, "d", "w000-tok1-000001", 0, content, fence=fence)
    clock.now += TIMES.stale_s + 1  # paused (SIGSTOP, a suspended laptop) past the stale period
    with pytest.raises(LeaseLost, match="past its stale period"):
        commit_shard(storage, "d", "w000-tok1-000002", 0, content, fence=fence)
    assert [m["shard_id"] for m in read_markers(storage, "d")] == ["w000-tok1-000001"]
    assert storage.exists("d/errors/w000-tok1-000002.jsonl"), "its data is an unmarked leftover, never counted"


def test_a_late_renewal_lets_a_waiting_commit_through(tmp_path):
    storage = LocalStorage(tmp_path)
    clock = FakeClock()
    keeper = LeaseKeeper(storage, take(storage, clock=clock), times=TIMES, clock=clock, every_s=3600)
    clock.now += TIMES.stale_s - TIMES.margin_s + 1  # past the fencing age, not yet stale: the fence waits
    renewer = threading.Thread(target=keeper.renew)  # the fake clock stands still: only the renewal lets it pass
    renewer.start()
    keeper.prove()
    renewer.join()
    assert not keeper.lost.is_set()


def test_cleaners_keep_another_run_s_young_unmarked_files_and_remove_old_or_finished_ones(tmp_path):
    storage = LocalStorage(tmp_path)
    for name in ("w000-young-000001", "w000-old-000001", "w000-done-000001"):
        storage.put(f"d/shards/{name}.parquet", b"x")
    old = (datetime.now(UTC) - timedelta(hours=1)).timestamp()
    os.utime(tmp_path / "d/shards/w000-old-000001.parquet", (old, old))
    rule = CleanRule(frozenset({"done"}), storage.modified("d/shards/w000-young-000001.parquet"), TIMES.keep_unmarked_s)
    assert clean_leftovers(storage, "d", 0, rule) == 2
    assert [key for key in storage.list("d/")] == ["d/shards/w000-young-000001.parquet"]


def test_an_oversized_lease_is_refused_unread(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.put(LEASE, b" " * (MAX_LEASE_BYTES + 1))
    with pytest.raises(LeaseError, match=f"over the {MAX_LEASE_BYTES}"):
        read_lease(storage)
    with pytest.raises(LeaseError):
        take(storage)


class IgnoresConditions(LocalStorage):
    """A store that accepts every conditional write, as some S3-compatible stores do."""

    def put_new(self, key, data, budget_s=None):
        self.put(key, data)
        return "v"

    def put_replacing(self, key, data, version, budget_s=None):
        self.put(key, data)
        return "v"


def test_a_store_that_ignores_conditional_writes_is_refused_unless_the_user_opts_in(tmp_path):
    from tokenmill_runner.store import lease as lease_module

    storage = IgnoresConditions(tmp_path)
    assert not lease_module.conditional_writes(storage)
    with pytest.raises(LeaseUnsupported, match="allowUnconditionalWrites"):
        take(storage)
    assert not storage.exists(LEASE) and not [key for key in storage.list("") if lease_module.PROBE in key]
    acquired = take(storage, allow_unconditional=True)
    assert read_lease(storage).holder == acquired.lease.holder
    assert lease_module.conditional_writes(LocalStorage(tmp_path / "real")), "the folder store honours them"


def test_a_resource_s_workers_share_the_lease_and_renew_on_top_of_each_other(tmp_path):
    storage = LocalStorage(tmp_path)
    workers = [LeaseKeeper(storage, take(storage, owner=RESOURCE, holder=f"pod-{i}"), times=TIMES, every_s=3600)
               for i in range(3)]
    for _ in range(2):
        for keeper in workers:
            keeper.renew()  # each renewal replaces the version the others hold: they renew on top of it
    assert not any(keeper.lost.is_set() for keeper in workers)
    take(storage, owner=OTHER, holder="laptop:9", take_over=True)
    workers[0].renew()
    assert workers[0].lost.is_set(), "another owner's take-over is not shared"


def test_a_writer_whose_lease_is_lost_writes_no_state_marker_or_failure_record(tmp_path):
    # Issue 28: the hidden-state pass commits after the stream; its markers answer to the same fence as a shard's.
    import numpy as np

    from tokenmill_runner.facts.hidden_states import StateShape
    from tokenmill_runner.store.hidden_states import captured_keys, commit_states, failed_keys, record_failure

    storage = LocalStorage(tmp_path)
    clock = FakeClock()
    keeper = LeaseKeeper(storage, take(storage, clock=clock), times=TIMES, clock=clock, every_s=3600)
    fence = keeper.commit_fence
    shape = StateShape(3, 4, "bfloat16")
    values = np.zeros(2 * shape.row_values)
    commit_states(storage, "d", "s1", 0, [5, 6], values, shape, fence=fence)
    clock.now += TIMES.stale_s + 1  # paused past the stale period between the file and its marker
    with pytest.raises(LeaseLost, match="past its stale period"):
        commit_states(storage, "d", "s2", 0, [7, 8], values, shape, fence=fence)
    with pytest.raises(LeaseLost):
        record_failure(storage, "d", "s3", 0, "HTTP 500", fence=fence)
    assert len(captured_keys(storage, "d")) == 1, "only the sample committed while the lease was held counts"
    assert failed_keys(storage, "d") == set()
    assert len(list(storage.list("d/hidden_states/"))) == 2, "the second file is an unmarked leftover, never counted"


# -- one ownership rule (issue 39; review of f9665d2: bug 1, bug 9 and the suspected fence dating) -----------------
def test_a_shared_lease_keeps_every_worker_s_token_and_a_taker_seals_them_all_and_those_in_the_output(tmp_path):
    # Review bug 1: each joiner and renewer wrote only its own token, so a taker sealed one worker out of N.
    from tokenmill_runner.store.seals import read_seals

    storage = LocalStorage(tmp_path)
    storage.put("d/shards/w007-oldjob0000000000-000001.parquet", b"x")  # an earlier Job's worker, in no record
    workers = [LeaseKeeper(storage, take(storage, owner=RESOURCE, holder=f"pod-{i}", token=f"tok{i}"), times=TIMES,
                           every_s=3600) for i in range(3)]
    for keeper in (workers[2], workers[0], workers[1], workers[0]):
        keeper.renew()  # each renewal writes what it read plus its own token
    assert set(read_lease(storage).tokens) == {"tok0", "tok1", "tok2"}
    assert read_lease(storage).tokens[-1] == "tok0", "the most recently written token last"
    take(storage, owner=OTHER, holder="laptop:9", token="mine", take_over=True)
    assert set(read_seals(storage, "d").sealed) == {"tok0", "tok1", "tok2", "oldjob0000000000"}


def test_a_renewal_is_dated_by_when_it_was_sent_not_when_its_answer_came_back(tmp_path):
    # Review, suspected: a renewal that landed at once and answered late moved the fence's clock to its answer, so
    # its holder could commit after an observer had watched that version for the whole stale period.
    clock = FakeClock()

    class SlowAnswers(LocalStorage):
        def put_replacing(self, key, data, version, budget_s=None):
            written = super().put_replacing(key, data, version, budget_s)
            clock.now += 70  # the write landed; its answer takes 70 s to come back
            return written

    storage = SlowAnswers(tmp_path)
    keeper = LeaseKeeper(storage, take(storage, clock=clock), times=TIMES, clock=clock, every_s=3600)
    sent = clock.now
    keeper.renew()
    clock.now = sent + TIMES.stale_s + 1  # an observer that saw that version at `sent` may have taken the output
    with pytest.raises(LeaseLost, match="past its stale period"):
        keeper.prove()


def test_a_shared_renewal_that_loses_its_race_to_a_sibling_proves_the_lease_without_a_retry_storm(tmp_path):
    # Review bug 9: two 412s in a row ended a round silently, and the misses added up to LeaseLost. A lost race
    # proves the lease as of this worker's previous look; at most two conditional writes move the proof forward.
    clock = FakeClock()
    writes: list[str] = []

    class Counting(LocalStorage):
        def put_replacing(self, key, data, version, budget_s=None):
            writes.append(key)
            return super().put_replacing(key, data, version, budget_s)

    storage = Counting(tmp_path)
    one, two = (LeaseKeeper(storage, take(storage, owner=RESOURCE, holder=f"pod-{i}", token=f"tok{i}", clock=clock),
                            times=TIMES, clock=clock, every_s=3600) for i in range(2))
    for _ in range(5):
        clock.now += 20
        before = two._renewed_at
        one.renew()  # wins
        writes.clear()
        assert two.renew(), "the race lost to `one` is a proof"
        assert two._renewed_at > before and len(writes) <= 2
    assert not one.lost.is_set() and not two.lost.is_set()
    assert clock.now - two._renewed_at <= 2 * 20, "never older than the previous round's look"


def test_a_worker_that_finds_its_owner_s_record_under_another_tenure_has_lost_the_lease(tmp_path):
    # Taken over and handed back meanwhile: another run took the output, finished and released it, and a new worker
    # of the same resource joined the released record. The old worker's renewal used to renew on top of it.
    storage = LocalStorage(tmp_path)
    old = LeaseKeeper(storage, take(storage, owner=RESOURCE, holder="pod-0", token="tok0"), times=TIMES,
                      every_s=3600)
    with LeaseKeeper(storage, take(storage, owner=OTHER, holder="laptop:9", token="mine", take_over=True),
                     times=TIMES, every_s=3600):
        pass  # the taker finishes and gives the lease up
    take(storage, owner=RESOURCE, holder="pod-0 of the next Job", token="tok9")
    assert not old.renew() and old.lost.is_set() and "taken over" in old.why
    with pytest.raises(LeaseLost):
        old.confirm()


def test_the_lease_is_never_given_up_while_a_record_write_is_in_flight(tmp_path):
    # Review, suspected: a run that failed (CommitFailed, LeaseLost) released its lease while commit threads still
    # ran; the next run took it at once and deleted their data as a finished run's leftovers.
    storage = LocalStorage(tmp_path)
    short = LeaseTimes(stale_s=1.0)  # a margin of 0.25 s: how long close() waits for a write in flight
    clock = FakeClock()
    keeper = LeaseKeeper(storage, take(storage, times=short, clock=clock), times=short, clock=clock, every_s=3600)
    entered, finish = threading.Event(), threading.Event()
    writer = threading.Thread(target=write_with(keeper, entered, finish))
    writer.start()
    entered.wait(30)
    keeper.close()
    assert read_lease(storage) is not None, "left to go stale, not released under a write that may still land"
    with pytest.raises(LeaseLost, match="giving"):
        keeper.prove()
    finish.set()
    writer.join()
    again = LeaseKeeper(storage, take(storage, holder="laptop:2", times=short, clock=clock), times=short,
                        clock=clock, every_s=3600)
    entered.clear()
    finish.clear()
    writer = threading.Thread(target=write_with(again, entered, finish))
    writer.start()
    entered.wait(30)
    threading.Timer(0.1, finish.set).start()  # the write ends within the margin: then the lease is given up
    again.close()
    writer.join()
    assert read_lease(storage) is None


def write_with(keeper, entered, finish):
    def write() -> None:
        with keeper.writing():
            entered.set()
            finish.wait(30)
    return write
