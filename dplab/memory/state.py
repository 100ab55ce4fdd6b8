"""Model-state bytes per rank: plain data parallelism against the ZeRO stages.

Data parallelism shards the *batch*. Every rank still holds every parameter's weights, gradients,
master copy and optimizer statistics, so the bytes per rank do not depend on the world size at
all: adding ranks adds identical copies. ZeRO (Rajbhandari et al. 2020) removes the copies one
part at a time. With Ψ parameters, N ranks and the recipe's bytes per parameter
(weights w, grads g, optimizer side K = master + statistics):

=======  ==================================  ==================
stage    per rank                            paper's name
=======  ==================================  ==================
0        (w + g + K)·Ψ                       baseline DP
1        (w + g)·Ψ + K·Ψ/N                   P_os
2        w·Ψ + (g + K)·Ψ/N                   P_os+g
3        (w + g + K)·Ψ/N                     P_os+g+p
=======  ==================================  ==================

A sharded part holds ⌈Ψ/N⌉ parameters per rank (ZeRO pads the flat buffer to a multiple of N),
so the result is an integer number of bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

from dplab._checks import check_world_size
from dplab.memory.recipes import PARTS, bytes_per_param

ZERO_STAGES = (0, 1, 2, 3)
# the first stage that shards each part
SHARDED_FROM = {"master_weights": 1, "optimizer_state": 1, "grads": 2, "weights": 3}

STAGE_LABELS = {0: "plain DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def check_n_params(n_params: object) -> int:
    """A parameter count is a whole number ≥ 1 (``7e9`` is accepted: it is whole)."""
    if isinstance(n_params, bool) or not isinstance(n_params, Real):
        raise ValueError(f"n_params must be a positive whole number, got {n_params!r}")
    if not math.isfinite(n_params) or n_params < 1 or n_params != int(n_params):
        raise ValueError(f"n_params must be a positive whole number, got {n_params!r}")
    return int(n_params)


def check_zero_stage(zero_stage: object) -> int:
    """ZeRO stages are 0 (plain DP), 1, 2 and 3."""
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {zero_stage!r}")
    return int(zero_stage)


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes one rank holds, by part (weights, grads, master, optimizer)."""

    n_params: int
    world_size: int
    zero_stage: int
    precision: str
    optimizer: str
    weights: int
    grads: int
    master_weights: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master_weights + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        return {part: getattr(self, part) for part in PARTS}


def state_bytes(
    n_params: int,
    *,
    world_size: int = 1,
    zero_stage: int = 0,
    precision: str = "mixed",
    optimizer: str = "adam",
) -> StateBytes:
    """Per-rank model state, part by part (see the module docstring for the accounting)."""
    n = check_n_params(n_params)
    world = check_world_size(world_size)
    stage = check_zero_stage(zero_stage)
    per_param = bytes_per_param(precision, optimizer)
    shard = math.ceil(n / world)
    parts = {
        part: (shard if stage >= SHARDED_FROM[part] else n) * getattr(per_param, part)
        for part in PARTS
    }
    return StateBytes(
        n_params=n,
        world_size=world,
        zero_stage=stage,
        precision=precision,
        optimizer=optimizer,
        **parts,
    )


def model_state_bytes(
    n_params: int,
    *,
    world_size: int = 1,
    zero_stage: int = 0,
    precision: str = "mixed",
    optimizer: str = "adam",
) -> int:
    """Bytes of model state on each rank, with the ZeRO paper's accounting.

    >>> model_state_bytes(7e9) / 1e9                     # the memory wall: 7B × 16 B
    112.0
    >>> model_state_bytes(7.5e9, world_size=64, zero_stage=1) / 1e9   # ZeRO Figure 1, P_os
    31.40625
    """
    return state_bytes(
        n_params,
        world_size=world_size,
        zero_stage=zero_stage,
        precision=precision,
        optimizer=optimizer,
    ).total
