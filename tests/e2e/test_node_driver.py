"""The GPU nodes' NVIDIA driver branch as the operator reads it from a real API server (gather.node_driver_major):
GPU feature discovery's nvidia.com/cuda.driver.major label on the nodes the server pods may land on, the oldest one
winning, since any of them may get a pod."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenmill_operator.decide.planner.serving import DRIVER_LABEL
from tokenmill_operator.kube import Kube
from tokenmill_operator.observe.gather import node_driver_major
from tokenmill_runner.spec.resource import ServerSpec

from .conftest import H200_NODES, Cluster

pytestmark = pytest.mark.e2e


@pytest.fixture
def labelled(cluster: Cluster) -> Iterator[None]:
    """The H200 nodes on drivers 570 and 580 (the H100 node unlabelled, as without GPU feature discovery)."""
    for node, branch in zip(H200_NODES, ("570", "580"), strict=True):
        cluster.kubectl("label", "node", node, f"{DRIVER_LABEL}={branch}", "--overwrite")
    try:
        yield
    finally:
        for node in H200_NODES:
            cluster.kubectl("label", "node", node, f"{DRIVER_LABEL}-", check=False)


def test_the_oldest_driver_of_the_servers_nodes_is_read(cluster: Cluster, labelled: None) -> None:
    kube = Kube(cluster.api_client)
    assert node_driver_major(kube, ServerSpec(gpuProduct="NVIDIA-H200")) == 570
    narrowed = ServerSpec(gpuProduct="H200", nodeSelector={"kubernetes.io/hostname": H200_NODES[1]})
    assert node_driver_major(kube, narrowed) == 580
    assert node_driver_major(kube, ServerSpec(gpuProduct="NVIDIA-H100-80GB-HBM3")) is None
