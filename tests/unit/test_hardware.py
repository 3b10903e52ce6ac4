"""The GPU table: memory as SGLang reads it (nvidia-smi / rocminfo MiB), names as nodes and tools spell them, the
links tensor parallelism crosses. Sources for every number are in runner/tokenmill_runner/facts/data/gpus.json."""

from __future__ import annotations

import pytest

from tokenmill_runner.facts.hardware import find, products


@pytest.mark.parametrize(("name", "label", "memory_mib"), [
    # nvidia-smi memory.total as published captures show it.
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", 97887),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA-RTX-PRO-6000-Blackwell-Workstation-Edition",
     97887),
    ("NVIDIA B300 SXM6 AC", "NVIDIA-B300-SXM6-AC", 275040),
    ("NVIDIA GB200", "NVIDIA-GB200", 189471),
    ("NVIDIA GB300", "NVIDIA-GB300", 284208),
    ("NVIDIA H200", "NVIDIA-H200", 143771),
    # rocminfo "Pool 1" KB / 1024, what SGLang's get_amdgpu_memory_capacity reads (0.5.23 utils/common.py:682):
    # MI300X 201310208 KB; amd-smi VRAM totals for MI325X and MI355X.
    ("AMD Instinct MI300X", "AMD_Instinct_MI300X_OAM", 196592),
    ("MI325X", "AMD_Instinct_MI325_OAM", 262128),
    ("AMD_Instinct_MI355X", "AMD_Instinct_MI355X_OAM", 294896),
])
def test_products_by_the_names_tools_print(name, label, memory_mib):
    gpu = find(name)
    assert gpu is not None and gpu.label == label and gpu.memory_mib == memory_mib


def test_node_label_values_and_short_names_find_the_same_product():
    assert find("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition") is find("rtx-pro-6000")
    assert find("NVIDIA-H100-80GB-HBM3-SHARED") is find("H100")  # time-slicing appends -SHARED
    assert find("NVIDIA-X9000") is None


def test_vendors_name_their_own_resource_and_label():
    amd, nvidia = find("MI300X"), find("H200")
    assert amd is not None and nvidia is not None
    assert (amd.vendor, amd.resource, amd.label_key, amd.rocm_family) == (
        "amd", "amd.com/gpu", "amd.com/gpu.product-name", "mi30x")
    assert find("MI355X").rocm_family == "mi35x"  # type: ignore[union-attr]
    assert (nvidia.resource, nvidia.label_key) == ("nvidia.com/gpu", "nvidia.com/gpu.product")


def test_links_pcie_nvlink_and_the_nvl72_rack():
    rtx, h200, gb200 = find("RTX-PRO-6000"), find("H200"), find("GB200")
    assert rtx and h200 and gb200
    assert rtx.link(8).kind == "pcie" and rtx.link(8).is_pcie  # no NVLink on RTX PRO 6000
    assert h200.link(8).kind == "nvlink" and h200.link(16).kind == "network"  # 8-GPU HGX domain
    assert gb200.link(16).kind == "nvlink" and gb200.scale_up_domain == 72  # NVL72: trays of 4, one domain
    assert h200.link(8).bandwidth > 5 * rtx.link(8).bandwidth


def test_every_product_has_sources_and_a_bf16_peak():
    for gpu in products().values():
        assert gpu.sources, gpu.label
        assert gpu.memory_bandwidth > 1e11 and gpu.flops("bf16") > 1e13
        assert gpu.flops("fp4") >= gpu.flops("fp8") >= gpu.flops("bf16")  # a missing dtype runs at the next wider
