"""GPU products as data: memory (as SGLang reads it), memory bandwidth, tensor peaks and links. Pure: no I/O beyond
reading this package's own data file (data/gpus.json, every number with its source; docs/hardware.md renders it).

The planner sizes memory from `memory_mib` and predicts throughput from the rest; the simulator takes the same
products for its step time. A product is keyed by its node label value (`nvidia.com/gpu.product`, or
`amd.com/gpu.product-name` on AMD nodes), and found by that label or an alias in any case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

Vendor = Literal["nvidia", "amd"]
LinkKind = Literal["nvlink", "xgmi", "pcie", "network"]

GB = 1e9

# Memory bandwidth that separates the two memory kinds: every HBM product the facts list is above, every GDDR one
# below. The throughput model and its intervals treat the kinds apart (throughput.Calibration.gddr_step_speed).
HBM_BANDWIDTH = 2e12  # bytes/s

# Between the nodes of a replica when the scale-up domain ends at the node: one 400 Gb/s NIC per GPU (ConnectX-7
# class InfiniBand or RoCE), the common build of GPU nodes for multi-node serving. An assumption, not a measurement.
NETWORK_GBPS_PER_GPU = 50.0

# Node labels and device-plugin resources by vendor (NVIDIA GPU feature discovery; ROCm k8s-device-plugin and its
# labeller).
PRODUCT_LABEL_KEY: dict[Vendor, str] = {"nvidia": "nvidia.com/gpu.product", "amd": "amd.com/gpu.product-name"}
# Keyed by the vendor name as status and specs carry it (a plain string there).
GPU_RESOURCE: dict[str, str] = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}

# Time-slicing and MPS sharing append this to the NVIDIA product label; the card is the same.
_SHARED_SUFFIX = "-SHARED"


@dataclass(frozen=True)
class Link:
    """How the GPUs of one tensor-parallel group talk: the slowest link any collective of the group crosses."""

    kind: LinkKind
    bandwidth: float  # bytes/s per direction per GPU

    @property
    def is_pcie(self) -> bool:
        return self.kind == "pcie"


@dataclass(frozen=True)
class Gpu:
    """One GPU product: what SGLang sees of its memory and what bounds a decode step on it."""

    label: str
    vendor: Vendor
    arch: str
    memory_mib: int
    memory_bandwidth: float  # bytes/s
    dense_tflops: tuple[tuple[str, float], ...]  # (dtype, dense tensor TFLOPS), bf16 always present
    scale_up: Link
    scale_up_domain: int  # GPUs one scale-up link reaches (8 in an HGX/OAM node, 72 in an NVL72 rack)
    pcie_bandwidth: float  # bytes/s per direction
    rocm_family: str | None = None  # SGLang's ROCm image family (mi30x, mi35x) for AMD products
    sources: tuple[str, ...] = ()

    @property
    def memory_kind(self) -> Literal["hbm", "gddr"]:
        return "hbm" if self.memory_bandwidth >= HBM_BANDWIDTH else "gddr"

    @property
    def label_key(self) -> str:
        return PRODUCT_LABEL_KEY[self.vendor]

    @property
    def resource(self) -> str:
        return GPU_RESOURCE[self.vendor]

    def flops(self, dtype: str) -> float:
        """Dense tensor FLOP/s for GEMMs in dtype (fp4, fp8 or bf16); a dtype the GPU lacks runs at the next wider."""
        table = dict(self.dense_tflops)
        for candidate in {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16")}.get(dtype, ("bf16",)):
            if candidate in table:
                return table[candidate] * 1e12
        raise AssertionError(f"{self.label} has no bf16 peak")  # the data file always gives one

    def link(self, gpus: int) -> Link:
        """The link a collective over `gpus` of these GPUs crosses: the scale-up link inside its domain, else the
        network between nodes (NETWORK_GBPS_PER_GPU)."""
        if gpus <= self.scale_up_domain:
            return self.scale_up
        return Link("network", NETWORK_GBPS_PER_GPU * GB)


def _gpu(label: str, entry: dict[str, Any]) -> Gpu:
    scale_up = entry["scale_up"]
    return Gpu(
        label=label,
        vendor=entry["vendor"],
        arch=entry["arch"],
        memory_mib=int(entry["memory_mib"]),
        memory_bandwidth=float(entry["memory_bandwidth_gbps"]) * GB,
        dense_tflops=tuple((dtype, float(value)) for dtype, value in entry["dense_tflops"].items()),
        scale_up=Link(scale_up["link"], float(scale_up["gbps"]) * GB),
        scale_up_domain=int(scale_up["domain"]),
        pcie_bandwidth=float(entry["pcie_gbps"]) * GB,
        rocm_family=entry.get("rocm_family"),
        sources=tuple(entry["sources"]),
    )


@cache
def _data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(resources.files(__package__).joinpath("data/gpus.json").read_text())
    return data


@cache
def products() -> dict[str, Gpu]:
    """Every known product by its node label."""
    return {label: _gpu(label, entry) for label, entry in _data()["products"].items()}


def _normalise(name: str) -> str:
    key = "-".join(name.strip().replace("_", " ").split()).upper()
    return key.removesuffix(_SHARED_SUFFIX).removeprefix("NVIDIA-")


@cache
def _by_normalised() -> dict[str, str]:
    found: dict[str, str] = {}
    for label, entry in _data()["products"].items():
        for name in (label, *entry["aliases"]):
            found[_normalise(name)] = label
    return found


def find(product: str) -> Gpu | None:
    """The product a node label, an nvidia-smi/amd-smi name or an alias (any case) names, or None when unknown."""
    label = _by_normalised().get(_normalise(product))
    return products()[label] if label else None
