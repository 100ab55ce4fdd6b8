"""Two measured α-β levels: a cluster timed by what was measured on it, not by NCCL's constants.

For clusters with no NCCL constants to borrow (gloo ranks in network namespaces joined by a
shaped link, §8d): ranks inside a node talk over loopback, nodes over a link, each level one
latency α and one cost per byte β, measured. :class:`Levels` holds the four numbers,
:class:`LevelsModel` is the cost model :class:`dplab.sim.Fabric` asks for a time when built with
:meth:`dplab.sim.Fabric.from_levels`.
"""

from __future__ import annotations

from dataclasses import dataclass


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
class LevelsModel:
    """The measured-levels cost model of a cluster shape: what :class:`Fabric` asks it."""

    levels: Levels
    ppn: int
    nodes: int

    def available(self) -> tuple[str, ...]:
        return ("ring", "tree")

    def best_s(self, nbytes: float, algorithm: str = "auto") -> tuple[str, str, float]:
        """The fastest (algorithm, "measured", seconds); ``algorithm`` limits the choice."""
        if algorithm not in ("auto", *self.available()):
            raise ValueError(
                f"algorithm {algorithm!r} is not available here: measured levels have ring and tree"
            )
        opts = self.available() if algorithm == "auto" else (algorithm,)
        times = {a: self.levels.time_s(nbytes, self.ppn, self.nodes, a) for a in opts}
        best = min(times, key=times.__getitem__)
        return best, "measured", times[best]
