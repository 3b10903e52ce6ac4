"""The lifecycle model (lifecycle_model.py) with a fixed seed and a small budget: every interleaving it draws keeps
the invariants of docs/reliability.md. `hack/bench/bench_lifecycle_model.py` runs it long."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from .lifecycle_model import LifecycleModel


def test_random_lifecycles_keep_every_invariant(demo_model, lifecycle_sim) -> None:
    LifecycleModel.server_url = lifecycle_sim.url
    case = LifecycleModel.TestCase
    case.settings = settings(max_examples=3, stateful_step_count=10, deadline=None, derandomize=True,
                             suppress_health_check=list(HealthCheck), database=None)
    case().runTest()


def test_the_lease_s_races_as_model_steps_keep_every_invariant(demo_model, lifecycle_sim) -> None:
    # The lease's steps in a fixed order (the random draw above may not reach them): a writer paused between a
    # shard's data and its marker and taken over, two runs at once, a kill, a live intruder, a lease from the future.
    from .lifecycle_model import Counts

    LifecycleModel.server_url = lifecycle_sim.url
    model = LifecycleModel()
    paused_before = Counts.steps["paused_writer_taken_over"]
    steps = [model.start, model.paused_writer_taken_over, model.two_runs_at_once,
             lambda: model.edit("a", 2, None, False), lambda: model.run("kill-after:data:1"), model.two_runs_at_once,
             model.second_writer, model.lease_from_the_future, model.run_to_the_end]
    for step in steps:
        model.lease_steps.clear()
        step()
        model.no_slot_has_two_rows()
        model.no_marker_points_at_a_missing_file()
        model.a_passing_report_means_every_slot_is_settled()
    assert Counts.steps["paused_writer_taken_over"] == paused_before + 1, "the writer was paused and taken over"
