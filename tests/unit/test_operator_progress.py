"""The operator's passes read what was committed since the last pass, keep no marker, and survive a restart by
reading a checkpoint instead of the whole history."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import orjson

from tokenmill_operator.observe.gather import FULL_LISTING_EVERY, OutputIndex, observe_progress
from tokenmill_runner.store import index_store
from tokenmill_runner.store.marker_names import shard_id_of, time_key

from .counting_storage import CountingStorage, commit_lines

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def run_json(storage, rows: dict[str, int]) -> None:
    storage.put("run.json", orjson.dumps({"datasets": {name: {"rows": n} for name, n in rows.items()}}))


def markers_read(storage: CountingStorage) -> list[str]:
    return [shard_id_of(key) for key in storage.gets if "/commits/" in key]


def counted(storage, output, now, passes: int = 50):
    """The passes of an operator that met the output without a checkpoint it trusts, until its markers are counted
    (`output.counting`: no progress before): the last pass's progress."""
    for second in range(passes):
        progress, _ = observe_progress(storage, output, now + timedelta(seconds=second), T0)
        if not output.counting:
            return progress
        assert progress is None, "partial figures are not progress"
    raise AssertionError(f"the markers were not counted in {passes} passes")


def test_an_output_without_a_trusted_checkpoint_is_counted_in_bounded_steps_a_pass_each(tmp_path, monkeypatch):
    # An operator restarted with another checkpoint key meets 10M samples' markers: it counts them from the first in
    # steps of at most SWEEP_NAMES names and MARKERS_PER_PASS reads, the passes following at once, rather than
    # reading all of them in one pass (39,000 GETs, 154 s on S3). Until the end it has no progress to show.
    from tokenmill_operator.observe import gather

    monkeypatch.setattr(gather, "MARKERS_PER_PASS", 2)
    monkeypatch.setattr(gather, "SWEEP_NAMES", 4)
    monkeypatch.setattr(gather, "CHECKPOINT_EVERY", 5)
    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 1000, "b": 1000})
    for seq in range(1, 8):
        commit_lines(storage, "a", seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(seconds=seq))
    commit_lines(storage, "b", 1, range(1, 11), T0 + timedelta(seconds=1))
    output = OutputIndex()
    seen = []
    for second in range(20):
        storage.reset()
        if second == 2:  # a runner commits while the operator counts: its newer name is listed when reached
            commit_lines(storage, "a", 8, range(71, 81), T0 + timedelta(minutes=5))
        progress, _ = observe_progress(storage, output, T0 + timedelta(minutes=10, seconds=second), T0)
        seen.append((len(markers_read(storage)), progress is None, output.behind))
        if not output.counting:
            break
    assert all(reads <= 2 for reads, *_ in seen) and len(seen) == 5, seen
    assert all(hidden and behind for _, hidden, behind in seen[:-1]), f"no partial figures, next step at once: {seen}"
    assert progress is not None and progress.overall.completed == 90 and not output.behind
    assert [d.completed for d in sorted(progress.datasets, key=lambda d: d.name)] == [80, 10]
    storage.reset()
    commit_lines(storage, "a", 9, range(81, 91), T0 + timedelta(minutes=11))
    progress, _ = observe_progress(storage, output, T0 + timedelta(minutes=12), T0)
    assert markers_read(storage) == ["w000-t-000009"] and progress.overall.completed == 100
    assert all(index.horizon for index in output.datasets.values()) and not output.counting, \
        "counted: each dataset has a horizon, and a pass lists what is new from there"
    # No checkpoint while counting (every 5 markers here otherwise: it would have no horizon); the pass after the
    # count's end wrote one that has: an operator restarted with the same key starts from it, reads only what is new.
    newest = index_store.load_index(storage, "a", 1000, 1, gather.checkpoint_signer())
    assert newest.markers == 8 and newest.horizon, "a checkpoint with the horizon the count settled"
    commit_lines(storage, "a", 10, range(91, 101), T0 + timedelta(minutes=13))
    storage.reset()
    restarted = OutputIndex()
    observe_progress(storage, restarted, T0 + timedelta(minutes=14), T0)
    assert "a" not in restarted.counted and sorted(markers_read(storage)) == ["w000-t-000009", "w000-t-000010"]
    progress, _ = observe_progress(storage, restarted, T0 + timedelta(minutes=14, seconds=1), T0)
    assert not restarted.counting and progress.overall.completed == 110, "b (one marker, no checkpoint) counted"


