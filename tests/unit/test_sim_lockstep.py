"""The simulator's DP-attention replica: groups stepped in lockstep, all eager when one group's batch passes the
captured graph (0.5.23 model_executor/runner/decode_cuda_graph_runner.py:871-895), admission at
schedule_conservativeness x 0.3 (arg_groups/parallel_hook.py:318), dispatch round robin or by total tokens
(managers/data_parallel_controller.py:139-155)."""

from __future__ import annotations

import random

import pytest

from tokenmill_runner.facts.workload import DatasetLoad
from tokenmill_sim.capacity import Job, SchedulerParams
from tokenmill_sim.lockstep import LockstepReplica

LENGTHS = DatasetLoad("B", 1, True, 10240).output_lengths()  # the seeds' output shape, cut at 10,240


def jobs(count: int, seed: int = 1) -> list[Job]:
    rows = random.Random(seed)
    return [Job(prompt_tokens=512, output_tokens=rows.choice(LENGTHS), arrival=0.0, max_new_tokens=10240)
            for _ in range(count)]


def run(conservativeness: float, max_running: int, dispatch: str = "round_robin", eager: float = 1.3):
    replica = LockstepReplica(
        4, SchedulerParams(max_running_requests=max_running, max_total_tokens=173_219,
                           schedule_conservativeness=conservativeness),
        lambda batch, context: 0.1 + 0.0002 * batch, lambda tokens: 1e-4 * tokens, graph_bs=80,
        eager_factor=eager, dispatch=dispatch)
    return replica.run(jobs(4000), inflight=1200)


def test_a_group_past_its_graph_sends_the_replica_eager_and_capping_max_running_prevents_it():
    loose = run(0.3, 2048)
    assert loose.eager_share > 0.05  # the plan's graph of 80 per group, SGLang's default cap of 2,048
    assert all(o.eager == (o.max_group_batch > 80) for o in loose.observations)
    capped = run(0.3, 80)
    assert capped.eager_share == 0.0 and capped.completed == 4000
    assert capped.tokens_per_second > loose.tokens_per_second


def test_the_lockstep_step_is_the_replicas_and_eager_steps_cost_more():
    cheap, dear = run(0.3, 2048, eager=1.0), run(0.3, 2048, eager=2.0)
    assert dear.seconds > cheap.seconds
    result = run(0.3, 80)
    first = result.observations[-1]
    assert first.step_seconds == pytest.approx(0.1 + 0.0002 * first.running)


def test_sglangs_bolder_admission_under_dp_attention_retracts_more():
    assert run(0.3, 2048).retracted > 2 * run(1.0, 2048).retracted


def test_dispatch_by_total_tokens_and_round_robin_both_finish_everything_once():
    for dispatch in ("round_robin", "total_tokens"):
        result = run(0.3, 80, dispatch)
        assert result.completed == 4000
    with pytest.raises(ValueError, match="round_robin or total_tokens"):
        LockstepReplica(2, SchedulerParams(), lambda b, c: 0.1, lambda t: 0.0, graph_bs=8, dispatch="random")
