"""Rank function: the compute of each wrapped unit, and what a collective costs, at this N.

:func:`dplab.sim.sharded.simulate_sharded` predicts a sharded step from two measured things, both
taken here on the same ranks that run :func:`~dplab.sharding.ranks.sharded_step`:

* **the compute per unit.** The GPT is cut as FSDP2 cuts it with ``per_block=True``: one unit
  per block, and the root (embeddings before the blocks; final norm, head and loss after). Plain
  module hooks time each block's forward and backward; the root's share is what is left of the
  step before the first block and after the last. Nothing is sharded or communicated in the
  timed steps, and every rank computes at once, so on a box whose ranks share cores the compute
  is as slow as it is in a real step;
* **the collectives at this world size:** ``all_reduce`` and ``all_gather_into_tensor`` of a
  few sizes, timed on the ranks, from which the simulator fits α and β for this machine, and
  two that gloo runs at a cost no such fit gives: ZeRO-1's burst of broadcasts and each FSDP2
  unit's all-gather, timed whole (see :func:`zero1_broadcast_ms`, :func:`_fsdp_gather_ms`).

It returns plain numbers (a dict per rank): ``dplab.sim`` reads them with
:func:`dplab.sim.sharded.unit_profile_from_ranks` and never imports this package.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from dplab.sharding.ranks import LR, _wrap, rank_batch, sharded_model

# all-reduce / all-gather sizes (bytes) for the α-β fit: from latency-bound to the whole model
COLLECTIVE_SIZES = (4096, 65536, 262144, 1048576)


def _block_hooks(model: Any, marks: dict[str, float]) -> list[Any]:
    """Stamp each block's forward and backward, start and end, into ``marks``."""
    handles = []
    for i, block in enumerate(model.blocks):

        def stamp(key: str) -> Any:
            return lambda *_: marks.__setitem__(key, time.perf_counter())

        handles += [
            block.register_forward_pre_hook(stamp(f"f{i}<")),
            block.register_forward_hook(stamp(f"f{i}>")),
            block.register_full_backward_pre_hook(stamp(f"b{i}<")),
            block.register_full_backward_hook(stamp(f"b{i}>")),
        ]
    return handles


def _timed_step(model: Any, opt: Any, x: Any, y: Any, group: Any) -> dict[str, float]:
    """One plain step (no communication), its moments in ms since forward began."""
    marks: dict[str, float] = {}
    handles = _block_hooks(model, marks)
    opt.zero_grad(set_to_none=True)
    dist.barrier(group=group)  # every rank computes at once, as in a real step
    t0 = time.perf_counter()
    loss = model(x, y)
    t_forward = time.perf_counter()
    loss.backward()
    t_backward = time.perf_counter()
    opt.step()
    t_end = time.perf_counter()
    for h in handles:
        h.remove()
    out = {k: 1e3 * (v - t0) for k, v in marks.items()}
    out.update(forward=1e3 * (t_forward - t0), backward=1e3 * (t_backward - t0))
    out["optimizer"] = 1e3 * (t_end - t_backward)
    return out


def _collective_ms(op: str, nbytes: int, world: int, group: Any, repeats: int) -> float:
    """Median ms of one ``op`` of ``nbytes`` (the full tensor) on ``group``."""
    numel = nbytes // 4
    full = torch.zeros(numel)
    shard = torch.zeros(numel // world)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        if op == "all_reduce":
            dist.all_reduce(full, group=group)
        else:
            dist.all_gather_into_tensor(full[: shard.numel() * world], shard, group=group)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def zero1_partition(params: list[Any], world: int) -> list[list[Any]]:
    """Each rank's parameters, as ``ZeroRedundancyOptimizer`` assigns them: largest first, each
    to the least loaded rank, in the order assigned (its step broadcasts them owner by owner in
    that order). The groups here are ranks 0..n-1, so an owner's group rank is its global rank.
    """
    loads: list[int] = [0] * world
    owned: list[list[Any]] = [[] for _ in range(world)]
    for p in sorted(params, key=lambda p: -p.numel()):
        owner = loads.index(min(loads))
        loads[owner] += p.numel()
        owned[owner].append(p)
    return owned


def _zero1_optimizer_ms(group: Any, world: int, repeats: int) -> float:
    """Median ms of ZeRO-1's AdamW step on the whole tensors this rank owns."""
    owned = zero1_partition(list(sharded_model().parameters()), world)[dist.get_rank(group)]
    opt = torch.optim.AdamW(owned, lr=LR)
    for p in owned:
        p.grad = torch.zeros_like(p)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        opt.step()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def zero1_broadcast_burst(params: list[Any], world: int, group: Any = None) -> None:
    """ZeRO-1's broadcasts after its step: every parameter from its owner, owner by owner,
    issued at once (``async_op=True``) and waited for together, as ``ZeroRedundancyOptimizer``
    issues them."""
    handles = [
        dist.broadcast(p.data, src=owner, group=group, async_op=True)
        for owner, owned in enumerate(zero1_partition(params, world))
        for p in owned
    ]
    for h in handles:
        h.wait()


def zero1_broadcast_ms(group: Any, world: int, repeats: int) -> float:
    """Median ms of :func:`zero1_broadcast_burst` on the GPT, a barrier before each.

    Timed whole, like the optimizer, because on gloo the burst is no sum of broadcasts timed
    alone (``benchmarks/zero1_broadcasts.py``), and an α-β fit of single broadcasts predicted
    it at about half its time."""
    params = list(sharded_model().parameters())
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        zero1_broadcast_burst(params, world, group)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _unit_gathers_ms(group: Any, repeats: int) -> list[float]:
    """Median ms of ``unshard()`` of each FSDP2 unit on ``group``, root first, then the blocks."""
    model, _ = _wrap("zero3", sharded_model(), torch.optim.AdamW, group, per_block=True)
    units = [model, *model.blocks]
    for unit in units:  # the first unshard also sets the unit up (lazy init, buffers)
        unit.unshard()
        unit.reshard()
    times: list[list[float]] = [[] for _ in units]
    for _ in range(repeats):
        for unit, unit_times in zip(units, times, strict=True):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            unit.unshard()
            unit_times.append(1e3 * (time.perf_counter() - t0))
            unit.reshard()
    return [statistics.median(t) for t in times]


def _fsdp_gather_ms(group: Any, alone: Any, repeats: int) -> list[float]:
    """Median ms of each FSDP2 unit's all-gather as FSDP2 runs it, root first, then the blocks:
    ``unshard()`` (the copy into the flat buffer, the gloo all-gather, the copy out into the
    parameters) on the real group, less the same on a group of this rank alone, whose work the
    wrapper's overhead (``alone_ms``) already holds.

    Timed per unit, like ZeRO-1's broadcasts, because on gloo it costs more than the α-β fit of
    a bare ``all_gather_into_tensor`` of the unit's bytes gives (1.2 to 2.7 times in
    ``benchmarks/sharded_vs_sim.py``'s runs on this machine)."""
    real = _unit_gathers_ms(group, repeats)
    own = _unit_gathers_ms(alone, repeats)
    return [max(0.0, r - o) for r, o in zip(real, own, strict=True)]


def _alone_ms(method: str, alone: Any, group: Any, repeats: int) -> float:
    """Median ms of a whole ``method`` step on a group of this rank alone, while the other ranks
    do the same: the wrapper's own work (hooks, copies in and out of the flat buffers, DTensor
    dispatch) under the same sharing of cores, with collectives that have no peer to wait for."""
    wrapped, opt = _wrap(method, sharded_model(), torch.optim.AdamW, alone, per_block=True)
    x, y = rank_batch(dist.get_rank())
    times = []
    for _ in range(repeats + 1):
        opt.zero_grad(set_to_none=True)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        wrapped(x, y).backward()
        opt.step()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times[1:])