def test_each_pass_reads_only_the_markers_committed_since_the_last(tmp_path):
    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 1000, "b": 1000})
    for seq in range(1, 11):
        commit_lines(storage, "a", seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(seconds=seq))
    output = OutputIndex()
    progress, _ = observe_progress(storage, output, T0 + timedelta(minutes=1), T0)
    assert progress.overall.completed == 100 and len(markers_read(storage)) == 10

    storage.reset()
    commit_lines(storage, "a", 11, range(101, 111), T0 + timedelta(minutes=2))
    commit_lines(storage, "b", 1, range(1, 6), T0 + timedelta(minutes=2))
    progress, _ = observe_progress(storage, output, T0 + timedelta(minutes=3), T0)
    assert sorted(markers_read(storage)) == ["w000-t-000001", "w000-t-000011"]
    assert (progress.overall.completed, [d.completed for d in progress.datasets]) == (115, [110, 5])
    assert progress.last_commit_time == T0 + timedelta(minutes=2)

    storage.reset()
    again, _ = observe_progress(storage, output, T0 + timedelta(minutes=4), T0)
    assert markers_read(storage) == [] and again.overall == progress.overall.model_copy(
        update={"samples_per_second": again.overall.samples_per_second,
                "tokens_per_second": again.overall.tokens_per_second,
                "eta_seconds": again.overall.eta_seconds, "eta": again.overall.eta})


def test_a_pass_reads_at_most_its_share_of_markers_and_says_it_is_behind(tmp_path, monkeypatch):
    from tokenmill_operator.observe import gather

    monkeypatch.setattr(gather, "MARKERS_PER_PASS", 5)
    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 1000, "b": 1000})
    commit_lines(storage, "a", 1, range(1, 11), T0)
    commit_lines(storage, "b", 1, range(1, 11), T0)
    output = OutputIndex()
    # The first pass counts each dataset's markers from the first (one step here); then each has a horizon.
    observe_progress(storage, output, T0 + timedelta(seconds=30), T0)
    assert not output.counting
    for seq in range(2, 10):
        commit_lines(storage, "a", seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(seconds=seq))
    for seq in range(2, 6):
        commit_lines(storage, "b", seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(seconds=seq))
    reads, completed = [], []
    for second in range(31, 40):
        storage.reset()
        progress, _ = observe_progress(storage, output, T0 + timedelta(seconds=second), T0)
        reads.append(len(markers_read(storage)))
        completed.append(progress.overall.completed)
        if not output.behind:
            break
    # 12 new markers over two datasets, 5 a pass between them: three passes, the last one not behind.
    assert reads == [5, 5, 2] and completed == [70, 120, 140]
    storage.reset()
    observe_progress(storage, output, T0 + timedelta(seconds=41), T0)
    assert markers_read(storage) == [] and not output.behind


def until_whole(storage, output, now, passes: int = 20):
    """The passes of an operator once the Job finished (`full`), until the full listing reached the end: per pass,
    (names listed, markers read, samples completed, whether it still waits)."""
    seen = []
    for second in range(passes):
        storage.reset()
        progress, _ = observe_progress(storage, output, now + timedelta(seconds=second), T0, full=True)
        if progress is None:  # an index counted from the first (`output.counting`): no figures before the end
            seen.append((storage.listed, len(markers_read(storage)), None, True))
            continue
        seen.append((storage.listed, len(markers_read(storage)), progress.overall.completed,
                     progress.listing_incomplete))
        if not progress.listing_incomplete:
            return progress, seen
    raise AssertionError(f"the full listing did not end in {passes} passes: {seen}")


