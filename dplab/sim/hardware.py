"""The hardware a :class:`~dplab.sim.Fabric` is built from: GPUs, the paths between them inside a
node, and the machines people rent, each with its source.

Inside a node an all-reduce's ring visits every GPU, so its speed is that of its slowest hop
(NCCL's search gives a channel a speed only if every link on its path can carry it:
``followPath`` in NVIDIA/nccl ``src/graph/search.cc``, line 113 at commit 5067397). Three kinds
of node are common:

- ``nvswitch``: every GPU on NVSwitches (HGX/DGX boards; SXM GPUs): all hops NVLink.
- ``nvlink-pairs``: PCIe cards joined two by two by an NVLink bridge (A100 PCIe, H100 NVL). Two
  GPUs talk over the bridge; with four or more, the ring must also cross PCIe between pairs, and
  that hop (through a PCIe switch, or across the CPU sockets) sets its speed. NCCL then counts
  the ring as a PCI path: PCI latencies, and no LL128 (``tuning.cc`` enables LL128 only for
  ``typeIntra <= PATH_NVB``, line 531).
- ``pcie``: PCIe cards with no NVLink: every hop is PCIe.
- ``nvlink`` (V100's hybrid cube-mesh): direct NVLinks, no switch.

PCIe bandwidth is NCCL's: ``width × speed / 80`` GB/s with speed 60, 120, 240, 480 (× 100 Mb/s
per lane) for Gen3, 4, 5, 6 (``topo.cc`` ``kvDictPciGen``, lines 545–556, and line 657): a x16
link is 12, 24, 48 or 96 GB/s. Between CPU sockets NCCL counts the CPUs' link (``topo.h``
lines 26–34): AMD 16, Intel Skylake 10, Sapphire Rapids 22, Emerald Rapids 40 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# NVLink per link, GB/s, as NCCL counts it (src/graph/topo.h, SM70/80/90/100_NVLINK_BW)
NVLINK_BW_PER_LINK = {"volta": 20.0, "ampere": 20.0, "hopper": 20.6, "blackwell": 40.1}
PCIE_GEN_SPEED = {3: 60, 4: 120, 5: 240, 6: 480}  # topo.cc kvDictPciGen, ×100 Mb/s per lane
SOCKET_GBPS = {"intel": 10.0, "intel-spr": 22.0, "intel-emr": 40.0, "amd": 16.0}  # topo.h
INTRA_NODE = ("nvswitch", "nvlink-pairs", "pcie", "nvlink")
ACROSS = ("switch", "sockets")


def pcie_GBps(gen: int, width: int = 16) -> float:
    """GB/s NCCL counts for a PCIe link (``topo.cc``: ``width * speed / 80``)."""
    if gen not in PCIE_GEN_SPEED:
        raise ValueError(f"pcie_gen must be one of {sorted(PCIE_GEN_SPEED)}, got {gen!r}")
    return width * PCIE_GEN_SPEED[gen] / 80.0


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model's defaults, each from its vendor's datasheet.

    ``nvlinks``: NVLink links per GPU (on NVSwitch boards), or, for a PCIe card, the links of
    its NVLink bridge (0: none); ``intra``: the node it usually ships in; ``pcie_gen``: its host
    link; ``gpus_per_node`` and ``nic_gbps``: the usual board and its NIC.
    """

    gen: str
    nvlinks: int
    intra: str
    gpus_per_node: int
    nic_gbps: float
    pcie_gen: int = 4


GPUS: dict[str, GpuSpec] = {
    "v100": GpuSpec("volta", 6, "nvlink", 8, 100, 3),  # DGX-1V: hybrid cube-mesh
    "a100": GpuSpec("ampere", 12, "nvswitch", 8, 200, 4),
    # A100 PCIe: 600 GB/s NVLink bridge for 2 GPUs = 12 NVLink 3 links (datasheet); 4-card boxes
    "a100-pcie": GpuSpec("ampere", 12, "pcie", 4, 200, 4),
    "h100": GpuSpec("hopper", 18, "nvswitch", 8, 400, 5),
    # H100 NVL / PCIe: 600 GB/s NVLink bridge (datasheet), PCIe Gen5
    "h100-pcie": GpuSpec("hopper", 12, "pcie", 4, 400, 5),
    "h200": GpuSpec("hopper", 18, "nvswitch", 8, 400, 5),
    "h20": GpuSpec("hopper", 18, "nvswitch", 8, 400, 5),
    "b200": GpuSpec("blackwell", 18, "nvswitch", 8, 400, 5),
    "gb200": GpuSpec("blackwell", 18, "nvswitch", 72, 400, 5),
}


@dataclass(frozen=True)
class IntraNode:
    """How an all-reduce's ring crosses a node: the bandwidth of its slowest hop per GPU, the
    NCCL hardware class of its latency (``nvlink`` or ``pci``), whether NVSwitch is there
    (NVLS), and each path's own speed, for :meth:`dplab.sim.Fabric.describe`."""

    kind: str
    ring_GBps: float
    hw: str
    nvswitch: bool
    paths: tuple[tuple[str, float], ...]


