"""Known GPU products: the memory of one GPU, keyed by the `nvidia.com/gpu.product` node label. Pure data.

The values are MiB as `nvidia-smi --query-gpu=memory.total` reports them (and as GPU feature discovery writes
`nvidia.com/gpu.memory`), because SGLang sizes its memory split from exactly that number. A product missing here
is not an error in the cluster, only in planning: set the memory in spec.server (gpuMemoryMib).
"""

from __future__ import annotations

from tokenmill_runner.spec import ServerSpec

# The spec field that gives the memory by hand, as users write it (its camelCase name comes from the spec model).
MEMORY_FIELD = "spec.server." + (ServerSpec.model_fields["gpu_memory_mib"].alias or "gpu_memory_mib")

GPU_MEMORY_MIB: dict[str, int] = {
    # Hopper
    "NVIDIA-H200": 143771,
    "NVIDIA-H200-NVL": 143771,
    "NVIDIA-H100-80GB-HBM3": 81559,
    "NVIDIA-H100-PCIe": 81559,
    "NVIDIA-H100-NVL": 95830,
    "NVIDIA-H800": 81559,
    "NVIDIA-H20": 97871,
    # Blackwell
    "NVIDIA-B200": 183359,
    # Ampere
    "NVIDIA-A100-SXM4-80GB": 81920,
    "NVIDIA-A100-SXM4-40GB": 40960,
    "NVIDIA-A100-80GB-PCIe": 81920,
    "NVIDIA-A100-PCIE-40GB": 40960,
    "NVIDIA-A10G": 23028,
    "NVIDIA-A10": 23028,
    # Ada
    "NVIDIA-L40S": 46068,
    "NVIDIA-L40": 46068,
    "NVIDIA-L4": 23034,
}

# Short names people write in specs. Ambiguous ones (plain "A100": 40 or 80 GB?) are deliberately absent.
_ALIASES: dict[str, str] = {
    "H200": "NVIDIA-H200",
    "H100": "NVIDIA-H100-80GB-HBM3",
    "H100-80GB": "NVIDIA-H100-80GB-HBM3",
    "H100-SXM": "NVIDIA-H100-80GB-HBM3",
    "H100-SXM5-80GB": "NVIDIA-H100-80GB-HBM3",
    "H100-NVL": "NVIDIA-H100-NVL",
    "B200": "NVIDIA-B200",
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "A100-40GB": "NVIDIA-A100-SXM4-40GB",
    "L40S": "NVIDIA-L40S",
    "H20": "NVIDIA-H20",
}

# Time-slicing and MPS sharing append this to the product label; the memory of the card is unchanged.
_SHARED_SUFFIX = "-SHARED"


def _normalise(product: str) -> str:
    name = "-".join(product.strip().replace("_", " ").split()).upper()
    if name.endswith(_SHARED_SUFFIX):
        name = name[: -len(_SHARED_SUFFIX)]
    return name.removeprefix("NVIDIA-")


_BY_NORMALISED: dict[str, str] = {
    **{_normalise(label): label for label in GPU_MEMORY_MIB},
    **{_normalise(alias): label for alias, label in _ALIASES.items()},
}


def canonical_product(product: str) -> str | None:
    """The `nvidia.com/gpu.product` label for a product name or alias (any case), or None when unknown."""
    return _BY_NORMALISED.get(_normalise(product))


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
