"""Small helpers every §3 rank function shares: who am I, my shard, flat views, a weights hash."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def as_dtype(dtype: Any) -> torch.dtype:
    """``"float32"``/``"float64"`` or the torch dtype itself (strings read better in a cell)."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` outside a process group (one process is world size 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of a global batch (the first dimension).

    Equal shards only: with unequal shards the average of per-rank means would weight samples
    unequally and no longer be the global-batch mean.
    """
    n = t.shape[0]
    if n % world_size:
        raise ValueError(
            f"a global batch of {n} does not split evenly over world_size={world_size}"
        )
    size = n // world_size
    return t[rank * size : (rank + 1) * size]


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter, flattened and concatenated (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def flat_grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's ``.grad``, flattened and concatenated (a copy; zeros where None)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
            for p in model.parameters()
        ]
    ).clone()


def params_hash(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order: equal hashes mean bit-for-bit equal replicas.

    A hash, not an ``allclose``: "synchronised" here means identical bits, and a hash is what two
    machines can compare without shipping the weights.
    """
    return tensor_hash(*model.parameters())


def tensor_hash(*tensors: torch.Tensor) -> str:
    """SHA-256 of the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise |a - b|, computed in float64."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.double() - b.double()).abs().max().item()


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of floats at |t| (one unit in the last place), elementwise, in t's dtype."""
    a = t.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a
