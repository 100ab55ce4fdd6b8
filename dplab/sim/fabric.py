"""``Fabric``: a GPU cluster as an all-reduce sees it, timed by NCCL's own cost model.

A flat ring at one NIC's line rate is an order of magnitude off on real clusters: 7 of a node's
8 ring hops run over NVLink, each GPU drives its own NIC, and past a few nodes NCCL switches to
trees (latency 2·log2(nodes) network hops, not 2(N−1)) or, on Hopper and later, to NVLink
SHARP (NVLS), where the switch does the reduction. A :class:`Fabric` holds what decides which
wins: GPUs per node, nodes, the intra-node link (NVLink generation and NVSwitch, or PCIe), NICs
per node and their speed, and the network kind. :mod:`dplab.sim.nccl_model` does the timing.

    fab = Fabric.preset("aws-p5", nodes=16)
    fab.allreduce_s(64 * 2**20)          # seconds, NCCL's predicted-fastest algorithm
    fab.busbw_GBps(2**34, "ring")        # nccl-tests' busbw = algbw · 2(N−1)/N
    fab.choice(2**15)                    # ('tree', 'LL') at 128 ranks: latency wins
    fab.calibrated_from(open("all_reduce_perf.log").read())  # your cluster's own constants

How far to trust it, by message size: :func:`dplab.sim.validation_bands`.

``allreduce_s(nbytes, world_size)`` has a :class:`~dplab.sim.link.Link`'s signature, so a
Fabric goes wherever the simulator takes a link; the world size is the fabric's own.

Hardware defaults (:data:`GPUS`), each from its vendor's spec: NVLink links per GPU
(V100 SXM2 6 × NVLink 2 = 300 GB/s bidirectional; A100 SXM 12 × NVLink 3 = 600 GB/s; H100,
H200 and H20 18 × NVLink 4 = 900 GB/s; B200 and GB200 18 × NVLink 5 = 1.8 TB/s; NVIDIA
datasheets), times NCCL's per-link speed (``src/graph/topo.h``: 20, 20, 20.6, 40.1 GB/s);
8 GPUs per node (HGX/DGX boards; GB200: the 72-GPU NVL72 NVLink domain counts as one node);
one NIC per GPU (DGX's rail-optimised design); NIC speed of the DGX of that generation
(DGX-1: 100 Gb/s EDR, DGX A100: 200 Gb/s HDR, DGX H100/B200: 400 Gb/s NDR ConnectX-7).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from typing import Any

from dplab._checks import check_choice, check_nonneg, check_positive, check_positive_int
from dplab.sim.contention import Contention
from dplab.sim.fit import fit_constants, measured_points
from dplab.sim.hardware import ACROSS, GPUS, INTRA_NODE, PRESETS, GpuSpec
from dplab.sim.hardware import intra_node as intra_node_path
from dplab.sim.levels import Levels, LevelsModel
from dplab.sim.nccl_model import (
    ALGORITHMS,
    DEFAULT_CALIBRATION,
    NET_BW_PER_100GBIT,
    PROTOCOLS,
    Calibration,
    NcclModel,
    Topology,
)
from dplab.sim.nccl_tests import parse_nccl_tests
from dplab.sim.profile import BackwardProfile

GB = 1e9
# Optional realism, off unless asked for: NCCL's kernels take SMs and memory bandwidth, so
# backward runs slower while an all-reduce is in flight. Measured on A100, H100, MI250 and
# MI210 with GPT and LLaMA layers: 18.9 % slower on average, 40.0 % at worst (
# "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning",
# arXiv:2507.03114, abstract).
NCCL_OVERLAP_SLOWDOWN = 0.189
NETWORKS = ("ib", "roce", "efa", "tcp")
INTRA = INTRA_NODE  # the kinds of node (dplab.sim.hardware); "nvlink" is V100's cube-mesh
__all__ = [
    "GPUS", "INTRA", "NCCL_OVERLAP_SLOWDOWN", "NETWORKS", "PRESETS", "Fabric", "GpuSpec",
    "busbw_from_time", "overlap_contention", "with_straggler",
]  # fmt: skip


def overlap_contention(slowdown: float = NCCL_OVERLAP_SLOWDOWN) -> Contention:
    """A :class:`~dplab.sim.contention.Contention` for a GPU: backward at ``1/(1+slowdown)``
    of its speed while NCCL runs (default: the published average, :data:`NCCL_OVERLAP_SLOWDOWN`),
    the all-reduce unchanged. Pass it as ``simulate(..., fabric=f, contention=...)``."""
    return Contention(
        compute_slowdown=check_nonneg("slowdown", slowdown),
        probe={"source": "arXiv:2507.03114 (average compute slowdown under overlap)"}
        if slowdown == NCCL_OVERLAP_SLOWDOWN
        else {},
    )


def with_straggler(profile: BackwardProfile, slower_by: float) -> BackwardProfile:
    """The profile of a step in which one rank's backward is ``slower_by`` slower (0.1: 10 %).

    Every bucket's all-reduce waits for the last rank to fill that bucket, so it launches at
    the straggler's ready time, and the other ranks wait inside the collective: the
    straggler's own timeline is the step's. Its gradients arrive ``1 + slower_by`` times later
    and its backward lasts that much longer; forward and optimizer are left as measured.
    Simulate the result to see how much of the delay the overlap absorbs.
    """
    k = 1.0 + check_nonneg("slower_by", slower_by)
    if k == 1.0:
        return profile
    return replace(
        profile,
        params=tuple(replace(p, ready_ms=p.ready_ms * k) for p in profile.params),
        backward_ms=profile.backward_ms * k,
        meta={**profile.meta, "straggler_slower_by": k - 1.0},
    )


def busbw_from_time(nbytes: float, seconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce, GB/s: algbw · 2(N−1)/N with algbw =
    bytes / time (``src/all_reduce.cu``, ``AllReduceGetBw``): the rate each rank's link would
    need for a ring to take that long, comparable across N."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    return nbytes / seconds / GB * 2 * (ranks - 1) / ranks


def _name(name: str, value: Any, options: Sequence[str]) -> str:
    """``check_choice`` for names typed by people: ``"H100"`` is ``"h100"``."""
    return check_choice(name, value.lower() if isinstance(value, str) else value, options)


@dataclass(frozen=True)
class Fabric:
    """A cluster for the all-reduce: see the module docstring; build with :meth:`from_hardware`,
    :meth:`preset`, :meth:`fit` or :meth:`from_levels`, calibrate with :meth:`calibrated_from`.

    ``intra_GBps``: one GPU's one-way intra-node bandwidth as NCCL counts it (NVLinks × per-link
    speed, or PCIe); ``nic_gbps``: one NIC's line rate in Gb/s. A fabric has one cost model
    (:attr:`cost_model`): NCCL's, from its hardware, or, when ``levels`` is given, two measured
    α-β levels (:attr:`measured`); the hardware fields then only name it.
    """

    name: str
    gpus_per_node: int
    nodes: int
    gpu: str = "measured"
    nics_per_node: int = 1
    nic_gbps: float = 0.0
    network: str = "measured"
    intra: str = "measured"
    intra_GBps: float = 0.0
    intra_paths: tuple[tuple[str, float], ...] = ()
    cpu: str = "intel"
    gpus_per_process: int = 1
    calibration: Calibration = DEFAULT_CALIBRATION
    levels: Levels | None = None
    source: str = ""
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a fabric needs a name, got {self.name!r}")
        check_positive_int("gpus_per_node", self.gpus_per_node)
        check_positive_int("nodes", self.nodes)
        if not self.measured:
            _name("gpu", self.gpu, tuple(GPUS))
            _name("network", self.network, NETWORKS)
            _name("intra", self.intra, INTRA)
            _name("cpu", self.cpu, ("intel", "intel-spr", "intel-emr", "amd"))
            if self.nodes > 1:
                check_positive_int("nics_per_node", self.nics_per_node)
                check_positive("nic_gbps", self.nic_gbps)
            check_positive("intra_GBps", self.intra_GBps)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_hardware(
        cls,
        gpu: str = "h100",
        gpus_per_node: int | None = None,
        nodes: int = 1,
        nics_per_node: int | None = None,
        nic_gbps: float | None = None,
        network: str = "ib",
        *,
        intra_node: str | None = None,
        intra: str | None = None,
        pcie_gen: int | None = None,
        pcie_across: str = "switch",
        pcie_GBps: float | None = None,
        bridge_GBps: float | None = None,
        cpu: str = "intel",
        gpus_per_process: int = 1,
        calibration: Calibration = DEFAULT_CALIBRATION,
        net_latency_us: float | None = None,
        name: str | None = None,
        source: str = "",
    ) -> Fabric:
        """A fabric from its parts; every default is the GPU's (see :data:`GPUS`).

        ``intra_node`` (``intra`` is the same, its older name): ``nvswitch`` (SXM boards: all
        GPUs on NVSwitches, NVLS from Hopper on), ``nvlink-pairs`` (PCIe cards NVLink-bridged
        two by two; a ring over more than one pair crosses PCIe, its slowest hop), ``pcie``
        (no NVLink) or ``nvlink`` (V100's cube-mesh); default what the GPU ships in (SXM:
        NVSwitch, a PCIe card: PCIe). The PCIe hop: ``pcie_gen`` (default the GPU's; x16 is
        NCCL's 12/24/48 GB/s for Gen3/4/5), ``pcie_across`` ``switch`` or ``sockets`` (then
        the CPUs' link, NCCL's per ``cpu``: ``intel``, ``intel-spr``, ``intel-emr``, ``amd``),
        or give ``pcie_GBps``; ``bridge_GBps`` overrides the NVLink bridge's.
        ``network``: ib, roce, efa or tcp; ``nics_per_node`` default one per GPU.
        ``net_latency_us``: the network's cost per inter-node hop, µs, when you know it (NCCL's
        source does not give it; default the calibration's, fitted to published runs).
        ``gpus_per_process``: nccl-tests' ``-g`` (one thread launching on several GPUs).
        """
        g = _name("gpu", gpu, tuple(GPUS))
        spec = GPUS[g]
        ppn = spec.gpus_per_node if gpus_per_node is None else gpus_per_node
        ppn = check_positive_int("gpus_per_node", ppn)
        nodes = check_positive_int("nodes", nodes)
        nics = ppn if nics_per_node is None else check_positive_int("nics_per_node", nics_per_node)
        gbps = spec.nic_gbps if nic_gbps is None else check_positive("nic_gbps", nic_gbps)
        if intra is not None and intra_node is not None and intra != intra_node:
            raise ValueError(f"give intra_node or intra, not both ({intra_node!r}, {intra!r})")
        asked = intra_node if intra_node is not None else intra
        kind = spec.intra if asked is None else _name("intra", asked, INTRA)
        path = intra_node_path(
            spec,
            kind,
            ppn,
            pcie_gen=pcie_gen,
            pcie_across=check_choice("pcie_across", pcie_across, ACROSS),
            cpu=_name("cpu", cpu, ("intel", "intel-spr", "intel-emr", "amd")),
            bridge_GBps=None if bridge_GBps is None else check_positive("bridge_GBps", bridge_GBps),
            pcie_GBps_override=None
            if pcie_GBps is None
            else check_positive("pcie_GBps", pcie_GBps),
        )
        net = _name("network", network, NETWORKS)
        if net_latency_us is not None:
            lat = check_nonneg("net_latency_us", net_latency_us)
            calibration = calibration.with_(net_latency_us={**calibration.net_latency_us, net: lat})
        label = name or (
            f"{ppn}×{g}" + (f" × {nodes} nodes, {nics}×{gbps:g} Gb/s {net}" if nodes > 1 else "")
        )
        return cls(
            name=label,
            gpu=g,
            gpus_per_node=ppn,
            nodes=nodes,
            nics_per_node=nics,
            nic_gbps=gbps,
            network=net,
            intra=kind,
            intra_GBps=path.ring_GBps,
            intra_paths=path.paths,
            cpu=cpu,
            gpus_per_process=check_positive_int("gpus_per_process", gpus_per_process),
            calibration=calibration,
            source=source,
        )

    @classmethod
    def from_levels(
        cls,
        *,
        gpus_per_node: int,
        nodes: int,
        intra_alpha_s: float,
        intra_beta_s_per_byte: float,
        inter_alpha_s: float = 0.0,
        inter_beta_s_per_byte: float = 0.0,
        link_mbit: float | None = None,
        name: str = "two-level (measured)",
        source: str = "",
    ) -> Fabric:
        """A fabric of two measured α-β levels (see :class:`Levels`): ranks in a node over
        loopback, nodes joined by a link of ``1/inter_beta`` bytes per second — or give the
        link's shaped rate as ``link_mbit`` (Mbit/s each way, as :class:`dplab.nodes.Nodes`
        takes it) and β is 8 / (link_mbit · 10⁶)."""
        if link_mbit is not None:
            if inter_beta_s_per_byte:
                raise ValueError("give inter_beta_s_per_byte or link_mbit, not both")
            inter_beta_s_per_byte = 8 / (check_positive("link_mbit", link_mbit) * 1e6)
        inter_beta = (check_nonneg if nodes == 1 else check_positive)(
            "inter_beta_s_per_byte", inter_beta_s_per_byte
        )
        lv = Levels(
            intra_alpha_s=check_nonneg("intra_alpha_s", intra_alpha_s),
            intra_beta_s_per_byte=check_positive("intra_beta_s_per_byte", intra_beta_s_per_byte),
            inter_alpha_s=check_nonneg("inter_alpha_s", inter_alpha_s),
            inter_beta_s_per_byte=inter_beta,
        )
        return cls(name=name, gpus_per_node=gpus_per_node, nodes=nodes, levels=lv, source=source)

    @classmethod
    def preset(cls, name: str, *, nodes: int = 1, **overrides: Any) -> Fabric:
        """A common machine (:data:`PRESETS`) at ``nodes`` nodes; ``overrides`` go to
        :meth:`from_hardware` (e.g. ``nic_gbps=``, ``net_latency_us=``)."""
        if name not in PRESETS:
            raise ValueError(f"unknown fabric preset {name!r}; choose from {', '.join(PRESETS)}")
        kw, src = PRESETS[name]
        kw = {**kw, "nodes": nodes, **overrides}
        return cls.from_hardware(**kw, name=f"{name} × {nodes}", source=src)

    def with_nodes(self, nodes: int) -> Fabric:
        """The same machines, ``nodes`` of them."""
        return replace(self, nodes=check_positive_int("nodes", nodes), _cache={})

    def with_calibration(self, calibration: Calibration) -> Fabric:
        return replace(self, calibration=calibration, _cache={})

    # -- the model -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def measured(self) -> bool:
        """True: timed by two measured α-β :class:`Levels`; False: by NCCL's cost model."""
        return self.levels is not None

    @cached_property
    def cost_model(self) -> LevelsModel | NcclModel:
        """The one cost model this fabric times all-reduces with (see :attr:`measured`)."""
        if self.levels is not None:
            return LevelsModel(self.levels, self.gpus_per_node, self.nodes)
        return NcclModel(self.topology)

    @cached_property
    def topology(self) -> Topology:
        """What NCCL's tuner knows about this hardware (a measured fabric has none)."""
        if self.measured:
            raise ValueError(f"{self.name} is timed by measured levels: it has no NCCL topology")
        g = GPUS[self.gpu]
        return Topology(
            gen=g.gen,
            ppn=self.gpus_per_node,
            nodes=self.nodes,
            intra_bw=self.intra_GBps,
            intra_hw=self.intra_hw,
            nvswitch=self.intra == "nvswitch",
            net_bw=self.nics_per_node * self.nic_gbps / 100 * NET_BW_PER_100GBIT,
            nic_bw=self.nic_gbps / 100 * NET_BW_PER_100GBIT,
            net=self.network,
            cpu="amd" if self.cpu == "amd" else "intel",
            launch_gpus=self.gpus_per_process,
            protocols=self.protocols,
            calibration=self.calibration,
        )

    @property
    def intra_hw(self) -> str:
        """NCCL's hardware class of the ring's intra-node path: ``nvlink`` when every hop is
        NVLink (NVSwitch, cube-mesh, one bridged pair), ``pci`` when the ring crosses PCIe
        (``tuning.cc``: ``typeIntra == LINK_NVL ? NCCL_HW_NVLINK : NCCL_HW_PCI``, line 285)."""
        if self.intra == "pcie" or (self.intra == "nvlink-pairs" and self.gpus_per_node > 2):
            return "pci"
        return "nvlink"

    @property
    def protocols(self) -> tuple[str, ...]:
        """NCCL protocols this cluster runs. EFA before P5 cannot deliver the bytes of a 128-byte
        line in order, so the AWS plugin sets ``NCCL_PROTO=simple`` there (aws-ofi-nccl#76:
        "NCCL_PROTO=simple is a must ... EFA doesn't support LL and LL128"; the plugin sets it
        itself when in-order delivery is unsupported, aws-ofi-nccl#850, and exempts P5's RDMA,
        aws-ofi-nccl#280). Taken here as: EFA across nodes with Volta or Ampere GPUs."""
        if self.network == "efa" and self.nodes > 1 and GPUS[self.gpu].gen in ("volta", "ampere"):
            return ("Simple",)
        return PROTOCOLS

    def algorithms(self) -> tuple[str, ...]:
        """The algorithms this fabric's cost model offers (NCCL: NVLS needs NVSwitch and Hopper+
        on one node; NVLS-tree the same on several)."""
        return self.cost_model.available()

    def choice(self, nbytes: float, algorithm: str = "auto") -> tuple[str, str]:
        """(algorithm, protocol) the model predicts fastest for ``nbytes`` (NCCL's rule)."""
        return self._best(nbytes, algorithm)[:2]

    def _best(self, nbytes: float, algorithm: str) -> tuple[str, str, float]:
        key = (check_nonneg("nbytes", nbytes), _name("algorithm", algorithm, ("auto", *ALGORITHMS)))
        hit = self._cache.get(key)
        if hit is None:
            hit = self.cost_model.best_s(*key)
            if len(self._cache) < 4096:
                self._cache[key] = hit
        return hit

    def allreduce_s(
        self, nbytes: float, world_size: int | None = None, *, algorithm: str = "auto"
    ) -> float:
        """Seconds for one all-reduce of ``nbytes`` on this fabric.

        ``world_size`` is there so a Fabric stands where a Link does; given, it must be this
        fabric's (use :meth:`with_nodes` to change the cluster).
        """
        if world_size is not None and world_size != self.world_size:
            if isinstance(world_size, str):
                raise ValueError(
                    f"world_size {world_size!r} is not a number; pass algorithm={world_size!r} "
                    "by name"
                )
            raise ValueError(
                f"world_size {world_size!r} does not match the fabric {self.name!r} "
                f"({self.gpus_per_node} × {self.nodes} = {self.world_size} ranks); use "
                "fabric.with_nodes(n)"
            )
        return self._best(nbytes, algorithm)[2]

    def busbw_GBps(self, nbytes: float, algorithm: str = "auto") -> float:
        """nccl-tests' bus bandwidth: algbw · 2(N−1)/N, algbw = bytes / time, in GB/s."""
        t = self.allreduce_s(nbytes, algorithm=algorithm)
        if self.world_size == 1 or nbytes == 0:
            return 0.0  # 2(N−1)/N = 0: nothing crosses a link
        return busbw_from_time(nbytes, t, self.world_size)

    # -- what the simulator prints and saves ------------------------------------------------
    def describe(self) -> str:
        if self.levels is not None:  # narrows the type: self.measured
            lv = self.levels
            return (
                f"{self.name}: {self.gpus_per_node} ranks/node × {self.nodes} nodes, intra "
                f"α {lv.intra_alpha_s * 1e6:.3g} µs, {1e-9 / lv.intra_beta_s_per_byte:.3g} GB/s;"
                f" inter α {lv.inter_alpha_s * 1e6:.3g} µs"
            )
        nics = (
            f"; {self.nics_per_node} × {self.nic_gbps:g} Gb/s {self.network} per node"
            if self.nodes > 1
            else ""
        )
        paths = (
            " + ".join(f"{p} {bw:.0f}" for p, bw in self.intra_paths) or f"{self.intra_GBps:.0f}"
        )
        intra = f"{self.intra}: {paths} GB/s per GPU" if self.gpus_per_node > 1 else "1 GPU"
        return (
            f"{self.name}: {self.world_size:,} × {self.gpu.upper()} ({self.gpus_per_node}/node, "
            f"{intra}{nics}), NCCL algorithms: "
            f"{', '.join(self.algorithms())}"
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.compare}
        d["calibration"] = asdict(self.calibration)
        d["levels"] = asdict(self.levels) if self.levels else None
        d["world_size"] = self.world_size
        return d

    # -- calibration -----------------------------------------------------------------------
    def _fitted(self, points: list[tuple[float, float]], algorithm: str) -> Fabric:
        last: list = [None, None]  # the fitter tries one calibration on every row in turn

        def predict(cal: Calibration, nbytes: float) -> float:
            if last[0] is not cal:  # a new candidate: build its model (and its tables) once
                last[:] = [cal, self.with_calibration(cal)]
            return last[1].allreduce_s(nbytes, algorithm=algorithm)

        cal, what = fit_constants(self.calibration, predict, points)
        return replace(
            self.with_calibration(cal),
            name=f"{self.name} (fitted)",
            source="; ".join(s for s in (self.source, what) if s),
        )

    @classmethod
    def fit(
        cls,
        data: str | Iterable[Any] | Mapping[str, Any],
        *,
        gpu: str = "h100",
        gpus_per_node: int | None = None,
        nodes: int = 1,
        nics_per_node: int | None = None,
        nic_gbps: float | None = None,
        network: str = "ib",
        algorithm: str = "auto",
        **hardware: Any,
    ) -> Fabric:
        """This hardware, with its constants fitted to measured times (see
        :meth:`calibrated_from`). The fabric's rank count must be the run's: it is checked
        against the log's ``# Rank`` lines or the rows' ``world_size``."""
        base = cls.from_hardware(
            gpu, gpus_per_node, nodes, nics_per_node, nic_gbps, network, **hardware
        )
        points, ranks = measured_points(data)
        if ranks is not None and ranks != base.world_size:
            raise ValueError(
                f"the measurements are from {ranks} ranks but the fabric has "
                f"{base.world_size} ({base.gpus_per_node} × {base.nodes}): set gpus_per_node/nodes"
            )
        return base._fitted(points, algorithm)

    @classmethod
    def from_nccl_tests_log(
        cls,
        log: str,
        gpu: str = "h100",
        gpus_per_node: int | None = None,
        *,
        nics_per_node: int | None = None,
        nic_gbps: float | None = None,
        network: str = "ib",
        algorithm: str = "auto",
        **hardware: Any,
    ) -> Fabric:
        """Your own box, from your own ``all_reduce_perf`` log: the log's ``# Rank`` lines give
        the ranks (so the node count, at ``gpus_per_node``), its header's ``nGpus`` the GPUs
        each process drives; then :meth:`calibrated_from` fits the constants to its rows.

        On several nodes with no ``nic_gbps`` given, the NICs' speed is calibrated first from
        the log's own largest message (its bandwidth plateau), and the fabric's ``source`` says
        so: the large sizes then say nothing about the model, only about your NICs.
        """
        run = parse_nccl_tests(log)
        spec_ppn = GPUS[_name("gpu", gpu, tuple(GPUS))].gpus_per_node
        ppn = check_positive_int("gpus_per_node", gpus_per_node or spec_ppn)
        ranks = run.ranks or ppn
        if ranks % ppn:
            raise ValueError(
                f"the log is from {ranks} ranks, not a whole number of {ppn}-GPU nodes: "
                "set gpus_per_node"
            )
        base = cls.from_hardware(
            gpu, ppn, ranks // ppn, nics_per_node, nic_gbps, network,
            gpus_per_process=run.gpus_per_process or 1, **hardware,
        )  # fmt: skip
        if base.nodes > 1 and nic_gbps is None:
            big = max(run.rows, key=lambda r: r.bytes)
            base = base.with_nics_from_plateau(big.bytes, big.time_us * 1e-6, algorithm)
        return base.calibrated_from(log, algorithm=algorithm)

    def with_nics_from_plateau(
        self, nbytes: float, seconds: float, algorithm: str = "auto"
    ) -> Fabric:
        """This fabric with its NICs' speed set so that an all-reduce of ``nbytes`` (a sweep's
        largest, on its bandwidth plateau) takes the measured ``seconds``: how a run whose
        source gives no NIC fields is calibrated rather than skipped. ``source`` says so.

        Where the NICs are not what limits the plateau (NVLS inside the node is), the slowest
        NIC speed that reaches it is taken: the data cannot tell faster ones apart.
        """
        check_positive("nbytes", nbytes)
        check_positive("seconds", seconds)
        if self.nodes == 1:
            raise ValueError(f"{self.name} is one node: it has no NICs to calibrate")

        def at(gbps: float) -> Fabric:
            return replace(self, nic_gbps=gbps, _cache={})

        def t(gbps: float) -> float:
            return at(gbps).allreduce_s(nbytes, algorithm=algorithm)

        lo, hi = 1.0, 12800.0  # Gb/s per NIC
        floor = t(hi)
        if t(lo) < seconds:
            gbps = lo
        else:
            target = max(seconds, floor * 1.005)  # a limit elsewhere: the slowest NIC reaching it
            for _ in range(60):
                mid = math.sqrt(lo * hi)
                lo, hi = (mid, hi) if t(mid) > target else (lo, mid)
            gbps = hi
        note = (
            f"NIC speed calibrated from the sweep's own plateau: {gbps:.0f} Gb/s per NIC "
            f"makes {nbytes / 2**20:,.0f} MiB take the measured {seconds * 1e6:,.0f} µs"
        )
        return replace(at(gbps), source="; ".join(s for s in (self.source, note) if s))

    def calibrated_from(
        self, data: str | Iterable[Any] | Mapping[str, Any], *, algorithm: str = "auto"
    ) -> Fabric:
        """This fabric with its constants fitted to your own measurements of it.

        ``data``: nccl-tests ``all_reduce_perf`` output (text, as printed), or rows of
        ``python -m dplab bandwidth`` (its JSON report, or its rows: ``size_bytes``,
        ``time_s``, ``algorithm == "all_reduce"``). Fitted, minimising the squared log error of
        time over the rows (a 10 µs row counts as much as a 10 s one): one factor on every
        bandwidth and one on every latency (two rows or more; one row: the factor its size
        depends on), and from three rows the pipeline fill (``fill_slices``), which shapes
        the mid sizes between the latency floor and the bandwidth plateau.

        A log from fewer nodes than this fabric (its ``# Rank`` lines count the ranks) is fitted
        at the log's node count, and the fitted constants carried to this one: calibrate on
        2 nodes, predict 16.
        """
        points, ranks = measured_points(data, minimum=1)
        at = self
        if ranks is not None and ranks != self.world_size:
            if ranks % self.gpus_per_node:
                raise ValueError(
                    f"the measurements are from {ranks} ranks, not a whole number of "
                    f"{self.gpus_per_node}-GPU nodes of {self.name}"
                )
            at = self.with_nodes(ranks // self.gpus_per_node)
        fitted = at._fitted(points, algorithm)
        return replace(fitted, nodes=self.nodes, _cache={})
