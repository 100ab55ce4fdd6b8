"""Hangs as people meet them, each a scenario for :func:`dplab.failures.job.run_job`.

Collectives pair up by *order*: every rank's n-th collective on a group must be the same call
(same op, same sizes). Each scenario breaks that the way training code does, on the group's
short timeout, so it ends in seconds with torch's own error:

- ``metric_on_rank0``: every rank all-reduces the loss, then ``if rank == 0`` all-reduces a metric
  for its log. Rank 0 waits in a collective rank 1 never issues.
- ``metric_keys``: rank 0 logged one metric more, so it all-reduces 3 numbers while rank 1
  all-reduces 2: the same collective, issued with different sizes.
- ``save_on_rank0``: ``if rank == 0: save_checkpoint()``, and the save waits at a barrier for
  "everyone" while the other ranks have gone on to the next step's all-reduce. ``fixed=True``
  saves on rank 0 with no collective inside, then every rank meets at the barrier.
- ``skip``: the planted hang of the tests: rank ``skipper`` never issues collective number
  ``position`` (on the default group, or on a new group), every other rank does. Each position's
  all-reduce has its own size, so the dumps show which one it was.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from dplab import _checks


def metric_on_rank0(timeout_s: float, *, fixed: bool = False) -> None:
    """A step's loss on every rank, then a metric all-reduced on rank 0 only (the bug); the fix
    all-reduces it on every rank and lets rank 0 alone log it."""
    loss = torch.ones(4)
    dist.all_reduce(loss)  # every rank: collective #1
    accuracy = torch.tensor([0.5])
    if fixed or dist.get_rank() == 0:
        dist.all_reduce(accuracy)  # #2: on rank 0 only, no other rank issues it
    if dist.get_rank() == 0:
        print(f"accuracy {accuracy.item() / dist.get_world_size():.2f}")


METRICS = ("loss", "accuracy", "grad_norm")  # the keys every rank agrees to send


def metrics_by_rank(rank: int) -> dict[str, float]:
    """What a rank logged this step: rank 0 also measured the gradient norm."""
    logged = {"loss": 1.0 + rank, "accuracy": 0.5}
    if rank == 0:
        logged["grad_norm"] = 3.0
    return logged


def metric_keys(timeout_s: float, *, fixed: bool = False) -> None:
    """Each rank all-reduces the values it logged: 3 numbers on rank 0, 2 on the others. The fix
    sends the agreed keys, 0 where a rank has no value."""
    dist.all_reduce(torch.ones(4))  # the loss: #1 on every rank
    logged = metrics_by_rank(dist.get_rank())
    values = [logged.get(k, 0.0) for k in METRICS] if fixed else list(logged.values())
    dist.all_reduce(torch.tensor(values))  # #2, with a size that differs unless fixed


def save_checkpoint(state: dict, *, collective_inside: bool) -> bytes:
    """Serialize ``state``; the buggy version waits for "everyone" at a barrier inside."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    if collective_inside:
        dist.barrier()  # called by rank 0 alone: the others are elsewhere
    return buffer.getvalue()


def save_on_rank0(timeout_s: float, *, fixed: bool = False) -> None:
    """A step, a checkpoint saved by rank 0, the next step."""
    state = {"weight": torch.ones(4)}
    dist.all_reduce(state["weight"])  # step 1's gradients: #1 on every rank
    if dist.get_rank() == 0:
        save_checkpoint(state, collective_inside=not fixed)
    if fixed:
        dist.barrier()  # every rank waits for the save, outside the `if`
    dist.all_reduce(torch.ones(4))  # step 2's gradients


def skip(timeout_s: float, *, skipper: int, position: int, new_group: bool = False) -> None:
    """Collectives #1..#position on every rank but ``skipper``, which stops before #position.

    Collective #i all-reduces ``i + 2`` numbers. On ``new_group`` the collectives run on a group
    of every rank made for the purpose (with the same short timeout), the default group idle.
    """
    world = dist.get_world_size()
    skipper = _checks.check_int_in("skipper", skipper, 0, world - 1)
    position = _checks.check_positive_int("position", position)
    group = None
    if new_group:
        group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s))
    for i in range(1, position + 1):
        if i == position and dist.get_rank() == skipper:
            return  # the planted bug: this rank never issues collective #position
        dist.all_reduce(torch.ones(i + 2), group=group)


SCENARIOS: dict[str, Callable[..., None]] = {
    "metric_on_rank0": metric_on_rank0,
    "metric_keys": metric_keys,
    "save_on_rank0": save_on_rank0,
    "skip": skip,
}