def test_the_full_listing_before_a_run_ends_runs_in_bounded_steps_a_pass_each(tmp_path, monkeypatch):
    from tokenmill_operator.observe import gather

    monkeypatch.setattr(gather, "MARKERS_PER_PASS", 2)
    monkeypatch.setattr(gather, "SWEEP_NAMES", 4)
    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 1000})
    commit_lines(storage, "a", 1, range(1, 11), T0)
    output = OutputIndex()
    observe_progress(storage, output, T0 + timedelta(seconds=30), T0)
    for seq in range(2, 8):
        commit_lines(storage, "a", seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(seconds=seq))
    progress, seen = until_whole(storage, output, T0 + timedelta(seconds=31))
    # 7 names, at most 4 listed and 2 read a pass (a step stops at the first name it may not read): each pass waits
    # for the next until the listing reached the end.
    assert seen == [(4, 2, 30, True), (3, 2, 50, True), (2, 2, 70, False)], seen
    assert progress.overall.completed == 70 and not progress.settled and not output.behind
    storage.reset()
    again, _ = observe_progress(storage, output, T0 + timedelta(minutes=1), T0, full=True)
    assert not again.listing_incomplete and markers_read(storage) == [], "one full listing after the Job finished"


def test_a_full_listing_begun_before_the_job_finished_does_not_count_for_its_end(tmp_path, monkeypatch):
    from tokenmill_operator.observe import gather

    monkeypatch.setattr(gather, "SWEEP_NAMES", 2)
    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 50})
    for seq in range(1, 5):
        commit_lines(storage, "a", seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(hours=1, seconds=seq))
    output = OutputIndex()
    start = T0 + timedelta(hours=1, minutes=1)
    counted(storage, output, start)
    observe_progress(storage, output, start + FULL_LISTING_EVERY, T0)  # the periodic listing's first step
    assert output.sweep is not None
    # The last shard's PUT was retried for longer than the overlap: named before the horizon, landing now, before
    # the Job ends. The periodic listing's first step went past its name already.
    commit_lines(storage, "a", 5, range(41, 51), T0)
    progress, seen = until_whole(storage, output, start + FULL_LISTING_EVERY + timedelta(seconds=5))
    assert progress.settled and progress.overall.completed == 50, seen
    assert [incomplete for *_, incomplete in seen] == [True, True, False], "a listing of its own, from the first name"

    # The run is reopened: its next Job's end needs a full listing of its own again.
    output.job_running()
    observe_progress(storage, output, start + FULL_LISTING_EVERY + timedelta(minutes=1), T0)
    later, _ = observe_progress(storage, output, start + FULL_LISTING_EVERY + timedelta(minutes=2), T0, full=True)
    assert later.listing_incomplete


def test_a_cold_index_listed_in_steps_gets_a_horizon_at_the_end(tmp_path, monkeypatch):
    from tokenmill_operator.observe import gather

    monkeypatch.setattr(gather, "SWEEP_NAMES", 3)
    monkeypatch.setattr(gather, "MARKERS_PER_PASS", 2)
    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 100})
    for seq in range(1, 8):
        commit_lines(storage, "a", seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(seconds=seq))
    output = OutputIndex()  # a restarted operator with no checkpoint, the Job already finished
    progress, seen = until_whole(storage, output, T0 + timedelta(minutes=1))
    assert progress.overall.completed == 70 and max(read for _, read, *_ in seen) <= 2, seen
    assert len(seen) > 1 and all(completed is None for _, _, completed, _ in seen[:-1]), \
        f"counted from the first: no partial figures before the listing's end: {seen}"
    assert output.datasets["a"].horizon, "the stepped listing from the first name leaves a horizon"
    storage.reset()
    observe_progress(storage, output, T0 + timedelta(minutes=2), T0)
    assert storage.listed == 7 and markers_read(storage) == [], "then only the overlap's names are listed"


def test_a_late_marker_is_found_by_the_full_listing_before_the_run_ends(tmp_path):
    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 30})
    commit_lines(storage, "a", 1, range(1, 11), T0)
    commit_lines(storage, "a", 2, range(11, 21), T0 + timedelta(hours=1))
    output = OutputIndex()
    observe_progress(storage, output, T0 + timedelta(hours=1), T0)
    # Its PUT was retried for longer than the overlap: named 30 minutes before the newest marker, visible only now.
    commit_lines(storage, "a", 3, range(21, 31), T0 + timedelta(minutes=30))
    incremental, _ = observe_progress(storage, output, T0 + timedelta(hours=1, seconds=15), T0)
    assert incremental.overall.completed == 20 and not incremental.settled
    final, _ = until_whole(storage, output, T0 + timedelta(hours=1, seconds=30))
    assert final.settled, "the Job finished: every name is listed before deciding"
    storage.reset()
    for second in range(4):  # the periodic full listing's step, taking turns with an incremental pass
        observe_progress(storage, output, T0 + timedelta(hours=1, seconds=30 + second) + FULL_LISTING_EVERY, T0)
        if not output.behind:
            break
    assert storage.listed >= 3 and markers_read(storage) == [], "the periodic full listing reads nothing it knows"