def unit_profile(
    *, steps: int = 6, warmup: int = 2, repeats: int = 7, group_size: int | None = None
) -> dict[str, Any] | None:
    """Run on every rank: time ``steps`` plain AdamW steps unit by unit, then the collectives.

    Returns this rank's raw data: ``steps`` (per step, ms since forward began: ``f{i}<``,
    ``f{i}>``, ``b{i}<``, ``b{i}>`` for block ``i``, and ``forward``, ``backward``,
    ``optimizer``), ``unit_bytes`` (the root's and each block's fp32 weight bytes, root first),
    ``tensor_bytes`` (every parameter's), ``collectives`` (``(op, bytes, ms)``),
    ``optimizer_ms`` (ZeRO-1's own optimizer step on its share), ``zero1_broadcast_ms`` (the
    broadcasts after it, None on one rank), ``gather_ms`` (each FSDP2 unit's all-gather, root
    first, None on one rank) and ``alone_ms`` (DDP's, ZeRO-2's and ZeRO-3's whole
    step on a group of this rank alone: the wrapper's own work).
    ``group_size=n`` runs on the first ``n`` ranks only, as :func:`sharded_step` does.
    """
    for name, v, low in (("steps", steps, 1), ("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    # a group of each rank alone; every rank must take part in creating each one
    alone = [dist.new_group([r]) for r in range(world)][rank]
    group = None
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise ValueError(f"group_size must be an int, got {group_size!r}")
        if not 1 <= group_size <= world:
            raise ValueError(f"group_size must be in 1..{world}, got {group_size!r}")
        group = dist.new_group(list(range(group_size)))  # every rank must take part in this call
        if rank >= group_size:
            return None
        world = group_size
    model = sharded_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = rank_batch(rank)
    timed = [_timed_step(model, opt, x, y, group) for _ in range(warmup + steps)][warmup:]
    block_bytes = [sum(4 * p.numel() for p in b.parameters()) for b in model.blocks]
    total = sum(4 * p.numel() for p in model.parameters())
    collectives, optimizer_ms, burst_ms, gather_ms = [], {}, None, None
    if world > 1:
        optimizer_ms = {"zero1": _zero1_optimizer_ms(group, world, repeats)}
        burst_ms = zero1_broadcast_ms(group, world, repeats)
        gather_ms = _fsdp_gather_ms(group, alone, repeats)
        for nbytes in COLLECTIVE_SIZES:
            for op in ("all_reduce", "all_gather"):
                collectives.append((op, nbytes, _collective_ms(op, nbytes, world, group, repeats)))
    alone_ms = {m: _alone_ms(m, alone, group, repeats) for m in ("ddp", "zero2", "zero3")}
    return {
        "rank": rank,
        "world_size": world,
        "steps": timed,
        "unit_bytes": [total - sum(block_bytes), *block_bytes],
        "tensor_bytes": [4 * p.numel() for p in model.parameters()],
        "collectives": collectives,
        "optimizer_ms": optimizer_ms,
        "zero1_broadcast_ms": burst_ms,
        "gather_ms": gather_ms,
        "alone_ms": alone_ms,
    }
