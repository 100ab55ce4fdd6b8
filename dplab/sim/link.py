"""Links: what one all-reduce costs by the α-β model of one flat ring (the teaching model).

For a GPU cluster use :class:`dplab.sim.Fabric` instead: it knows nodes, NVLink, NICs and
NCCL's algorithms and is validated against published nccl-tests runs
(``docs/fabric-validation.md``). The flat-ring presets below are kept, labelled "flat ring
(teaching model)", because the lessons derive the ring's formula on them; at scale they are an
order of magnitude off (2 × AWS p5: 487 GB/s measured bus bandwidth, ``ib-400g`` says 50).
A Link remains the model of this machine's measured loopback (``gloo-loopback``).

A ring all-reduce of S bytes over N ranks takes 2(N−1) steps, each a message of S/N bytes:

    t = 2(N−1)·α + 2(N−1)/N · S / B

α is the per-step latency, B the bandwidth each rank's link moves data at, one way. For the
multi-GPU presets B is the **per-GPU bus bandwidth**: the rate at which one GPU's ring traffic
leaves it (nccl-tests' "busbw"), not a node's aggregate. A multi-node ring is as fast as its
slowest hop, the inter-node one, so on the network presets B is one NIC's line rate, assuming
one NIC per GPU (as on a DGX H100: 8 GPUs, 8 × 400 Gb/s). With k GPUs sharing a NIC, divide B
by k. The model is a flat ring: no trees, no NVLink SHARP, no hierarchy; at large N its
2(N−1)·α latency term is what makes NCCL switch to trees, so read big-N numbers as the ring's.

The presets and where their numbers come from:

- ``gloo-loopback``: this machine, two gloo ranks over 127.0.0.1. α and B are *measured*:
  fitted by :func:`dplab.collectives.fit_alpha_beta` to ``dist.all_reduce`` timings, read from
  ``assets/gloo_loopback_bandwidth.json`` (written by ``benchmarks/allreduce_bandwidth.py``,
  which records the machine, date and command).
- ``nvlink-h100``: one H100 SXM node. B = 450 GB/s: NVLink 4 gives each H100 SXM 900 GB/s
  *bidirectional* (NVIDIA H100 datasheet), 450 GB/s each way; a ring sends one way. α = 3.4 µs
  per ring step: the NVLink ring latency (Simple protocol) in NCCL's own cost model,
  ``hwLat`` in ``src/graph/tuning.cc``. A node has 8 GPUs; larger N is hypothetical.
- ``ib-400g``: NDR InfiniBand, 400 Gb/s = 50 GB/s per direction per NIC, one NIC per GPU.
  α = 9.6 µs per step: NCCL's network ring latency (Simple) in the same ``tuning.cc``.
- ``100gbe`` / ``25gbe``: Ethernet at 12.5 / 3.125 GB/s per direction, one NIC per rank, over
  TCP sockets. α = 25 µs is an assumption (kernel TCP small-message latency on a data-centre
  network is typically 10–30 µs), not a measurement.

Line rates are upper bounds: real busbw is lower (protocol overheads, NCCL's chunking), so
predictions on the presets are best cases; only ``gloo-loopback`` is a measured link.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dplab._checks import check_nonneg, check_positive, check_world_size
from dplab._units import GB
from dplab.collectives.cost import ring_time

TEACHING = "flat ring (teaching model)"
ASSETS = Path(__file__).resolve().parents[2] / "assets"
LOOPBACK_JSON = ASSETS / "gloo_loopback_bandwidth.json"
LOOPBACK_COMMAND = "python benchmarks/allreduce_bandwidth.py"


@dataclass(frozen=True)
class Link:
    """A fabric as the α-β model sees it.

    ``alpha_s``: seconds per ring step; ``bandwidth_Bps``: bytes per second one way per rank
    (per-GPU bus bandwidth); ``name`` and ``source`` say what it is and where the numbers came
    from. Build it from β (seconds per byte) with :meth:`from_beta`.
    """

    name: str
    alpha_s: float
    bandwidth_Bps: float
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a link needs a name, got {self.name!r}")
        object.__setattr__(self, "alpha_s", check_nonneg("alpha_s", self.alpha_s))
        object.__setattr__(
            self, "bandwidth_Bps", check_positive("bandwidth_Bps", self.bandwidth_Bps)
        )

    @classmethod
    def from_beta(cls, name: str, alpha_s: float, beta_s_per_byte: float, source: str = ""):
        """A link from α (s) and β (s/byte), as :func:`dplab.collectives.fit_alpha_beta` gives."""
        beta = check_positive("beta_s_per_byte", beta_s_per_byte)
        return cls(name, alpha_s, 1.0 / beta, source)

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bandwidth_Bps

    @property
    def bandwidth_GBps(self) -> float:
        return self.bandwidth_Bps / GB

    def allreduce_s(self, nbytes: float, world_size: int) -> float:
        """Seconds for a ring all-reduce of ``nbytes`` over ``world_size`` ranks."""
        n = check_world_size(world_size)
        return ring_time(nbytes, n, self.alpha_s, self.beta_s_per_byte)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bandwidth_GBps": self.bandwidth_GBps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Link:
        try:
            return cls(str(d["name"]), d["alpha_s"], d["bandwidth_Bps"], str(d.get("source", "")))
        except KeyError as e:
            raise ValueError(f"a link needs name, alpha_s and bandwidth_Bps; missing {e}") from e

    def describe(self) -> str:
        return (
            f"{self.name}: α = {self.alpha_s * 1e6:.3g} µs per step, "
            f"B = {self.bandwidth_GBps:.3g} GB/s per rank, one way"
            + (f" [{TEACHING}]" if self.source.startswith(TEACHING) else "")
        )


PRESETS: dict[str, Link] = {
    "nvlink-h100": Link(
        "nvlink-h100",
        3.4e-6,
        450 * GB,
        f"{TEACHING}: "
        "H100 SXM NVLink 4: 900 GB/s bidirectional per GPU (NVIDIA datasheet) = 450 GB/s one "
        "way; α = NCCL's NVLink ring step latency (hwLat, Simple) in src/graph/tuning.cc",
    ),
    "ib-400g": Link(
        "ib-400g",
        9.6e-6,
        50 * GB,
        f"{TEACHING}: "
        "NDR InfiniBand 400 Gb/s = 50 GB/s one way, one NIC per GPU; α = NCCL's network ring "
        "step latency (hwLat, Simple) in src/graph/tuning.cc",
    ),
    "100gbe": Link(
        "100gbe",
        25e-6,
        12.5 * GB,
        f"{TEACHING}: "
        "100 Gb/s Ethernet = 12.5 GB/s one way, one NIC per rank, TCP sockets; α = 25 µs is an "
        "assumed kernel-TCP latency, not a measurement",
    ),
    "25gbe": Link(
        "25gbe",
        25e-6,
        3.125 * GB,
        f"{TEACHING}: "
        "25 Gb/s Ethernet = 3.125 GB/s one way, one NIC per rank, TCP sockets; α = 25 µs is an "
        "assumed kernel-TCP latency, not a measurement",
    ),
}
LINK_NAMES = ("gloo-loopback", *PRESETS)


def loopback_link(path: str | Path = LOOPBACK_JSON) -> Link:
    """This machine's gloo loopback, from the α-β fit that the bandwidth bench saved."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"no measured loopback link at {p}: run `{LOOPBACK_COMMAND}` first "
            "(or build a Link from your own fit)"
        )
    report = json.loads(p.read_text())
    fit = report.get("link") if isinstance(report, dict) else None
    if not fit or "alpha_s" not in fit or "beta_s_per_byte" not in fit:
        raise ValueError(f"{p} has no 'link' with alpha_s and beta_s_per_byte")
    machine = report.get("machine", {})
    source = (
        f"measured: {p.name}, {fit.get('world_size', '?')} ranks, {report.get('backend', 'gloo')}"
        f" on {machine.get('cpu_model', 'this machine')}, {report.get('date', 'undated')}, "
        f"`{report.get('command', LOOPBACK_COMMAND)}`"
    )
    return Link.from_beta("gloo-loopback", fit["alpha_s"], fit["beta_s_per_byte"], source)


def get_link(name: str | Link) -> Link:
    """A preset by name (``gloo-loopback`` reads the measured fit), or a Link as is."""
    if isinstance(name, Link):
        return name
    if name == "gloo-loopback":
        return loopback_link()
    if name in PRESETS:
        return PRESETS[name]
    raise ValueError(f"unknown link {name!r}; choose from {', '.join(LINK_NAMES)}")
