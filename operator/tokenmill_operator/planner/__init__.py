"""Server planning: model config + weight size + GPU memory → how to run SGLang. Pure functions.

`sizing` computes the numbers (`memory` holds the per-replica memory arithmetic, `model` the facts read from
config.json); `explain` renders the reasoning lines from them. The plan and its arithmetic are shown by
`tokenmill plan` and stored in the resource's status.
"""

from __future__ import annotations

import logging

from tokenmill_runner.spec import DatasetGenerationSpec

from .explain import reasoning, render_plan
from .memory import kv_bytes_per_token_per_rank, sglang_default_mem_fraction
from .model import ModelFacts, model_facts
from .plan import PlanError, ServerPlan
from .sizing import MIN_BATCH_REQUESTS, size_server

__all__ = ["MIN_BATCH_REQUESTS", "ModelFacts", "PlanError", "ServerPlan", "kv_bytes_per_token_per_rank",
           "model_facts", "plan_server", "render_plan", "sglang_default_mem_fraction"]

logger = logging.getLogger(__name__)


def plan_server(spec: DatasetGenerationSpec, model: ModelFacts, gpu_memory_mib: int | None = None) -> ServerPlan:
    """Choose how SGLang runs this spec's model, with the arithmetic. Anything set in the spec wins.

    gpu_memory_mib is the memory of one GPU; when None it comes from the spec (its memory field, else gpuProduct).
    """
    sizing = size_server(spec, model, gpu_memory_mib)
    plan = sizing.to_plan(reasoning(sizing))
    logger.debug("server plan: TP %d on %d node(s), %d KV tokens, %d concurrent requests",
                 plan.tensor_parallel, plan.nodes_per_replica, plan.kv_capacity_tokens,
                 plan.concurrent_requests_at_expected_length)
    return plan
