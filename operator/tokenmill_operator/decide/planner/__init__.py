"""Server planning: model config + weight size + GPU + SGLang release + the job → how to run SGLang. Pure functions.

`sizing` computes the numbers (`serving` the release and GPU checks, `memory` the per-replica memory arithmetic,
`model` the facts read from config.json) and picks the layout predicted to finish soonest (runner `throughput`
and `workload`); `explain` renders the reasoning and the candidate table. The plan and its arithmetic are shown
by `tokenmill plan` and stored in the resource's status.
"""

from __future__ import annotations

import logging

from tokenmill_runner.facts.throughput import CALIBRATION, Calibration, StepModel
from tokenmill_runner.facts.workload import Workload
from tokenmill_runner.spec.resource import DatasetGenerationSpec

from .explain import notes, reasoning, render_plan
from .memory import kv_bytes_per_token_per_rank, sglang_default_mem_fraction
from .model import ModelFacts, model_facts
from .plan import Candidate, MemoryTerm, PlanError, Prediction, ServerPlan
from .sizing import MIN_BATCH_REQUESTS, size_server, workload
from .startup import StartupPlan, predict_startup

__all__ = ["MIN_BATCH_REQUESTS", "Candidate", "MemoryTerm", "ModelFacts", "PlanError", "Prediction", "ServerPlan",
           "StartupPlan",
           "kv_bytes_per_token_per_rank", "model_facts", "plan_server", "plan_step_model", "render_plan", "sglang_default_mem_fraction",
           "workload"]

logger = logging.getLogger(__name__)


def plan_server(spec: DatasetGenerationSpec, model: ModelFacts, gpu_memory_mib: int | None = None,
                work: Workload | None = None, node_driver_major: int | None = None,
                calibration: Calibration = CALIBRATION) -> ServerPlan:
    """Choose how SGLang runs this spec's model, with the arithmetic. Anything set in the spec wins.

    gpu_memory_mib is the memory of one GPU; when None it comes from the spec (its memory field, else gpuProduct).
    work overrides the job's lengths and concurrency (tokenmill plan --prompt-tokens/--output-tokens/--concurrency).
    node_driver_major is the GPU nodes' NVIDIA driver branch (label nvidia.com/cuda.driver.major), when read.
    calibration is the step model's constants: the published fit, or the cluster's measured ones (verify.py).
    """
    sizing = size_server(spec, model, gpu_memory_mib, work, node_driver_major, calibration)
    plan = with_startup(sizing.to_plan(reasoning(sizing), notes(sizing)), spec)
    logger.debug("server plan: %d x TP %d (DP attention %d) on %d node(s), %d KV tokens, batch %d",
                 plan.replicas, plan.tensor_parallel, plan.attention_data_parallel, plan.nodes_per_replica,
                 plan.kv_capacity_tokens, sizing.chosen.batch)
    return plan


def plan_step_model(spec: DatasetGenerationSpec, model: ModelFacts, node_driver_major: int | None = None,
                    calibration: Calibration = CALIBRATION) -> StepModel | None:
    """The decode step model of the layout the plan chooses (what the verification window's samples refit)."""
    sizing = size_server(spec, model, None, None, node_driver_major, calibration)
    return sizing.step_model(sizing.chosen)


def with_startup(plan: ServerPlan, spec: DatasetGenerationSpec) -> ServerPlan:
    """The plan with its start-up (the weights' copy and load) described; every layout's ETA and GPU-hours already
    count it (sizing.Option.eta)."""
    return plan.model_copy(update={"startup": predict_startup(spec, plan.weight_bytes, plan.nodes_per_replica)})
