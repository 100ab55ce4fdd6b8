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
from numbers import Real
from typing import Any

from dplab.sim.contention import Contention
from dplab.sim.nccl_model import (
    ALGORITHMS,
    DEFAULT_CALIBRATION,
    NET_BW_PER_100GBIT,
    NVLINK_BW_PER_LINK,
    PCI_BW,
    PROTOCOLS,
    Calibration,
    Topology,
)
from dplab.sim.nccl_tests import NcclTestsRow, parse_nccl_tests
from dplab.sim.profile import BackwardProfile

GB = 1e9
# Optional realism, off unless asked for: NCCL's kernels take SMs and memory bandwidth, so
# backward runs slower while an all-reduce is in flight. Measured on A100, H100, MI250 and
# MI210 with GPT and LLaMA layers: 18.9 % slower on average, 40.0 % at worst (
# "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning",
# arXiv:2507.03114, abstract).
NCCL_OVERLAP_SLOWDOWN = 0.189
NETWORKS = ("ib", "roce", "efa", "tcp")
INTRA = ("nvswitch", "nvlink", "pcie")


@dataclass(frozen=True)
class GpuSpec:
    gen: str
    nvlinks: int
    intra: str
    gpus_per_node: int
    nic_gbps: float


GPUS: dict[str, GpuSpec] = {
    "v100": GpuSpec("volta", 6, "nvlink", 8, 100),  # DGX-1V: hybrid cube-mesh, no NVSwitch
    "a100": GpuSpec("ampere", 12, "nvswitch", 8, 200),
    "h100": GpuSpec("hopper", 18, "nvswitch", 8, 400),
    "h200": GpuSpec("hopper", 18, "nvswitch", 8, 400),
    "h20": GpuSpec("hopper", 18, "nvswitch", 8, 400),
    "b200": GpuSpec("blackwell", 18, "nvswitch", 8, 400),
    "gb200": GpuSpec("blackwell", 18, "nvswitch", 72, 400),
}


