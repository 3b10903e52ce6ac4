"""Start-up in the plan: how long the weights take to reach a server pod (the copy) and to reach its GPUs (the load),
how that adds to the ETA and the GPU-hours, and the startup probe budget derived from it. Pure.

The rates are planning figures, one per way the weights travel (docs/cluster.md lists them and where they come
from); status.startup shows the observed times next to the prediction, so a cluster that is faster or slower is
seen after the first start.
"""

from __future__ import annotations

import math

from pydantic import Field

from tokenmill_runner.spec.resource import DatasetGenerationSpec, SpecModel

from .units import duration

# `aws s3 sync` runs 10 requests at once by default (AWS CLI "S3 configuration", max_concurrent_requests); EC2
# caps one flow at 5 Gbit/s outside a cluster placement group. 400 MB/s is what one such copier sustains in
# practice on a large instance, well under both ceilings: a planning figure, not a promise.
S3_COPY_BYTES_PER_S = 400e6
# SGLang downloads a Hugging Face id itself (huggingface_hub, one file at a time without hf_transfer).
HF_DOWNLOAD_BYTES_PER_S = 100e6
# Reading safetensors into GPU memory, per node (each node reads its ranks' shards): from a local disk (an emptyDir
# or the node-local cache on NVMe) or from a network volume (the shared cache, a pvc:// model).
LOCAL_READ_BYTES_PER_S = 2e9
NETWORK_READ_BYTES_PER_S = 1e9
# After the weights: CUDA-graph capture, then the warmup request that /health waits for (SGLang 0.5.23
# http_server.py:2491-2503 allows it 600 s); the port opens only once every rank has loaded (engine.py:1309).
WARMUP_S = 180
# The startup probe budgets load + warmup (the copy runs in init containers, before the probe clock starts) with
# this margin, and never less than the floor.
PROBE_MARGIN = 3
PROBE_FLOOR_S = 1800


class StartupPlan(SpecModel):
    """Predicted start-up of one server pod (camelCase in status and JSON)."""

    source: str = Field(description="How the weights reach the pod.")
    copy_seconds: int = Field(description="Predicted copy of the weights (0 when nothing is copied).")
    copy_bytes_per_second: int = Field(0, description="The copy's planning rate, bytes/s.")
    copy_holds_gpus: bool = Field(description="Whether the copy runs while the pod holds its GPUs.")
    load_seconds: int = Field(description="Predicted load into GPU memory, CUDA graphs and warmup included.")
    load_bytes_per_second: int = Field(description="The load's planning rate per node, bytes/s.")
    probe_seconds: int = Field(description="Startup probe budget derived from the load (spec.server."
                                           "startupTimeoutSeconds wins when set).")

    @property
    def seconds(self) -> int:
        return self.copy_seconds + self.load_seconds


def _copy(spec: DatasetGenerationSpec) -> tuple[str, float, bool, float]:
    """(source, copy rate or 0, copy holds GPUs, load rate)."""
    path, cache = spec.model.path, spec.model.cache
    if path.startswith("pvc://"):
        return "a pre-filled volume (pvc://): no copy", 0, False, NETWORK_READ_BYTES_PER_S
    if not path.startswith("s3://"):
        return "downloaded by SGLang in every pod", HF_DOWNLOAD_BYTES_PER_S, True, LOCAL_READ_BYTES_PER_S
    if cache is None:
        return "copied from S3 into every pod, on every start", S3_COPY_BYTES_PER_S, True, LOCAL_READ_BYTES_PER_S
    if cache.mode == "sharedVolume":
        return ("copied from S3 once into the shared volume, holding no GPU; none when already filled",
                S3_COPY_BYTES_PER_S, False, NETWORK_READ_BYTES_PER_S)
    return ("copied from S3 once per node onto its disk; none when the node has it", S3_COPY_BYTES_PER_S, True,
            LOCAL_READ_BYTES_PER_S)


def predict_startup(spec: DatasetGenerationSpec, weight_bytes: int, nodes_per_replica: int) -> StartupPlan:
    source, copy_rate, holds, load_rate = _copy(spec)
    copy_s = math.ceil(weight_bytes / copy_rate) if copy_rate else 0
    load_s = math.ceil(weight_bytes / max(1, nodes_per_replica) / load_rate) + WARMUP_S
    probe = max(PROBE_FLOOR_S, PROBE_MARGIN * load_s)
    return StartupPlan(source=source, copy_seconds=copy_s, copy_bytes_per_second=round(copy_rate),
                       copy_holds_gpus=holds, load_seconds=load_s, load_bytes_per_second=round(load_rate),
                       probe_seconds=probe)


def startup_gpu_seconds(startup: StartupPlan) -> int:
    """Start-up seconds during which the server pods hold their GPUs."""
    return startup.load_seconds + (startup.copy_seconds if startup.copy_holds_gpus else 0)


def restart_seconds(spec: DatasetGenerationSpec, startup: StartupPlan) -> int:
    """One more start of the same server (a new hidden-state pass): the load again, and the copy again only when it
    goes into the pod itself (an emptyDir does not outlive its pod; a node or shared cache does)."""
    copied_per_pod = spec.model.cache is None and not spec.model.path.startswith("pvc://")
    return startup.load_seconds + (startup.copy_seconds if copied_per_pod else 0)


def describe(startup: StartupPlan, generation_s: int, capture_s: int | None = None,
             relaunch_s: int | None = None) -> str:
    """copy + load + generation (+ the hidden-state capture pass and the restarts between its passes), each on its
    own, for the plan's table."""
    copy = (f"copy {duration(startup.copy_seconds)} at {startup.copy_bytes_per_second / 1e6:,.0f} MB/s"
            if startup.copy_seconds else "no copy")
    return (f"{copy} ({startup.source}) + load {duration(startup.load_seconds)} at "
            f"{startup.load_bytes_per_second / 1e9:,.1f} GB/s per node with warmup + generation {duration(generation_s)}"
            + (f" + hidden-state capture {duration(capture_s)}" if capture_s is not None else "")
            + (f" + the server's restart between its passes {duration(relaunch_s)}" if relaunch_s else ""))