def intra_node(
    spec: GpuSpec,
    kind: str,
    ppn: int,
    *,
    pcie_gen: int | None = None,
    pcie_across: str = "switch",
    cpu: str = "intel",
    bridge_GBps: float | None = None,
    pcie_GBps_override: float | None = None,
) -> IntraNode:
    """The ring's path through a node of ``ppn`` GPUs of this kind (see the module docstring)."""
    nvl = NVLINK_BW_PER_LINK[spec.gen]
    pcie = pcie_GBps_override or pcie_GBps(pcie_gen or spec.pcie_gen)
    cross = pcie if pcie_across == "switch" else min(pcie, SOCKET_GBPS[cpu])
    cross_name = "PCIe through a switch" if pcie_across == "switch" else "PCIe across sockets"
    if kind in ("nvswitch", "nvlink"):
        bw = spec.nvlinks * nvl
        return IntraNode(kind, bw, "nvlink", kind == "nvswitch", (("NVLink", bw),))
    if kind == "pcie":
        return IntraNode(kind, cross, "pci", False, ((cross_name, cross),))
    bridge = bridge_GBps or spec.nvlinks * nvl
    if bridge <= 0:
        raise ValueError(f"intra_node='nvlink-pairs' needs an NVLink bridge; {spec} has none")
    if ppn <= 2:  # one pair: the bridge is the whole ring
        return IntraNode(kind, bridge, "nvlink", False, (("NVLink bridge", bridge),))
    return IntraNode(
        kind, min(bridge, cross), "pci", False, (("NVLink bridge", bridge), (cross_name, cross))
    )


# name → (from_hardware arguments, source)
PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "dgx-a100": (
        {"gpu": "a100", "nics_per_node": 8, "nic_gbps": 200, "network": "ib"},
        "NVIDIA DGX A100: 8 × A100 SXM4 on NVSwitch, 8 × 200 Gb/s HDR InfiniBand (datasheet)",
    ),
    "dgx-h100": (
        {"gpu": "h100", "nics_per_node": 8, "nic_gbps": 400, "network": "ib"},
        "NVIDIA DGX H100: 8 × H100 SXM5 on NVSwitch, 8 × 400 Gb/s NDR (ConnectX-7) (datasheet)",
    ),
    "dgx-b200": (
        {"gpu": "b200", "nics_per_node": 8, "nic_gbps": 400, "network": "ib"},
        "NVIDIA DGX B200: 8 × B200 on NVLink 5 switches, 8 × 400 Gb/s ConnectX-7 (datasheet)",
    ),
    "aws-p4d": (
        {"gpu": "a100", "nics_per_node": 4, "nic_gbps": 100, "network": "efa"},
        "AWS p4d.24xlarge: 8 × A100 40GB on NVSwitch, 400 Gb/s EFA as 4 × 100 Gb/s (AWS spec)",
    ),
    "aws-p5": (
        {"gpu": "h100", "nics_per_node": 32, "nic_gbps": 100, "network": "efa"},
        "AWS p5.48xlarge: 8 × H100 on NVSwitch, 3,200 Gb/s EFA as 32 × 100 Gb/s (AWS spec)",
    ),
    "aws-p5en": (
        {"gpu": "h200", "nics_per_node": 16, "nic_gbps": 200, "network": "efa"},
        "AWS p5en.48xlarge: 8 × H200, 3,200 Gb/s EFAv3 as 16 × 200 Gb/s (AWS spec)",
    ),
    "gcp-a3": (
        {"gpu": "h100", "nics_per_node": 8, "nic_gbps": 200, "network": "tcp"},
        "Google Cloud A3 Mega (a3-megagpu-8g): 8 × H100, 8 × 200 Gb/s GPUDirect-TCPXO NICs "
        "(GCP docs); TCPXO's latency is not calibrated (network 'tcp' is an assumption)",
    ),
    "azure-nd-h100-v5": (
        {"gpu": "h100", "nics_per_node": 8, "nic_gbps": 400, "network": "ib"},
        "Azure ND H100 v5: 8 × H100 on NVSwitch, 8 × 400 Gb/s NDR InfiniBand (Azure docs)",
    ),
    # the boxes the 2026-12-04 sweeps cover (assets/data/nccl-tests-published.json)
    "azure-nc48-a100-v4": (
        {"gpu": "a100-pcie", "gpus_per_node": 2, "intra_node": "nvlink-pairs"},
        "Azure Standard_NC48ads_A100_v4: 2 × A100 80GB PCIe joined by an NVLink bridge (NV12, "
        "as nvidia-smi shows for its NC96 sibling; JingchaoZhang's NCv4 post, the published run "
        "azure-nc48v4-a100pcie-2gpu-nvlink)",
    ),
    "azure-nc96-a100-v4": (
        {"gpu": "a100-pcie", "gpus_per_node": 4, "intra_node": "nvlink-pairs"},
        "Azure Standard_NC96ads_A100_v4: 4 × A100 80GB PCIe, NVLink-bridged in pairs (NV12), "
        "the pairs joined over PCIe Gen4 (same post as azure-nc48-a100-v4)",
    ),
    "oci-bm-gpu4.8": (
        {"gpu": "a100", "nics_per_node": 16, "nic_gbps": 100, "network": "roce"},
        "OCI BM.GPU4.8: 8 × A100-SXM4-40GB on NVSwitch, RDMA 1.6 Tb/s as 16 × 100 Gb/s RoCE v2 "
        "(oracle-japan/ocitutorials 'GPUクラスタを構築する'; runs oci-bm-gpu4.8-*)",
    ),
    "gke-h200-1gpu": (
        {"gpu": "h200", "gpus_per_node": 1, "nics_per_node": 1, "network": "roce"},
        "GKE H200 pods with one GPU and one GPUDirect-RDMA NIC each (ngcxy/dranet docs, run "
        "gke-h200-2node-1gpu-rdma); the NIC's speed is not in the source: give nic_gbps, or "
        "calibrate from your own log (Fabric.from_nccl_tests_log)",
    ),
    "nebius-h100": (
        {"gpu": "h100", "network": "ib"},
        "Nebius H100 cluster: 8 × H100 (HGX) on NVSwitch, InfiniBand (dstack's Nebius example, "
        "run nebius-h100-2node-ib); NIC count and speed are not in the source: the defaults "
        "are DGX H100's (8 × 400 Gb/s), or calibrate from your own log",
    ),
}
