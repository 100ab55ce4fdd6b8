"""Where data parallelism sits in 3D parallelism: rank layout and how often each axis syncs.

A 3D-parallel job splits ``tp × pp × dp`` GPUs three ways. Tensor parallelism (TP) splits
every layer's matrices and all-reduces activations inside every layer; pipeline parallelism
(PP) splits the layers into stages that pass activations (and, going back, their gradients)
once per micro-batch; data parallelism (DP) replicates the whole TP × PP model and all-reduces
the gradients once per optimizer step. Ranks are numbered TP fastest, then PP, then DP (DP
outermost, as Megatron-LM's ``order="tp-pp-dp"`` does), so a TP group is consecutive ranks on
one node and a DP group's members sit a whole replica apart.

The counts are per GPU and per optimizer step, for a Megatron-style transformer layer: two
all-reduces in its forward (after attention, after the MLP) and two in its backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from dplab._checks import check_positive_int

AXES = ("tp", "pp", "dp")
TP_ALLREDUCES_PER_LAYER = 4  # forward: after attention and after the MLP; backward: the same two


@dataclass(frozen=True)
class Layout3D:
    """``tp × pp × dp`` ranks on nodes of ``gpus_per_node`` GPUs, TP fastest, DP outermost."""

    tp: int
    pp: int
    dp: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in (*AXES, "gpus_per_node"):
            check_positive_int(name, getattr(self, name))
        if self.gpus_per_node % self.tp:
            raise ValueError(
                f"tp={self.tp} must divide gpus_per_node={self.gpus_per_node}: a TP group talks "
                "inside every layer and has to stay on one node's NVLink"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    def coords(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s position on each axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        tp, rest = rank % self.tp, rank // self.tp
        return {"tp": tp, "pp": rest % self.pp, "dp": rest // self.pp}

    def rank(self, tp: int, pp: int, dp: int) -> int:
        return tp + self.tp * (pp + self.pp * dp)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def groups(self, axis: str) -> list[list[int]]:
        """The ranks that talk to each other along ``axis``: one list per group."""
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        size = {"tp": self.tp, "pp": self.pp, "dp": self.dp}[axis]
        out: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(v for k, v in c.items() if k != axis)
            out.setdefault(key, []).append(r)
        assert all(len(g) == size for g in out.values())
        return list(out.values())

    def nodes_spanned(self, axis: str) -> int:
        """The most nodes any one group of ``axis`` spans: 1 means it stays on NVLink."""
        return max(len({self.node_of(r) for r in g}) for g in self.groups(axis))

    def syncs_per_step(self, layers: int, micro_batches: int) -> dict[str, int]:
        """Blocking synchronisations one GPU takes part in per optimizer step, per axis.

        TP: every layer of its stage, every micro-batch, 4 all-reduces (none if tp = 1). PP: a
        stage boundary passes activations forward and their gradients back once per
        micro-batch, and a middle stage has two boundaries (none if pp = 1). DP: one gradient
        all-reduce per step (cut into buckets that overlap backward; none if dp = 1). For the
        busiest GPU: a middle stage when there is one.
        """
        check_positive_int("layers", layers)
        check_positive_int("micro_batches", micro_batches)
        if layers % self.pp:
            raise ValueError(f"pp={self.pp} stages must split layers={layers} evenly")
        per_stage = layers // self.pp
        return {
            "tp": TP_ALLREDUCES_PER_LAYER * per_stage * micro_batches if self.tp > 1 else 0,
            "pp": 2 * micro_batches * min(2, self.pp - 1),
            "dp": 1 if self.dp > 1 else 0,
        }
