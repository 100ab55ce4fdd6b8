"""Replicas start equal and stay equal: rank 0's values, broadcast.

DDP averages gradients, so replicas that start equal take equal steps and stay equal. Two things
make them start (and stay) equal: every rank must hold the same parameters, checked at
construction, and rank 0's parameters and buffers are broadcast to every rank then, its buffers
(BatchNorm statistics) again before each forward that follows a synchronising one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def broadcast_from(tensors: list[torch.Tensor], src: int, group: Any) -> None:
    """Make every rank's ``tensors`` hold rank ``src``'s values (one broadcast per dtype/device).

    Like torch's ``_broadcast_coalesced`` under ``_sync_buffers``, the copy back is invisible to
    autograd: it keeps the tensors' version counters, so a BatchNorm forward that saved
    ``running_mean`` before this broadcast (two forwards, one backward: SimCLR, BYOL, triplet
    losses) still has a valid graph."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for same in groups.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(same)):
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def check_same_parameters(named: list[tuple[str, nn.Parameter]], group: Any) -> None:
    """Every rank must hold the same parameters, or the all-reduces would mix up tensors."""
    mine = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in named]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for i in range(max(len(reference), len(theirs))):
            a = reference[i] if i < len(reference) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                raise ValueError(
                    f"parameters differ across ranks at position {i}: rank 0 has "
                    f"{_describe(a)} but rank {rank} has {_describe(b)}"
                )


def _describe(entry: Any) -> str:
    if entry is None:
        return "no parameter there"
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad else ", frozen"
    return f"{name!r} {list(shape)} {dtype}{frozen}"
