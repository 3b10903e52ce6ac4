"""What SGLang does to a server's settings and steps under DP attention, mirrored line by line so the plan predicts
the server that really runs. Pure.

Read in 0.5.23 and 0.5.9 (the oldest supported release); the rules are the same in both:
- The chunk is divided: `chunked_prefill_size //= attn_dp_size` (0.5.23 arg_groups/parallel_hook.py:331; 0.5.9
  server_args.py:2117). Each group prefills at most that many tokens per forward, so the plan passes its per-group
  chunk times the groups.
- Admission is bolder: `schedule_conservativeness *= 0.3` (0.5.23 arg_groups/parallel_hook.py:318; 0.5.9
  server_args.py:2115), so new_token_ratio starts at 0.7 x 0.3 and more requests are admitted, then retracted.
- The decode graphs run in lockstep: every group replays its CUDA graph only when the largest group's batch fits
  the captured batch and every group is decoding (0.5.23 model_executor/runner/decode_cuda_graph_runner.py:871-895,
  `_max_dp_batch_size`, `can_run_decode_cuda_graph`); otherwise every group runs eager. The plan caps
  --max-running-requests at the graph batch times the groups (SGLang gives each group max_running // groups,
  0.5.23 mem_cache/kv_cache_configurator.py:3131), so no group's batch outgrows its graph.
- Requests are dispatched round-robin by default (0.5.23 arg_groups/serving_hook.py:222-233), blind to their
  length, so one group can fill with long requests while another idles on short ones. `total_tokens` sends each to
  the group holding the fewest tokens, counting the new prompt (0.5.23 managers/data_parallel_controller.py:139-155,
  :918-925); it is a choice of --load-balance-method in every supported release (0.5.9 server_args.py:3716-3722).
"""

from __future__ import annotations

CONSERVATIVENESS_FACTOR = 0.3
LOAD_BALANCE_METHOD = "total_tokens"


def per_group_chunk(chunk_flag: int, groups: int) -> int:
    """The prefill chunk each group runs for a --chunked-prefill-size (parallel_hook.py:331)."""
    return chunk_flag // max(groups, 1)


def chunk_flag_for(per_group: int, groups: int) -> int:
    """The --chunked-prefill-size that leaves each group `per_group` tokens per forward after SGLang's division."""
    return per_group * max(groups, 1)


def schedule_conservativeness(given: float, groups: int) -> float:
    """The conservativeness the schedulers run with (parallel_hook.py:318)."""
    return given * CONSERVATIVENESS_FACTOR if groups > 1 else given


def max_running_per_group(max_running: int, groups: int, token_capacity_per_group: int) -> int:
    """Requests one group's scheduler admits at most for a given --max-running-requests (kv_cache_configurator.py
    :3129-3132): the flag divided over the groups, at most half the group's KV tokens."""
    return max(1, min(max(1, max_running // max(groups, 1)), token_capacity_per_group // 2))


def graph_capped_max_running(default: int, graph_bs: int, groups: int) -> int:
    """--max-running-requests that keeps every group inside its captured decode graph (lockstep: one group over the
    graph batch sends all of them eager)."""
    return min(default, graph_bs * groups)


def load_balance_method(groups: int) -> str | None:
    """--load-balance-method the plan passes: total_tokens under DP attention, nothing without it."""
    return LOAD_BALANCE_METHOD if groups > 1 else None
