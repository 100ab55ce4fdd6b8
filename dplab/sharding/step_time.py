"""Rank function: the step time of a sharded method, and nothing else on the clock.

:func:`~dplab.sharding.ranks.sharded_step` times its step while it walks every held tensor at
each saved activation (the peak) and counts every collective: right for bytes, far too slow for
time (on this GPT the walk is most of the step). :func:`timed_step` wraps the model the same way
(:func:`~dplab.sharding.ranks._wrap`, so DDP, ZeRO-1 and FSDP2 are the very same objects) and
times bare steps: forward, backward, optimizer, from a barrier to the end of ``opt.step()``.
This is the measurement :mod:`dplab.sim.sharded` is checked against.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from dplab.sharding.formula import check_method
from dplab.sharding.ranks import OPTIMIZERS, _wrap, rank_batch, sharded_model


def timed_step(
    method: str,
    *,
    steps: int = 6,
    warmup: int = 2,
    per_block: bool = True,
    optimizer: str = "adamw",
    group_size: int | None = None,
) -> list[float] | None:
    """Run on every rank: ``warmup`` + ``steps`` steps of ``method``; this rank's step times, ms.

    Each step starts at a barrier, so a step's time on the slowest rank is the step's time (the
    caller takes the max over ranks, step by step). ``group_size=n`` runs on the first ``n``
    ranks only (the others return ``None``), as :func:`~dplab.sharding.ranks.sharded_step` does.
    """
    method = check_method(method)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    for name, v, low in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = None
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise ValueError(f"group_size must be an int, got {group_size!r}")
        if not 1 <= group_size <= world:
            raise ValueError(f"group_size must be in 1..{world}, got {group_size!r}")
        group = dist.new_group(list(range(group_size)))  # every rank must take part in this call
        if rank >= group_size:
            return None
    wrapped, opt = _wrap(method, sharded_model(), OPTIMIZERS[optimizer], group, per_block)
    x, y = rank_batch(rank)
    times = []
    for _ in range(warmup + steps):
        opt.zero_grad(set_to_none=True)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        wrapped(x, y).backward()
        opt.step()
        times.append(1e3 * (time.perf_counter() - t0))
    return times[warmup:]