def test_the_periodic_full_listing_runs_in_bounded_steps_and_finds_a_straggler(tmp_path, monkeypatch):
    from tokenmill_operator.observe import gather

    monkeypatch.setattr(gather, "SWEEP_NAMES", 3)
    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 1000, "b": 1000})
    for seq in range(1, 8):
        commit_lines(storage, "a", seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(hours=1, seconds=seq))
    for seq in range(1, 4):
        commit_lines(storage, "b", seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(hours=1, seconds=seq))
    output = OutputIndex()
    counted(storage, output, T0 + timedelta(hours=1, minutes=1))
    # A PUT retried for longer than the overlap: named long before the horizon, so no incremental listing sees it.
    commit_lines(storage, "a", 8, range(71, 81), T0)
    start = T0 + timedelta(hours=1, minutes=1) + FULL_LISTING_EVERY
    passes: list[tuple[int, int, bool]] = []
    while len(passes) < 12:
        storage.reset()
        progress, _ = observe_progress(storage, output, start + timedelta(seconds=len(passes)), T0)
        passes.append((storage.listed, progress.overall.completed, output.behind))
        if not output.behind:
            break
    # Passes take turns: a step of the full listing (at most 3 names, never a name more: on S3 it would be another
    # page), then the incremental windows of both datasets (7 + 3 names, all within the overlap). a's 8 names take
    # three steps; b's 3 one, and a step that finds nothing after them.
    assert passes == [(3, 110, True), (10, 110, True), (3, 110, True), (10, 110, True), (2, 110, True),
                      (10, 110, True), (3, 110, True), (10, 110, True), (0, 110, False)], passes
    assert output.last_full_listing == start and output.sweep is None
    assert sorted(progress.datasets, key=lambda d: d.name)[0].completed == 80, "the straggler was folded"


def test_a_restarted_operator_starts_from_the_checkpoint_a_pass_wrote(tmp_path, monkeypatch):
    monkeypatch.setattr(index_store, "CHECKPOINT_EVERY", 20)
    monkeypatch.setattr("tokenmill_operator.observe.gather.CHECKPOINT_EVERY", 20)
    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 1000})
    for seq in range(1, 31):
        commit_lines(storage, "a", seq, range(seq * 10 - 9, seq * 10 + 1), T0 + timedelta(minutes=seq))
    output = OutputIndex()
    before, _ = observe_progress(storage, output, T0 + timedelta(minutes=31), T0)  # counted in one step
    assert not output.counting and not list(storage.list("a/index/")), "no checkpoint in the pass of a count"
    observe_progress(storage, output, T0 + timedelta(minutes=31, seconds=1), T0)
    assert len(list(storage.list("a/index/"))) == 1, "30 markers folded: the next pass wrote a checkpoint"

    commit_lines(storage, "a", 31, range(301, 311), T0 + timedelta(minutes=32))
    storage.reset()
    after, _ = observe_progress(storage, OutputIndex(), T0 + timedelta(minutes=33), T0)
    assert markers_read(storage) == ["w000-t-000031"], "the checkpoint covers the other 30"
    assert after.overall.completed == before.overall.completed + 10 == 310
    # The last 10 minutes hold the markers of minutes 23-30 (from the checkpoint's ring) and 32: 90 samples.
    assert (before.overall.samples_per_second, after.overall.samples_per_second) == ("0.167", "0.150"), \
        "the rate window survives the restart (the checkpoint keeps recent commits)"


def test_what_a_pass_keeps_grows_with_slots_not_with_markers(tmp_path):
    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 20_000})
    for seq in range(1, 201):
        commit_lines(storage, "a", seq, range(seq * 100 - 99, seq * 100 + 1), T0 + timedelta(seconds=seq))
    output = OutputIndex()
    counted(storage, output, T0 + timedelta(hours=1))
    index = output.datasets["a"]
    assert index.ledger.completed == 20_000 and index.ledger.nbytes <= 20_000 // 8 + 1
    assert index.known_hashes().nbytes == 200 * 8 and len(index.recent) <= 200