def overlap_contention(slowdown: float = NCCL_OVERLAP_SLOWDOWN) -> Contention:
    """A :class:`~dplab.sim.contention.Contention` for a GPU: backward at ``1/(1+slowdown)``
    of its speed while NCCL runs (default: the published average, :data:`NCCL_OVERLAP_SLOWDOWN`),
    the all-reduce unchanged. Pass it as ``simulate(..., fabric=f, contention=...)``."""
    return Contention(
        compute_slowdown=_pos_num("slowdown", slowdown, zero_ok=True),
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
    k = 1.0 + _pos_num("slower_by", slower_by, zero_ok=True)
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


def _pos_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return v


def _pos_num(name: str, v: Any, *, zero_ok: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if v < 0 or (v == 0 and not zero_ok):
        raise ValueError(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {v!r}")
    return float(v)


def _choose(name: str, v: Any, options: Sequence[str]) -> str:
    if not isinstance(v, str) or v.lower() not in options:
        raise ValueError(f"{name} must be one of {', '.join(options)}; got {v!r}")
    return v.lower()


@dataclass(frozen=True)
class Levels:
    """Two measured α-β levels: ranks within a node (e.g. loopback) and the link between nodes.

    For clusters with no NCCL constants to borrow (gloo ranks in network namespaces joined by a
    shaped link): α in seconds per message, β in seconds per byte, inter β per *node* link.
    Ring: 2(N−1) steps, 2(nodes−1) of them across nodes, bus bandwidth min(1/β_intra, 1/β_inter)
    (each node's link carries one ring crossing per channel); tree: 2((ppn−1)·α_intra +
    log2(nodes)·α_inter) latency and half the bus bandwidth, twice that at 2 nodes (a 2-node
    double binary tree sends each byte across once each way) — NCCL's tuning.cc structure with
    measured numbers in place of its constants.
    """

    intra_alpha_s: float
    intra_beta_s_per_byte: float
    inter_alpha_s: float
    inter_beta_s_per_byte: float

    def time_s(self, nbytes: float, ppn: int, nodes: int, algorithm: str) -> float:
        n = ppn * nodes
        if n == 1:
            return 0.0
        ai, bi = self.intra_alpha_s, self.intra_beta_s_per_byte
        ae, be = self.inter_alpha_s, self.inter_beta_s_per_byte if nodes > 1 else 0.0
        if algorithm == "ring":
            inter = 2 * (nodes - 1)
            lat = (2 * (n - 1) - inter) * ai + inter * ae
            return lat + 2 * (n - 1) / n * nbytes * max(bi, be)
        if algorithm == "tree":
            lat = 2 * ((ppn - 1) * ai + (nodes.bit_length() - 1) * ae)
            beta = max(bi, be / 2 if nodes <= 2 else be)
            return lat + nbytes * 2 * beta
        raise ValueError(f"algorithm {algorithm!r} is not available on measured levels")


@dataclass(frozen=True)
class Fabric:
    """A cluster for the all-reduce: see the module docstring; build with :meth:`from_hardware`,
    :meth:`preset`, :meth:`fit` or :meth:`from_levels`.

    ``intra_GBps``: one GPU's one-way intra-node bandwidth as NCCL counts it (NVLinks × per-link
    speed, or PCIe); ``nic_gbps``: one NIC's line rate in Gb/s.
    """

    name: str
    gpu: str
    gpus_per_node: int
    nodes: int
    nics_per_node: int
    nic_gbps: float
    network: str
    intra: str
    intra_GBps: float
    cpu: str = "intel"
    calibration: Calibration = DEFAULT_CALIBRATION
    levels: Levels | None = None
    source: str = ""
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a fabric needs a name, got {self.name!r}")
        _pos_int("gpus_per_node", self.gpus_per_node)
        _pos_int("nodes", self.nodes)
        if self.levels is None:
            _choose("gpu", self.gpu, tuple(GPUS))
            _choose("network", self.network, NETWORKS)
            _choose("intra", self.intra, INTRA)
            _choose("cpu", self.cpu, ("intel", "amd"))
            if self.nodes > 1:
                _pos_int("nics_per_node", self.nics_per_node)
                _pos_num("nic_gbps", self.nic_gbps)
            _pos_num("intra_GBps", self.intra_GBps)

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
        intra: str | None = None,
        pcie_GBps: float | None = None,
        cpu: str = "intel",
        calibration: Calibration = DEFAULT_CALIBRATION,
        name: str | None = None,
        source: str = "",
    ) -> Fabric:
        """A fabric from its parts; every default is the GPU's (see :data:`GPUS`).

        ``intra``: ``nvswitch`` (all GPUs of a node on NVSwitches: NVLS possible from Hopper),
        ``nvlink`` (direct NVLink, as V100's cube-mesh) or ``pcie`` (``pcie_GBps`` per GPU,
        default NCCL's Gen3 x16 12 GB/s). ``network``: ib, roce, efa or tcp; its latency is the
        calibration's ``net_latency_us``.
        """
        g = _choose("gpu", gpu, tuple(GPUS))
        spec = GPUS[g]
        ppn = (
            spec.gpus_per_node
            if gpus_per_node is None
            else _pos_int("gpus_per_node", gpus_per_node)
        )
        nodes = _pos_int("nodes", nodes)
        nics = ppn if nics_per_node is None else _pos_int("nics_per_node", nics_per_node)
        gbps = spec.nic_gbps if nic_gbps is None else _pos_num("nic_gbps", nic_gbps)
        kind = spec.intra if intra is None else _choose("intra", intra, INTRA)
        if kind == "pcie":
            intra_bw = PCI_BW if pcie_GBps is None else _pos_num("pcie_GBps", pcie_GBps)
        else:
            intra_bw = spec.nvlinks * NVLINK_BW_PER_LINK[spec.gen]
        label = name or (
            f"{ppn}×{g}"
            + (f" × {nodes} nodes, {nics}×{gbps:g} Gb/s {network}" if nodes > 1 else "")
        )
        return cls(label, g, ppn, nodes, nics, gbps, _choose("network", network, NETWORKS),
                   kind, intra_bw, cpu, calibration, None, source)  # fmt: skip

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
            inter_beta_s_per_byte = 8 / (_pos_num("link_mbit", link_mbit) * 1e6)
        lv = Levels(
            _pos_num("intra_alpha_s", intra_alpha_s, zero_ok=True),
            _pos_num("intra_beta_s_per_byte", intra_beta_s_per_byte),
            _pos_num("inter_alpha_s", inter_alpha_s, zero_ok=True),
            _pos_num("inter_beta_s_per_byte", inter_beta_s_per_byte, zero_ok=nodes == 1),
        )
        return cls(name, "measured", gpus_per_node, nodes, 1, 0.0, "measured", "measured", 0.0,
                   levels=lv, source=source)  # fmt: skip

    @classmethod
    def preset(cls, name: str, *, nodes: int = 1, **overrides: Any) -> Fabric:
        """A common machine (:data:`PRESETS`) at ``nodes`` nodes; ``overrides`` go to
        :meth:`from_hardware` (e.g. ``nic_gbps=``)."""
        if name not in PRESETS:
            raise ValueError(f"unknown fabric preset {name!r}; choose from {', '.join(PRESETS)}")
        kw, src = PRESETS[name]
        return cls.from_hardware(**{**kw, "nodes": nodes, **overrides}, name=f"{name} × {nodes}",
                                 source=src)  # fmt: skip

    def with_nodes(self, nodes: int) -> Fabric:
        """The same machines, ``nodes`` of them."""
        return replace(self, nodes=_pos_int("nodes", nodes), _cache={})

    def with_calibration(self, calibration: Calibration) -> Fabric:
        return replace(self, calibration=calibration, _cache={})

    # -- the model -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @cached_property
    def topology(self) -> Topology:
        g = GPUS[self.gpu]
        return Topology(
            gen=g.gen,
            ppn=self.gpus_per_node,
            nodes=self.nodes,
            intra_bw=self.intra_GBps,
            intra_hw="pci" if self.intra == "pcie" else "nvlink",
            nvswitch=self.intra == "nvswitch",
            net_bw=self.nics_per_node * self.nic_gbps / 100 * NET_BW_PER_100GBIT,
            nic_bw=self.nic_gbps / 100 * NET_BW_PER_100GBIT,
            net=self.network,
            cpu=self.cpu,
            protocols=self.protocols,
            calibration=self.calibration,
        )

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
        """The algorithms NCCL would enable here (NVLS: NVSwitch, Hopper+, one node; NVLS-tree:
        the same, several nodes)."""
        if self.levels is not None:
            return ("ring", "tree")
        return self.topology.available()

    def choice(self, nbytes: float, algorithm: str = "auto") -> tuple[str, str]:
        """(algorithm, protocol) the model predicts fastest for ``nbytes`` (NCCL's rule)."""
        return self._best(nbytes, algorithm)[:2]

    def _best(self, nbytes: float, algorithm: str) -> tuple[str, str, float]:
        s = _pos_num("nbytes", nbytes, zero_ok=True)
        a = _choose("algorithm", algorithm, ("auto", *ALGORITHMS))
        key = (s, a)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if self.levels is not None:
            opts = ("ring", "tree") if a == "auto" else (a,)
            if a not in ("auto", "ring", "tree"):
                raise ValueError(f"algorithm {algorithm!r} is not available on {self.name}: "
                                 "measured levels have ring and tree")  # fmt: skip
            times = {o: self.levels.time_s(s, self.gpus_per_node, self.nodes, o) for o in opts}
            best_a = min(times, key=times.__getitem__)
            out = (best_a, "measured", times[best_a])
        elif self.world_size == 1 or s == 0:
            out = ("ring" if a == "auto" else a, "Simple", 0.0)
        else:
            a2, p, us = self.topology.best(s, a)
            out = (a2, p, us * 1e-6)
        if len(self._cache) < 4096:
            self._cache[key] = out
        return out

    def allreduce_s(
        self, nbytes: float, world_size: int | None = None, *, algorithm: str = "auto"
    ) -> float:
        """Seconds for one all-reduce of ``nbytes`` on this fabric.

        ``world_size`` is there so a Fabric stands where a Link does; given, it must be this
        fabric's (use :meth:`with_nodes` to change the cluster).
        """
        if world_size is not None and world_size != self.world_size:
            if isinstance(world_size, str):
                raise ValueError(f"world_size {world_size!r} is not a number; pass "
                                 f"algorithm={world_size!r} by name")  # fmt: skip
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
        if self.levels is not None:
            lv = self.levels
            return (f"{self.name}: {self.gpus_per_node} ranks/node × {self.nodes} nodes, intra "
                    f"α {lv.intra_alpha_s * 1e6:.3g} µs, {1e-9 / lv.intra_beta_s_per_byte:.3g} "
                    f"GB/s; inter α {lv.inter_alpha_s * 1e6:.3g} µs")  # fmt: skip
        return (
            f"{self.name}: {self.world_size:,} × {self.gpu.upper()} ({self.gpus_per_node}/node, "
            f"{self.intra} {self.intra_GBps:.0f} GB/s per GPU"
            + (
                f"; {self.nics_per_node} × {self.nic_gbps:g} Gb/s {self.network} per node"
                if self.nodes > 1
                else ""
            )
            + f"), NCCL algorithms: {', '.join(self.algorithms())}"
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.compare}
        d["calibration"] = asdict(self.calibration)
        d["levels"] = asdict(self.levels) if self.levels else None
        d["world_size"] = self.world_size
        return d

    # -- calibration -----------------------------------------------------------------------
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
        """This hardware, with the bandwidth and latency scales that best fit measured times.

        ``data``: nccl-tests ``all_reduce_perf`` output (text, as printed), or rows of
        ``python -m dplab bandwidth`` (its JSON report, or its rows: ``size_bytes``,
        ``time_s``, ``algorithm == "all_reduce"``). Fitted: one factor on every bandwidth of
        the model and one on every latency, minimising the squared log error of time over all
        rows (so a 10 µs row counts as much as a 10 s one). The fabric's rank count must be the
        run's: it is checked against the log's ``# Rank`` lines or the rows' ``world_size``.
        """
        base = cls.from_hardware(gpu, gpus_per_node, nodes, nics_per_node, nic_gbps, network,
                                 **hardware)  # fmt: skip
        points, ranks = _measured_points(data)
        if ranks is not None and ranks != base.world_size:
            raise ValueError(
                f"the measurements are from {ranks} ranks but the fabric has "
                f"{base.world_size} ({base.gpus_per_node} × {base.nodes}): set gpus_per_node/nodes"
            )
        cal0 = base.calibration

        def err(x: Sequence[float]) -> float:
            cal = cal0.with_(
                bw_efficiency=min(2.0, cal0.bw_efficiency * x[0]),
                nvls_efficiency=min(2.0, cal0.nvls_efficiency * x[0]),
                latency_scale=cal0.latency_scale * x[1],
            )
            f = base.with_calibration(cal)
            return sum(math.log(f.allreduce_s(b, algorithm=algorithm) / t) ** 2 for b, t in points)

        x = minimize_log(err, [1.0, 1.0], bounds=[(0.05, 2.0 / max(cal0.bw_efficiency,
                                                                   cal0.nvls_efficiency)),
                                                   (0.02, 50.0)])  # fmt: skip
        cal = cal0.with_(
            bw_efficiency=cal0.bw_efficiency * x[0],
            nvls_efficiency=cal0.nvls_efficiency * x[0],
            latency_scale=cal0.latency_scale * x[1],
        )
        return replace(base.with_calibration(cal), name=f"{base.name} (fitted)",
                       source=f"fit to {len(points)} measured sizes: bandwidth × {x[0]:.3g}, "
                              f"latency × {x[1]:.3g}")  # fmt: skip


def _measured_points(data: Any) -> tuple[list[tuple[float, float]], int | None]:
    """(bytes, seconds) pairs and the rank count, from nccl-tests text or dplab bandwidth rows."""
    if isinstance(data, str):
        run = parse_nccl_tests(data)
        pts = [(float(r.bytes), r.time_us * 1e-6) for r in run.rows if r.bytes > 0]
        ranks = run.ranks
    else:
        rows = data.get("rows") if isinstance(data, Mapping) else data
        if rows is None:
            raise ValueError("a bandwidth report needs 'rows'")
        pts, sizes = [], set()
        for i, r in enumerate(rows):
            if isinstance(r, NcclTestsRow):
                r = {"size_bytes": r.bytes, "time_s": r.time_us * 1e-6}
            elif hasattr(r, "to_dict"):
                r = r.to_dict()
            if not isinstance(r, Mapping) or "size_bytes" not in r or "time_s" not in r:
                raise ValueError(f"row {i} needs size_bytes and time_s, got {r!r}")
            if r.get("algorithm", "all_reduce") != "all_reduce":
                continue
            if "world_size" in r:
                sizes.add(r["world_size"])
            pts.append((float(r["size_bytes"]), float(r["time_s"])))
        if len(sizes) > 1:
            raise ValueError(f"rows mix world sizes {sorted(sizes)}: fit one at a time")
        ranks = sizes.pop() if sizes else None
    pts = [(b, t) for b, t in pts if b > 0]
    for b, t in pts:
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"a measured time must be > 0 s, got {t!r} at {b:g} bytes")
    if len(pts) < 2:
        raise ValueError(f"need at least 2 measured sizes to fit, got {len(pts)}")
    return pts, ranks


def minimize_log(
    f: Any, x0: Sequence[float], *, bounds: Sequence[tuple[float, float]], sweeps: int = 8
) -> list[float]:
    """Minimise ``f`` over positive parameters by coordinate-wise golden-section search in
    log space. Deterministic and dependency-free: the models here are piecewise smooth (a min
    over algorithms), where a coarse scan then a golden refinement is robust."""
    x = [min(max(v, lo), hi) for v, (lo, hi) in zip(x0, bounds, strict=True)]
    g = (math.sqrt(5) - 1) / 2
    for sweep in range(sweeps):
        for i, (lo, hi) in enumerate(bounds):
            a, b = math.log(lo), math.log(hi)

            def at(u: float, i: int = i) -> float:
                y = list(x)
                y[i] = math.exp(u)
                return f(y)

            if sweep == 0:  # a coarse scan finds the right basin
                grid = [a + (b - a) * k / 24 for k in range(25)]
                k = min(range(25), key=lambda k: at(grid[k]))
                a, b = grid[max(0, k - 1)], grid[min(24, k + 1)]
            else:
                u = math.log(x[i])
                w = (b - a) / 4**sweep
                a, b = max(a, u - w), min(b, u + w)
            c, d = b - g * (b - a), a + g * (b - a)
            fc, fd = at(c), at(d)
            for _ in range(40):
                if fc < fd:
                    b, d, fd = d, c, fc
                    c = b - g * (b - a)
                    fc = at(c)
                else:
                    a, c, fc = c, d, fd
                    d = a + g * (b - a)
                    fd = at(d)
            u = (a + b) / 2
            if at(u) <= f(x):
                x[i] = math.exp(u)
    return x


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
}
