"""Accelerators the planner knows: memory, dense bf16 peak, memory bandwidth and links (datasheet values).

``link_gbps`` is one GPU's NVLink bandwidth in one direction (PCIe where there is no NVLink),
``network_gbps`` one GPU's share of the inter-node fabric (a 400 Gb/s NIC per GPU), ``pcie_gbps``
host transfers. ``memory_gib`` is what ``torch.cuda.mem_get_info`` reports as total.
"""

from __future__ import annotations

from attrs import frozen

from rlcore.config.structure import ConfigError


@frozen
class GPU:
    name: str
    memory_gib: float
    peak_tflops: float
    hbm_tbps: float
    link_gbps: float
    network_gbps: float
    pcie_gbps: float


GPUS = {
    "h200": GPU("h200", 140.4, 989.0, 4.8, 450.0, 50.0, 55.0),
    "h100": GPU("h100", 79.6, 989.0, 3.35, 450.0, 50.0, 55.0),
    "a100": GPU("a100", 79.3, 312.0, 2.04, 300.0, 25.0, 25.0),
    "b200": GPU("b200", 179.1, 2250.0, 8.0, 900.0, 50.0, 55.0),
    "l40s": GPU("l40s", 44.4, 362.0, 0.864, 28.0, 25.0, 28.0),
}


def gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ConfigError("--gpu", f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


@frozen
class Cluster:
    """``nodes`` x ``gpus_per_node`` of one kind."""

    gpu: GPU
    nodes: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def bandwidth_gbps(self, group: int, stride: int = 1) -> float:
        """Bandwidth of a collective over ``group`` ranks laid ``stride`` apart (ranks fill a node first)."""
        return self.gpu.link_gbps if group * stride <= self.gpus_per_node else self.gpu.network_gbps