def test_progress_counts_slots_when_a_dataset_has_several_samples_per_prompt(tmp_path):
    # run.json records samples: 3 for 10 rows: 30 slots to settle; rows of sample 0 alone are a third of the way.
    from tokenmill_runner.store.ledger import ShardContent
    from tokenmill_runner.store.shards import commit_shard

    from .counting_storage import rows

    storage = CountingStorage(tmp_path)
    storage.put("run.json", orjson.dumps({"datasets": {"a": {"rows": 10, "samples": 3}}}))
    commit_lines(storage, "a", 1, range(1, 11), T0)
    output = OutputIndex()
    progress, _ = observe_progress(storage, output, T0 + timedelta(minutes=1), T0)
    assert (progress.overall.completed, progress.overall.total, progress.settled) == (10, 30, False)
    later = [{**row, "sample_index": index} for index in (1, 2) for row in rows("a", range(1, 11))]
    commit_shard(storage, "a", "w000-t-000002", 0, ShardContent(later, []), clock=lambda: T0 + timedelta(minutes=2))
    progress, _ = until_whole(storage, output, T0 + timedelta(minutes=3))
    assert (progress.overall.completed, progress.overall.total, progress.settled) == (30, 30, True)


def test_a_marker_sealed_away_after_the_operator_folded_it_stops_counting(tmp_path):
    # Review of f9665d2, suspected: the operator ignored catch_up's `tainted`: a marker it (or the checkpoint it
    # started from) had folded before a takeover's seal dropped it kept counting for the operator alone.
    from tokenmill_runner.store.seals import encode_seal, seal_key

    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 30})
    commit_lines(storage, "a", 1, range(1, 11), T0)
    commit_lines(storage, "a", 2, range(11, 21), T0 + timedelta(seconds=1))
    output = OutputIndex()
    progress, _ = observe_progress(storage, output, T0 + timedelta(minutes=1), T0)
    assert progress.overall.completed == 20
    index_store.write_checkpoint(storage, output.datasets["a"], "operator")
    # The taker listed the token's markers before the second one landed: its seal names only the first.
    storage.put_new(seal_key("a", "t"), encode_seal("t", {"commits": ["w000-t-000001"]}, "host:1:taker", T0))
    for restarted in (False, True):  # the operator's own index, and one started from the checkpoint
        progress, _ = observe_progress(storage, OutputIndex() if restarted else output, T0 + timedelta(minutes=2), T0)
        assert progress.overall.completed == 10, "the sealed-away marker counts for nobody"


def test_a_sealed_away_marker_before_the_horizon_is_dropped_by_the_periodic_full_listing(tmp_path):
    """The incremental listing sees only names after its horizon; a marker a takeover's seal dropped behind it is
    found by a step of the periodic full listing, which folds every marker again as `refresh` does."""
    from tokenmill_runner.store.seals import encode_seal, seal_key

    storage = CountingStorage(tmp_path)
    run_json(storage, {"a": 30})
    commit_lines(storage, "a", 1, range(1, 11), T0)
    commit_lines(storage, "a", 2, range(11, 21), T0 + timedelta(seconds=1))
    commit_lines(storage, "a", 3, range(21, 31), T0 + timedelta(hours=1))
    output = OutputIndex()
    progress, _ = observe_progress(storage, output, T0 + timedelta(hours=1, minutes=1), T0)
    assert progress.overall.completed == 30 and output.datasets["a"].horizon > time_key(T0 + timedelta(seconds=1))
    storage.put_new(seal_key("a", "t"), encode_seal("t", {"commits": ["w000-t-000001", "w000-t-000003"]},
                                                    "host:1:taker", T0))
    progress, _ = observe_progress(storage, output, T0 + timedelta(hours=1, minutes=2), T0)
    assert progress.overall.completed == 30, "behind the horizon: no incremental listing sees it"
    progress, _ = observe_progress(storage, output, T0 + timedelta(hours=1, minutes=1) + FULL_LISTING_EVERY, T0)
    assert progress.overall.completed == 20, "the sealed-away marker counts for nobody"
