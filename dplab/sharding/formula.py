"""What each sharding method should leave on a rank at rest, from the ZeRO paper's accounting.

The lesson measures fp32 AdamW (4 bytes of weight, 4 of gradient, 8 of Adam's two moments: 16
bytes per parameter, the same total as the paper's mixed-precision recipe but with no master
copy), so with Ψ parameters and N ranks, :func:`dplab.memory.state_bytes` gives per rank:

=============  ==================  ======================================================
method         ZeRO stage at rest  fp32 AdamW, per rank
=============  ==================  ======================================================
``ddp``        0                   16Ψ
``zero1``      1                   8Ψ + 8Ψ/N   (torch's ``ZeroRedundancyOptimizer``)
``zero2``      3 (at rest)         16Ψ/N       (FSDP2, ``reshard_after_forward=False``)
``zero3``      3                   16Ψ/N       (FSDP2, ``fully_shard``)
=============  ==================  ======================================================

Why ``zero2`` is stage 3 *at rest*: the paper's ZeRO-2 keeps the full weights on every rank
(4Ψ + 12Ψ/N). FSDP2 with ``reshard_after_forward=False`` is its nearest point but not the same
thing: it frees the gathered weights after backward like ZeRO-3 (so at rest it holds 16Ψ/N), and
keeps them gathered only from forward to the end of backward, which saves backward's all-gather.
The difference shows in the peak and on the wire, not at rest.
"""

from __future__ import annotations

from dplab._checks import check_world_size
from dplab.memory.state import StateBytes, state_bytes

METHODS = ("ddp", "zero1", "zero2", "zero3")
METHOD_LABELS = {
    "ddp": "DDP",
    "zero1": "ZeRO-1 (ZeroRedundancyOptimizer)",
    "zero2": "FSDP2, reshard_after_forward=False (ZeRO-2-like)",
    "zero3": "FSDP2 fully_shard (ZeRO-3)",
}
# the ZeRO stage whose accounting a method's at-rest state follows (see the module docstring)
STAGE_AT_REST = {"ddp": 0, "zero1": 1, "zero2": 3, "zero3": 3}
PRECISION, OPTIMIZER = "fp32", "adam"  # the recipe the lesson measures: fp32 AdamW


def check_method(method: object) -> str:
    """One of :data:`METHODS`, or a ValueError naming the bad value."""
    if isinstance(method, str) and method in METHODS:
        return method
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def expected_state(method: str, n_params: int, world_size: int) -> StateBytes:
    """The formula's per-rank model state for ``method`` (fp32 AdamW), part by part."""
    return state_bytes(
        n_params,
        world_size=check_world_size(world_size),
        zero_stage=STAGE_AT_REST[check_method(method)],
        precision=PRECISION,
        optimizer=OPTIMIZER,
    )


# Ring algorithms (NCCL's, and the textbook's): bytes one rank sends per byte of the full tensor.
def wire_factor(op: str, world_size: int) -> float:
    """Bytes a rank sends per byte of the *full* tensor, for a ring ``op`` over N ranks.

    all-reduce 2(N-1)/N; all-gather and reduce-scatter (N-1)/N each, so a reduce-scatter then an
    all-gather moves what one all-reduce does; a pipelined broadcast (N-1)/N on average.
    """
    n = check_world_size(world_size)
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": (n - 1) / n,
    }
    if op not in factors:
        raise ValueError(f"op must be one of {sorted(factors)}, got {op!r}")
    return factors[op]
