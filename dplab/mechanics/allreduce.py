"""§3.7: what the all-reduce computes, and the ring that computes it, on real ranks.

The gradient average needs one collective: every rank contributes a tensor and every rank gets
back the elementwise sum. :func:`all_reduce_demo` runs it twice on the same inputs, once as
``torch.distributed.all_reduce`` (gloo's own algorithm) and once as the ring built from
send/recv in :mod:`dplab.collectives`, and counts what each rank sent.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dplab._checks import check_positive_int
from dplab.collectives import ring_all_reduce
from dplab.mechanics._common import rank_and_world
from dplab.mechanics.traffic import CommCounter


def rank_tensor(rank: int, numel: int) -> torch.Tensor:
    """Rank r's input: 100·(r+1) + [0, 1, …]: whole numbers, so every sum is exact in float32
    and the result can be read off (each rank's share is visible in the hundreds)."""
    return 100.0 * (rank + 1) + torch.arange(numel, dtype=torch.float32)


def all_reduce_demo(numel: int = 8) -> dict[str, Any]:
    """Rank function: my input, ``dist.all_reduce``'s result, the ring's result, and the bytes
    the ring sent from this rank (from its own record and from a :class:`CommCounter`)."""
    check_positive_int("numel", numel)
    rank, n = rank_and_world()
    mine = rank_tensor(rank, numel)
    reference = mine.clone()
    dist.all_reduce(reference)
    ring = mine.clone()
    transfers: list = []
    with CommCounter() as counter:
        ring_all_reduce(ring, record=transfers)
    return {
        "rank": rank,
        "world_size": n,
        "input": mine.tolist(),
        "all_reduce": reference.tolist(),
        "ring": ring.tolist(),
        "tensor_bytes": mine.numel() * mine.element_size(),
        "ring_sent_bytes": sum(t.nbytes for t in transfers),
        "ring_messages": len(transfers),
        "counted_isend_bytes": counter.nbytes("isend"),
        "counted_irecv_bytes": counter.nbytes("irecv"),
        "transfers": [t.to_dict() for t in transfers],
    }
