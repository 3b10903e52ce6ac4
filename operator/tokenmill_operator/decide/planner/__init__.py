"""Server planning: model config + weight size + GPU + SGLang release + the job → how to run SGLang. Pure functions.

`sizing` computes the numbers (`serving` the release and GPU checks, `memory` the per-replica memory arithmetic,
`model` the facts read from config.json) and picks the layout predicted to finish soonest (runner `throughput`
and `workload`); `explain` renders the reasoning and the candidate table. The plan and its arithmetic are shown
by `tokenmill plan` and stored in the resource's status.
"""

from __future__ import annotations

import logging
import math

from tokenmill_runner.facts.hidden_states import kinds_needed
from tokenmill_runner.facts.throughput import CALIBRATION, Calibration, StepModel
from tokenmill_runner.facts.workload import Workload
from tokenmill_runner.spec.resource import DatasetGenerationSpec

from .explain import notes, reasoning, render_plan
from .memory import kv_bytes_per_token_per_rank, sglang_default_mem_fraction
from .model import ModelFacts, model_facts
from .plan import Candidate, MemoryTerm, PlanError, Prediction, ServerPlan
from .sizing import MIN_BATCH_REQUESTS, size_server, workload
from .startup import StartupPlan, predict_startup, restart_seconds, startup_gpu_seconds

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


def _started(prediction: Prediction | None, startup: StartupPlan, gpus: int, restarts: int = 0,
             restart_s: int = 0) -> Prediction | None:
    """The prediction with the start-up added, and the server's `restarts` between hidden-state passes: to the ETA,
    and to the GPU-hours while the pods hold their GPUs (a restart holds them: the StatefulSet keeps its pods)."""
    if prediction is None or prediction.generation_seconds is not None:
        return prediction
    busy = prediction.eta_seconds  # generation and the capture pass after it
    relaunch = restarts * restart_s
    started = startup.seconds + relaunch
    held = busy + startup_gpu_seconds(startup) + relaunch
    interval = prediction.interval
    if interval is not None:
        interval = interval.model_copy(update={"eta_seconds_low": interval.eta_seconds_low + started,
                                               "eta_seconds_high": interval.eta_seconds_high + started})
    return prediction.model_copy(update={"generation_seconds": busy - (prediction.capture_seconds or 0),
                                         "relaunch_seconds": relaunch or None,
                                         "eta_seconds": busy + started,
                                         "gpu_hours": round(held * gpus / 3600, 1), "interval": interval})


def with_startup(plan: ServerPlan, spec: DatasetGenerationSpec) -> ServerPlan:
    """The plan with the weights' copy and load predicted and counted in every layout's ETA and GPU-hours (the
    layout choice stays on generation: every layout copies the same bytes)."""
    # One server start per hidden-state pass after the first (the operator's states_passes.py).
    restarts = len(kinds_needed(list(spec.hidden_states.layouts))) - 1 if spec.hidden_states else 0

    def started(prediction: Prediction | None, startup: StartupPlan, gpus: int) -> Prediction | None:
        return _started(prediction, startup, gpus, restarts, restart_seconds(spec, startup))

    startup = predict_startup(spec, plan.weight_bytes, plan.nodes_per_replica)
    candidates = [c.model_copy(update={"prediction": started(c.prediction, predict_startup(
        spec, plan.weight_bytes, math.ceil(c.tensor_parallel / plan.gpus_per_node)), c.gpus)})
        for c in plan.candidates]
    gpus = plan.replicas * plan.tensor_parallel
    return plan.model_copy(update={"startup": startup, "prediction": started(plan.prediction, startup, gpus),
                                   "candidates": candidates})
