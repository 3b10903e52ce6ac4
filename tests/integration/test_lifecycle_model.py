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
