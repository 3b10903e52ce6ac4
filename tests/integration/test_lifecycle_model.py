"""The lifecycle model (lifecycle_model.py) with a fixed seed and a small budget: every interleaving it draws keeps
the invariants of docs/reliability.md. `hack/bench/bench_lifecycle_model.py` runs it long."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings

from tokenmill_runner.store.manifest import read_manifest

from .lifecycle_model import LifecycleModel


def test_random_lifecycles_keep_every_invariant(demo_model, lifecycle_sim) -> None:
    LifecycleModel.server_url = lifecycle_sim.url
    case = LifecycleModel.TestCase
    case.settings = settings(max_examples=3, stateful_step_count=10, deadline=None, derandomize=True,
                             suppress_health_check=list(HealthCheck), database=None)
    case().runTest()


def test_the_lease_s_races_and_edited_sources_as_model_steps_keep_every_invariant(demo_model, lifecycle_sim) -> None:
    # The steps in a fixed order (the random draw above may not reach them): a writer paused between a shard's data
    # and its marker and taken over, a live writer cut off from the store and taken over, two runs at once, a kill, a
    # same-size edit past the first 64 KiB and blank lines (refused over commits; settled over the line set on a
    # dataset of its own), live intruders with skewed clocks, a lease from the future.
    from .lifecycle_model import Counts

    LifecycleModel.server_url = lifecycle_sim.url
    model = LifecycleModel()
    before = Counter(Counts.steps)
    steps = [model.start, model.paused_writer_taken_over, lambda: model.edit("a", 2, None, False),
             model.cut_off_writer_taken_over, model.two_runs_at_once,
             lambda: model.edit("a", 3, None, False), lambda: model.run("kill-after:data:1"),
             lambda: model.replace_or_restore_source("a", 3), model.run_to_the_end,
             lambda: model.replace_or_restore_source("a", 0), lambda: model.replace_or_restore_source("b", 2),
             lambda: model.edit("b", 1, None, True), model.run_to_the_end,
             lambda: model.second_writer(90), lambda: model.second_writer(-90), model.lease_from_the_future,
             model.run_to_the_end]
    for step in steps:
        model.lease_steps.clear()
        step()
        model.no_slot_has_two_rows()
        model.no_marker_points_at_a_missing_file()
        model.a_passing_report_means_every_slot_is_settled()
    reached = Counts.steps - before
    for step in ("paused_writer_taken_over", "cut_off_writer_taken_over", "same_size_edit", "blank_lines",
                 "second_writer:+90s", "second_writer:-90s"):
        assert reached[step] == 1, (step, reached)
    manifest = read_manifest(model.storage)
    # b's blank line 4 is no slot; the one after its last row is past the layout's lines (13: 12 rows).
    layout = manifest.datasets["b"] if manifest is not None else None
    assert layout is not None and (layout.rows, layout.lines, layout.skipped_lines) == (12, 13, 1), layout
    model._assert_settled("the last run to the end")
