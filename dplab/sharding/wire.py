"""Bytes on the wire per step: count the collectives a sharded step makes, then price them.

:class:`dplab.mechanics.traffic.CommCounter` stands at ``torch.distributed``'s door and notes
every payload. FSDP2 calls two doors it does not watch, ``all_gather_single`` and
``reduce_scatter_single`` (torch >= 2.10; older FSDP2 calls ``all_gather_into_tensor`` and
``reduce_scatter_tensor``, which it does), so :class:`ShardedCommCounter` watches those too.

A payload is not a wire figure. :func:`wire_bytes` turns the records into what one rank sends
with ring algorithms (NCCL's): all-reduce 2(N-1)/N of the tensor, all-gather and reduce-scatter
(N-1)/N each. Gloo has no reduce-scatter of its own: it runs a full all-reduce and keeps its
chunk (``torch.profiler`` shows a ``gloo:all_reduce`` per reduce-scatter), so on gloo a
reduce-scatter sends twice what NCCL's does; ``backend="gloo"`` prices it that way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dplab.mechanics.traffic import PAYLOAD_ARG, CommCounter
from dplab.sharding.formula import wire_factor

SHARDED_PAYLOAD_ARG = {
    **PAYLOAD_ARG,
    "all_gather_single": "input_tensor",
    "reduce_scatter_single": "input",
}
# counter op → the collective it is, by its textbook name
KIND = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
}
# How many times this rank's payload the full tensor is: an all-gather is handed its shard.
GATHERS = {"all_gather", "all_gather_into_tensor", "all_gather_single"}


class ShardedCommCounter(CommCounter):
    """:class:`CommCounter` that also sees FSDP2's ``*_single`` collectives."""

    payload_args = SHARDED_PAYLOAD_ARG


@dataclass(frozen=True)
class WireRow:
    """One collective kind in one phase of a step on one rank: calls, full-tensor bytes, and
    what the rank sends for them with ring algorithms (``nccl_bytes``) and on gloo."""

    phase: str
    op: str
    calls: int
    tensor_bytes: int
    nccl_bytes: float
    gloo_bytes: float


def wire_rows(records: list[dict[str, Any]], world_size: int) -> list[WireRow]:
    """Group counter records (``CommCounter.to_dicts()``) by phase and collective and price them.

    ``tensor_bytes`` is the full tensor each call moves (an all-gather's payload is one shard of
    it, so it is multiplied by N). Barriers and the like carry no bytes and are left out.
    """
    rows: dict[tuple[str, str], list[int]] = {}
    for r in records:
        kind = KIND.get(r["op"])
        if kind is None:
            continue
        full = r["nbytes"] * (world_size if r["op"] in GATHERS else 1)
        calls_bytes = rows.setdefault((r["phase"], kind), [0, 0])
        calls_bytes[0] += 1
        calls_bytes[1] += full
    out = []
    for (phase, op), (calls, full) in rows.items():
        nccl = full * wire_factor(op, world_size)
        gloo_op = "all_reduce" if op == "reduce_scatter" else op  # gloo emulates it
        out.append(WireRow(phase, op, calls, full, nccl, full * wire_factor(gloo_op, world_size)))
    return out


def total_wire_bytes(rows: list[WireRow], backend: str = "nccl") -> float:
    """What one rank sends in a step, with NCCL's ring algorithms or on gloo."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    return sum(r.nccl_bytes if backend == "nccl" else r.gloo_bytes for r in rows)
