"""NCCL's own cost model of an all-reduce, re-stated in closed form, plus a few fitted constants.

NCCL picks an algorithm (ring, tree, NVLS, NVLS-tree) and a protocol (LL, LL128, Simple) for
every collective by predicting each pair's time as ``latency + bytes / bandwidth`` and taking the
fastest. The numbers it uses are in NVIDIA/nccl ``src/graph/tuning.cc``
(``ncclTunerConstantsDefaults``, ``ncclTopoTuneModel``, ``ncclTopoGetAlgoTime``); the link speeds
it starts from are in ``src/graph/topo.h`` and ``src/graph/search.cc``. This module follows that
model's structure, read from the source at commit 5067397 (June 2026), not copied:

- per algorithm × protocol base latencies and per-hop latencies for NVLink, PCI and the network
  (``baseLatencies``, ``hwLatencies``); ring latency = base + intra-node steps × intra hop +
  2(nodes−1) inter-node steps × network hop; tree = base + 2((ppn−1)·intra + log2(nodes)·net);
  NVLS = its NVLink latency; NVLS-tree = NVLink + 2·log2(nodes)·net;
- bandwidth = the channels' sum (min of the NVLink sum and the NICs' sum; trees on 2 nodes may use
  twice the NICs, as NCCL's search allows), then the protocol refinements: LL half speed capped
  by ``llMaxBws``, LL128 × 0.92 capped per channel, tree × 0.92 (÷3.8 for LL), NVLS × the
  per-generation ``nvlsEfficiency`` × 2 × (channels−1)/channels, per-channel caps
  (``perChMax*Bws``), the tree's size-dependent ``treeCorrectionFactor`` and the multi-node
  ring's 1.4× "plateau" latency;
- bus bandwidth to algorithm bandwidth: × N/(2(N−1)) for ring and NVLS, × 0.5 for tree.

NCCL uses the model only to *rank* choices, and it is optimistic in absolute terms. What this
module adds, as a :class:`Calibration` of global constants fitted (by
``benchmarks/fabric_validation.py --fit``) to the *training* rows of the published nccl-tests
runs in ``assets/data/nccl-tests-published.json``, never per row:

- ``bw_efficiency``: achieved / modelled bandwidth of ring and tree;
- ``nvls_efficiency``: the same for NVLS and NVLS-tree (NCCL's model puts H100 NVLS near
  590 GB/s bus bandwidth; nccl-tests measure about 480);
- ``fill_slices``: a pipeline-fill term, which is why bus bandwidth reaches its plateau only at
  hundreds of MiB: for a ring, the time of this many NCCL Simple slices at one launched
  channel's speed (1 MiB: buffSize 4 MiB / NCCL_STEPS 8 × ALLREDUCE_SLICESTEPS 2; under one
  loop of nRanks 2 MiB chunks a channel's share is cut in nRanks chunks of two slices each, as
  NCCL's kernel does, ``all_reduce.h`` line 38, ``prims_simple.h`` lines 183-184); for a tree,
  this many times a one-step chunk's (512 KiB, or a channel's whole share) trip up the tree
  and back down, each hop at its own speed (NVLink inside a node, the network between) — the
  fill NCCL's ``latency + bytes / bandwidth`` leaves out, and what most separates a 2-node
  tree's mid sizes (1–64 MiB) from its plateau;
- per network kind, the inter-node latency NCCL gets from its network plugin
  (``graph->latencyInter``), which the source does not fix.
- per protocol, a factor on NCCL's base and intra-node latencies (``proto_latency``: the floor
  of LL, LL128 and Simple, which decides the sizes where the model switches protocol), a factor
  on LL's and LL128's bandwidth (``proto_bw``), and what one process driving several GPUs
  (nccl-tests ``-g``) adds per extra GPU (``launch_us_per_gpu``).

The fill follows what NCCL does after it has chosen, which its model leaves out: it launches
twice the channels its search found, each at half a search channel's speed
(:attr:`Topology.runtime_channels`), and runs a small message on fewer of them, each with a
bigger share (``enqueue.cc`` ``topoGetAlgoInfo``, :meth:`Topology.channels_used`). Tried and not
kept: giving a small message only its channels' share of the bandwidth too (leave one source
out, 1–32 MiB 9.8 % → 9.5 %, but a user's own log, 64 KiB–1 MiB, 11.3 % → 14.7 %: how fast one
channel runs LL is not in NCCL's source).

Everything here is closed form: a fabric's table of 12 (latency, bandwidth) pairs is built once,
and a time is a handful of float operations, so a 1,024-rank step costs what a 2-rank one does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

ALGORITHMS = ("ring", "tree", "nvls", "nvlstree")
PROTOCOLS = ("LL", "LL128", "Simple")
GENERATIONS = ("volta", "ampere", "hopper", "blackwell")

# --- from NVIDIA/nccl src/graph/tuning.cc (ncclTunerConstantsDefaults), µs and GB/s ---------
BASE_LATENCY_US = {  # per algorithm: LL, LL128, Simple
    "tree": (6.8, 14.0, 8.4),
    "ring": (6.6, 14.0, 8.4),
    "nvls": (0.0, 0.0, 0.0),
    "nvlstree": (0.0, 0.0, 0.0),
}
HW_LATENCY_US = {  # per hardware, per algorithm: LL, LL128, Simple
    "nvlink": {
        "tree": (0.6, 1.25, 4.0),
        "ring": (0.6, 1.9, 3.4),
        "nvls": (0.0, 0.0, 25.0),
        "nvlstree": (0.0, 0.0, 25.0),
    },
    "pci": {
        "tree": (1.0, 1.9, 4.0),
        "ring": (1.0, 2.5, 5.7),
        "nvls": (0.0, 0.0, 0.0),
        "nvlstree": (0.0, 0.0, 0.0),
    },
    "net": {
        "tree": (5.0, 8.5, 14.0),
        "ring": (2.7, 4.0, 14.0),
        "nvls": (0.0, 0.0, 18.0),
        "nvlstree": (0.0, 0.0, 20.9),
    },
}
# llMaxBws rows: one node indexes by GPU generation, several nodes by CPU vendor (row 0 Intel,
# row 1 AMD); columns: 1 node, 2 nodes, more.
LL_MAX_BW = (
    (39.0, 39.0, 20.4),
    (87.7, 22.5, 19.0),
    (141.0, 45.0, 35.0),
    (282.0, 90.0, 70.0),
)
PER_CH_RING_LL128_BW = {
    "volta": (20.0, 20.0, 20.0),
    "ampere": (20.0, 20.0, 20.0),
    "hopper": (36.7, 36.7, 36.7),
    "blackwell": (40.0, 40.0, 40.0),
}
PER_CH_TREE_LL128_BW = {
    "volta": (20.0, 20.0, 20.0),
    "ampere": (20.0, 20.0, 20.0),
    "hopper": (36.7, 36.7, 29.0),
    "blackwell": (55.6, 31.67, 20.0),
}
PER_CH_TREE_BW = {
    "volta": (26.5, 18.5, 10.0),
    "ampere": (24.0, 23.6, 17.8),
    "hopper": (38.7, 41.4, 36.0),
    "blackwell": (70.0, 42.8, 24.0),
}
PER_CH_NVLSTREE_BW = {
    "volta": (26.5, 18.5, 10.0),
    "ampere": (24.0, 23.6, 17.8),
    "hopper": (0.0, 57.7, 45.5),
    "blackwell": (0.0, 96.0, 80.0),
}
NVLS_EFFICIENCY = {"volta": 0.0, "ampere": 0.0, "hopper": 0.85, "blackwell": 0.74}
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}  # getNetOverhead; ×3 for Simple
# treeCorrectionFactor[protocol][log2(bytes / 64)], sizes 64 B .. 256 MiB
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0,
     1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9,
     1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9,
     .9, .9),
)  # fmt: skip

# --- from src/graph/topo.h, search.cc, transport/nvls.cc, collectives.h, init.cc -------------
NVLINK_BW_PER_LINK = {"volta": 20.0, "ampere": 20.0, "hopper": 20.6, "blackwell": 40.1}
PCI_BW = 12.0  # PCIe Gen3 x16, GB/s
NET_BW_PER_100GBIT = 12.0  # GB/s NCCL counts for a 100 Gb/s NIC (0.96 of the line rate)
SPEED_INTRA_MAX = {"volta": 40.0, "ampere": 40.0, "hopper": 60.0, "blackwell": 90.0}
SPEED_INTER_MAX = {"volta": 48.0, "ampere": 48.0, "hopper": 48.0, "blackwell": 96.0}
NVLS_CHANNELS = {"hopper": 16, "blackwell": 24}  # one node; Blackwell multi-node: 32
# Simple's pipeline granularity: one step is DEFAULT_BUFFSIZE 4 MiB (init.cc) / NCCL_STEPS 8
# (include/device.h); a ring moves slices of ALLREDUCE_SLICESTEPS = 2 steps (collectives.h), a
# tree chunks of one step (enqueue.cc calcCollChunking: chunkSteps = 1 off the ring)
SIMPLE_STEP_BYTES = (1 << 22) // 8
SIMPLE_SLICE_BYTES = SIMPLE_STEP_BYTES * 2
SIMPLE_CHUNK_BYTES = SIMPLE_STEP_BYTES * 4  # ALLREDUCE_CHUNKSTEPS = NCCL_STEPS / 2
# How many channels a message runs on (enqueue.cc topoGetAlgoInfo, lines 2071-2096): NCCL drops
# channels while nBytes < nc · nThreads · threadThreshold. Threads per protocol: device.h lines
# 95, 97, 114 (Simple and LL 512, LL128 640; a ring's Simple 256 where bwIntra · nChannels <=
# PCI_BW, tuning.cc line 244); thresholds: comm.h lines 49-51 (LL 8, LL128 8, Simple 64), the
# ring's LL one × nRanks (tuning.cc line 593).
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}
THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}
# What NCCL adds per network hop from its own plugins: ``props->latency = 0; // Not set`` in
# src/transport/net_ib/init.cc and net_socket.cc (graph->latencyInter is that value). A vendor
# plugin (aws-ofi-nccl for EFA) may set its own; the real hop cost has to be measured.
NCCL_NET_LATENCY_US = {"ib": 0.0, "roce": 0.0, "efa": 0.0, "tcp": 0.0}


@dataclass(frozen=True)
class Calibration:
    """The constants NCCL's model does not give, fitted globally (see the module docstring).

    Defaults: fitted by ``python benchmarks/fabric_validation.py --fit`` on the training rows
    listed in that script (``TRAIN_IDS``); the held-out rows were not used. ``net_latency_us``
    maps a network kind to NCCL's ``graph->latencyInter`` (µs per inter-node hop): ``efa``
    fitted to the p4de/p3dn 2-node small-message rows, ``ib`` and ``roce`` to the IB and RoCE
    runs' (NVIDIA/nccl#812, Nebius, GKE, OCI); ``tcp`` is not fitted (no published row): 50 µs,
    a kernel-socket round trip's order on a data-centre network, an assumption.
    ``proto_latency``: a factor per protocol on NCCL's base and intra-node latencies (not the
    network's); ``proto_bw``: a factor on LL's and LL128's bandwidth; ``launch_us_per_gpu``:
    what a process driving g GPUs (nccl-tests ``-g``) adds per extra GPU.
    """

    bw_efficiency: float = 0.926
    nvls_efficiency: float = 0.783
    fill_slices: float = 1.0
    latency_scale: float = 1.0
    net_latency_us: dict[str, float] = field(
        default_factory=lambda: {"ib": 6.2, "roce": 6.2, "efa": 1.8, "tcp": 50.0}
    )
    proto_latency: dict[str, float] = field(
        default_factory=lambda: {"LL": 1.121, "LL128": 0.67, "Simple": 2.071}
    )
    proto_bw: dict[str, float] = field(default_factory=lambda: {"LL": 0.289, "LL128": 0.286})
    launch_us_per_gpu: float = 3.667

    def __post_init__(self) -> None:
        for name, top in (("bw_efficiency", 2), ("nvls_efficiency", 2), ("latency_scale", 1e3)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= top):
                raise ValueError(f"{name} must be a number in (0, {top}], got {v!r}")
        if not (isinstance(self.fill_slices, (int, float)) and 0 <= self.fill_slices < 1e3):
            raise ValueError(f"fill_slices must be a number in [0, 1000), got {self.fill_slices!r}")
        for k, v in self.net_latency_us.items():
            if not (isinstance(v, (int, float)) and 0 <= v < 1e6):
                raise ValueError(f"net_latency_us[{k!r}] must be >= 0 µs, got {v!r}")
        for name in ("proto_latency", "proto_bw"):
            for k, v in getattr(self, name).items():
                if k not in PROTOCOLS or not (isinstance(v, (int, float)) and 0 < v <= 100):
                    raise ValueError(f"{name}[{k!r}] must be a protocol's factor in (0, 100]")
        if not (isinstance(self.launch_us_per_gpu, (int, float)) and self.launch_us_per_gpu >= 0):
            raise ValueError(f"launch_us_per_gpu must be >= 0, got {self.launch_us_per_gpu!r}")

    def with_(self, **kw) -> Calibration:
        return replace(self, **kw)

    def __hash__(self) -> int:
        return hash(
            (self.bw_efficiency, self.nvls_efficiency, self.fill_slices, self.latency_scale,
             tuple(sorted(self.net_latency_us.items())), tuple(sorted(self.proto_latency.items())),
             tuple(sorted(self.proto_bw.items())), self.launch_us_per_gpu)
        )  # fmt: skip


DEFAULT_CALIBRATION = Calibration()


@dataclass(frozen=True)
class Topology:
    """What NCCL's tuner knows about a cluster, reduced to the numbers its model uses.

    ``intra_bw``: GB/s one GPU can push to its node-mates (sum over NVLinks, or PCIe);
    ``net_bw``: GB/s the node's NICs move, one way, summed; ``nic_bw``: one NIC's; ``intra_hw``:
    ``nvlink`` or ``pci`` (NCCL's hardware class for the intra-node latency); ``nvswitch``:
    NVLS needs NVLink SHARP in the switch (Hopper and later); ``net``: the network kind, for
    the calibrated inter-node hop latency; ``protocols``: those the network allows (as
    ``NCCL_PROTO`` would restrict them).
    """

    gen: str
    ppn: int
    nodes: int
    intra_bw: float
    intra_hw: str = "nvlink"
    nvswitch: bool = True
    net_bw: float = 0.0
    nic_bw: float = 0.0
    net: str = "ib"
    cpu: str = "intel"
    launch_gpus: int = 1
    protocols: tuple[str, ...] = PROTOCOLS
    calibration: Calibration = DEFAULT_CALIBRATION

    @property
    def nranks(self) -> int:
        return self.ppn * self.nodes

    @cached_property
    def table(self) -> dict[tuple[str, str], tuple[float, float, float]]:
        """(algorithm, protocol) → (latency µs, algorithm bandwidth GB/s, one channel's GB/s)
        for every pair NCCL would enable here."""
        return _tune(self)

    def available(self) -> tuple[str, ...]:
        return tuple(a for a in ALGORITHMS if any(k[0] == a for k in self.table))

    def time_us(self, nbytes: float, algorithm: str, protocol: str) -> float:
        """Predicted µs of one all-reduce of ``nbytes`` with this algorithm and protocol."""
        lat, bw, ch_bw = self.table[(algorithm, protocol)]
        p = PROTOCOLS.index(protocol)
        n, run = self.nranks, self.runtime_channels
        used = run
        if algorithm in ("ring", "tree"):
            # a small message runs on fewer channels, each with a bigger share to pipeline
            used = self.channels_used(nbytes, algorithm, protocol)
            ch_bw *= _channels(self, algorithm)[0] / run  # a launched channel's speed
        log_size = int(math.log2(nbytes // 64)) if nbytes >= 64 else -1
        if algorithm == "tree" and 0 <= log_size < 23:
            bw *= TREE_CORRECTION[p][log_size]
        plateau = nbytes / (run * n) >= 64
        if algorithm == "ring" and protocol == "Simple" and self.nodes > 1 and plateau:
            lat *= 1.9 if self.gen == "volta" else 1.4  # the ring's "plateau effect"
        t = lat + nbytes / (1e3 * bw)
        if protocol == "Simple" and self.calibration.fill_slices:
            # pipeline fill: the first chunk crosses the pipeline before it streams
            if algorithm == "tree":  # one step's chunk, or the channel's whole share
                piece = min(nbytes / used, SIMPLE_STEP_BYTES)
                slower = run / _channels(self, "tree")[0]
                t += self.calibration.fill_slices * piece * self._tree_fill_us_per_byte * slower
            elif algorithm == "ring":
                # a channel's share, cut in nRanks chunks when under one loop (all_reduce.h
                # line 38), each sent as two slices of at least 1/32 of a full one
                # (prims_simple.h lines 183-184)
                chunk = min(SIMPLE_CHUNK_BYTES, nbytes / used / n)
                piece = max(chunk / 2, SIMPLE_SLICE_BYTES / 32)
                t += self.calibration.fill_slices * piece / (1e3 * ch_bw)
            else:
                piece = min(nbytes / self._ring_channels, SIMPLE_SLICE_BYTES)
                t += self.calibration.fill_slices * piece / (1e3 * ch_bw)
        return t

    def best(self, nbytes: float, algorithm: str = "auto") -> tuple[str, str, float]:
        """The fastest (algorithm, protocol, µs); ``algorithm`` limits the choice to one."""
        best: tuple[str, str, float] | None = None
        for a, p in self.table:
            if algorithm != "auto" and a != algorithm:
                continue
            t = self.time_us(nbytes, a, p)
            if best is None or t < best[2]:
                best = (a, p, t)
        if best is None:
            raise ValueError(
                f"algorithm {algorithm!r} is not available on this fabric; "
                f"available: {', '.join(self.available())}"
            )
        return best

    @cached_property
    def _tree_fill_us_per_byte(self) -> float:
        """µs per byte of chunk for the tree's pipeline fill: a chunk climbs
        the tree and comes back down before the tree streams, 2·((ppn−1) + log2(nodes)) hops,
        the hops of NCCL's own tree latency (tuning.cc); the ppn−1 chain hops inside a node at
        one channel's NVLink (or PCI) speed, the log2(nodes) network hops at one channel's
        network speed."""
        nch = _channels(self, "tree")[0]
        ch_bw = self.table[("tree", "Simple")][2]
        intra_ch = self.intra_bw / nch * self.calibration.bw_efficiency
        return 2 * ((self.ppn - 1) / intra_ch + _log2i(self.nodes) / ch_bw) / 1e3

    def channels_used(self, nbytes: float, algorithm: str, protocol: str) -> int:
        """Channels NCCL runs an all-reduce of ``nbytes`` on, with this ring or tree protocol
        (:data:`THREAD_THRESHOLD`), out of :attr:`runtime_channels`: a ring's LL needs 4 KiB
        per rank per channel, so 16 ranks fill 24 channels only from 1.5 MiB; Simple 32 KiB
        per channel, LL128 5 KiB."""
        nc = self.runtime_channels
        nt, thr = MAX_THREADS[protocol], THREAD_THRESHOLD[protocol]
        if algorithm == "ring" and protocol == "LL":
            thr *= self.nranks
        if algorithm == "ring" and protocol == "Simple" and _sum_bw(self, "ring") <= PCI_BW:
            nt = 256
        return max(1, min(nc, int(nbytes // (nt * thr))))

    @cached_property
    def runtime_channels(self) -> int:
        """Channels NCCL launches for ring and tree (``comm->nChannels``): the search's (the
        fewer of ring and tree, init.cc line 1459) doubled (connect.cc ncclTopoPostset, line
        460, up to MAXCHANNELS 64), and doubled again below 16 on Hopper and later across nodes
        when a ring channel runs above 45 GB/s (line 481). Each runs at its share of the
        search channels' speed."""
        nc, speed = _channels(self, "ring")
        run = min(64, 2 * min(nc, _channels(self, "tree")[0]))
        if GENERATIONS.index(self.gen) >= 2 and self.nodes > 1 and speed > 45 and run < 16:
            run *= 2
        return run

    @cached_property
    def _ring_channels(self) -> int:
        return _channels(self, "ring")[0]


@dataclass(frozen=True)
class NcclModel:
    """NCCL's cost model (:class:`~dplab.sim.nccl_model.Topology`) in seconds."""

    topology: Topology

    def available(self) -> tuple[str, ...]:
        return self.topology.available()

    def best_s(self, nbytes: float, algorithm: str = "auto") -> tuple[str, str, float]:
        """The fastest (algorithm, protocol, seconds); ``algorithm`` limits the choice."""
        if self.topology.nranks == 1 or nbytes == 0:
            return ("ring" if algorithm == "auto" else algorithm, "Simple", 0.0)
        a, p, us = self.topology.best(nbytes, algorithm)
        return a, p, us * 1e-6


def _channels(t: Topology, algo: str) -> tuple[int, float]:
    """Channel count and per-channel GB/s NCCL's search ends with (approximated).

    The search starts at the first speed of its array (``speedArrayIntra/Inter``), packs as
    many channels as the links carry, and ``ncclTopoDupChannels`` doubles them at half speed
    when a channel runs at 25 GB/s or more. One NIC carries a whole channel, so multi-node
    channels run at most at one NIC's speed.
    """
    total = _sum_bw(t, algo)
    if t.nodes == 1:
        speed = min(SPEED_INTRA_MAX[t.gen], t.intra_bw)
    else:
        speed = min(
            SPEED_INTER_MAX[t.gen], t.nic_bw * (2 if algo == "tree" and t.nodes <= 2 else 1)
        )
    n = max(1, int(total // speed)) if speed > 0 else 1
    if speed >= 25 and not (t.gen != "volta" and t.gen != "ampere" and speed < 50 and n > 4):
        n, speed = 2 * n, speed / 2
    return n, total / n


def _sum_bw(t: Topology, algo: str) -> float:
    """nChannels × bw: what all channels of this algorithm's graph move, GB/s."""
    if t.nodes == 1:
        return t.intra_bw
    net = t.net_bw * (2 if algo in ("tree", "nvlstree") and t.nodes <= 2 else 1)
    return min(t.intra_bw, net)


def _tune(t: Topology) -> dict[tuple[str, str], tuple[float, float, float]]:
    cal = t.calibration
    n, nodes, ppn = t.nranks, t.nodes, t.ppn
    idx2 = min(nodes, 3) - 1
    gi = GENERATIONS.index(t.gen)
    ll_max = LL_MAX_BW[gi][idx2] if nodes == 1 else LL_MAX_BW[0 if t.cpu == "intel" else 1][idx2]
    nsteps = 2 * (n - 1)
    net_lat = cal.net_latency_us.get(t.net, 0.0)
    nvls_ok = t.nvswitch and t.intra_hw == "nvlink" and NVLS_EFFICIENCY[t.gen] > 0 and ppn > 1
    out: dict[tuple[str, str], tuple[float, float, float]] = {}
    if n <= 1:
        return {(a, p): (0.0, math.inf, math.inf) for a in ("ring",) for p in PROTOCOLS}
    for a in ALGORITHMS:
        if a == "nvls" and (not nvls_ok or nodes > 1):  # multi-node NVLS needs CollNet
            continue
        if a == "nvlstree" and (not nvls_ok or nodes == 1):
            continue
        nch, ch_bw = _channels(t, a)
        for pi, p in enumerate(PROTOCOLS):
            if (a in ("nvls", "nvlstree") and p != "Simple") or p not in t.protocols:
                continue
            if p == "LL128" and t.intra_hw != "nvlink":
                continue  # LL128 is enabled only up to NVLink-class intra paths
            if a in ("nvls", "nvlstree"):
                nvch = NVLS_CHANNELS.get(t.gen, 16) if nodes == 1 else 32 if gi >= 3 else 16
                intra = t.intra_bw * NVLS_EFFICIENCY[t.gen] * (nvch - 1) / nvch * 2
                bus = intra
                if nodes > 1:
                    cap = PER_CH_NVLSTREE_BW[t.gen][idx2] * nvch
                    bus = min(intra, t.net_bw * (2 if nodes <= 2 else 1), cap)
                bus *= cal.nvls_efficiency
                ch_bw = bus / nvch
            else:
                bus = _sum_bw(t, a)
                if a == "ring" and p == "LL":
                    bus = min(ll_max, bus * 0.5)
                if a == "ring" and p == "LL128":
                    bus = min(bus * 0.92, nch * PER_CH_RING_LL128_BW[t.gen][idx2])
                if a == "tree":
                    bus = min(bus * 0.92, nch * PER_CH_TREE_BW[t.gen][idx2])
                    if p == "LL":
                        bus = min(bus / 3.8, ll_max)
                    if p == "LL128":
                        f = 7.0 / 9.0 if nodes == 1 else 120.0 / 128.0
                        bus = min(bus * f, nch * PER_CH_TREE_LL128_BW[t.gen][idx2])
                bus *= cal.bw_efficiency * cal.proto_bw.get(p, 1.0)
            algbw = bus * (n / nsteps if a != "tree" else 0.5)
            intra_lat = HW_LATENCY_US[t.intra_hw][a][pi]
            inter_lat = HW_LATENCY_US["net"]["tree" if ppn == 1 else a][pi] + net_lat
            if p == "Simple":
                inter_lat += net_lat  # the flush
            lat = BASE_LATENCY_US[a][pi]
            if a == "ring":
                if nodes == 1:
                    lat += nsteps * intra_lat
                else:
                    over = NET_OVERHEAD_US[t.cpu] * (3 if p == "Simple" else 1)
                    inter_steps = 2 * (nodes - 1)
                    lat += (nsteps - inter_steps) * max(intra_lat, over) + inter_steps * inter_lat
            elif a == "tree":
                lat += 2 * ((ppn - 1) * intra_lat + _log2i(nodes) * inter_lat)
            elif a == "nvls":
                lat = intra_lat
            else:
                lat += intra_lat + 2 * _log2i(nodes) * inter_lat
            net_part = _net_part(t, a, inter_lat)
            if a in ("ring", "tree"):  # NVLS has its own latency, not a protocol's
                lat = (lat - net_part) * cal.proto_latency.get(p, 1.0) + net_part
            lat += cal.launch_us_per_gpu * (t.launch_gpus - 1)
            out[(a, p)] = (
                lat * cal.latency_scale,
                algbw,
                ch_bw * cal.bw_efficiency if a in ("ring", "tree") else ch_bw,
            )
    return out


def _net_part(t: Topology, a: str, inter_lat: float) -> float:
    """The µs of an algorithm's latency spent on network hops (NCCL's per-hop network latency
    plus the fitted ``latencyInter``): the network has its own constant, so a protocol's
    latency factor, fitted on one node, leaves it alone."""
    if t.nodes == 1 or a == "nvls":
        return 0.0
    if a == "ring":
        return 2 * (t.nodes - 1) * inter_lat
    return 2 * _log2i(t.nodes) * inter_lat


def _log2i(n: int) -> int:
    return max(0, int(n).bit_length() - 1)
