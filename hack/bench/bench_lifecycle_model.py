#!/usr/bin/env python3
"""The lifecycle model of tests/integration/lifecycle_model.py, run long: random interleavings of spec edits, kills at
every kill point, operator restarts, outages, a second writer and replaced sources against the real runner,
ledger, manifest, report and operator decisions. Prints how many steps of each kind and how many distinct states
it explored, and fails loudly on the first broken invariant (with hypothesis' shrunk reproduction). Not a test.

    .venv/bin/python hack/bench/bench_lifecycle_model.py [--examples 20] [--steps 25] [--seed 0] [--composed]

--composed runs tests/integration/composed_model.py instead: a DatasetGeneration's Jobs of 1 to 4 workers, both
hidden-state passes, dead and flaky replicas, a marker in flight taken over (docs/reliability.md, "One definition of
done").
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from tempfile import TemporaryDirectory

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.integration.lifecycle_model import MODEL, Counts, LifecycleModel  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--composed", action="store_true", help="the DatasetGeneration model (composed_model.py)")
    args = parser.parse_args()

    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    started = time.monotonic()
    machine: type[LifecycleModel] = LifecycleModel
    with ExitStack() as stack:
        if args.composed:
            from tests.integration.composed_model import ComposedModel, small_model

            model = ComposedModel.model_path = small_model(Path(stack.enter_context(TemporaryDirectory())) / "m")

            def sim(**flags: object) -> str:
                config = SimConfig(model_path=str(model), time_scale=5000.0, max_running_requests=32,
                                   chunked_prefill_size=256, seed=args.seed, **flags)  # type: ignore[arg-type]
                return stack.enter_context(SimServer(config)).url

            ComposedModel.aux_url = LifecycleModel.server_url = sim(enable_return_aux_hidden_states=True)
            ComposedModel.final_url = sim(enable_return_hidden_states=True)
            ComposedModel.flaky_url = sim(enable_return_aux_hidden_states=True, fault_503_rate=0.2,
                                          fault_reset_rate=0.05)
            machine = ComposedModel
        else:
            LifecycleModel.server_url = stack.enter_context(SimServer(SimConfig(
                model_path=str(MODEL), time_scale=5000.0, max_running_requests=32, seed=args.seed))).url
        run_state_machine_as_test(machine, settings=settings(
            max_examples=args.examples, stateful_step_count=args.steps, deadline=None, database=None,
            suppress_health_check=list(HealthCheck), derandomize=args.seed == 0))
    elapsed = time.monotonic() - started
    print(f"lifecycle model: {args.examples} examples x up to {args.steps} steps in {elapsed:.0f} s; "
          f"{sum(Counts.steps.values())} steps, {len(Counts.states)} distinct (step, layout, sources) states")
    for step, count in sorted(Counts.steps.items()):
        print(f"  {step:<32} {count}")
    print("every invariant held")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
