"""Known GPU products for the operator: the runner's hardware table (runner/tokenmill_runner/facts/data/gpus.json, with
sources) seen by node label. Pure.

The memory values are MiB as `nvidia-smi --query-gpu=memory.total` reports them (on ROCm, rocminfo's pool size,
what SGLang reads), because SGLang sizes its memory split from exactly that number. A product missing here is not
an error in the cluster, only in planning: set the memory in spec.server (gpuMemoryMib).
"""

from __future__ import annotations

from tokenmill_runner.facts.hardware import find, products
from tokenmill_runner.spec.resource import ServerSpec

# The spec field that gives the memory by hand, as users write it (its camelCase name comes from the spec model).
MEMORY_FIELD = "spec.server." + (ServerSpec.model_fields["gpu_memory_mib"].alias or "gpu_memory_mib")

GPU_MEMORY_MIB: dict[str, int] = {label: gpu.memory_mib for label, gpu in products().items()}


def canonical_product(product: str) -> str | None:
    """The node label for a product name or alias (any case), or None when unknown."""
    gpu = find(product)
    return gpu.label if gpu else None


def gpu_memory_mib(product: str | None, override: int | None = None) -> int:
    """Memory of one GPU in MiB: the spec's own number when set, else the known size of the product."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"{MEMORY_FIELD} must be positive; got {override}")
        return override
    if not product:
        raise ValueError(
            f"GPU memory unknown: set spec.server.gpuProduct (e.g. NVIDIA-H200) or {MEMORY_FIELD}"
        )
    label = canonical_product(product)
    if label is None:
        known = ", ".join(sorted(GPU_MEMORY_MIB))
        raise ValueError(
            f"unknown GPU product {product!r}: set {MEMORY_FIELD} to the memory of one GPU in MiB "
            f"(nvidia-smi --query-gpu=memory.total, or the node label nvidia.com/gpu.memory); known products: {known}"
        )
    return GPU_MEMORY_MIB[label]
