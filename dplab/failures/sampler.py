"""§9 ``DistributedSampler``: ``set_epoch`` forgotten, and evaluation padding counted twice.

The sampler shuffles with a generator seeded by ``seed + epoch``; the epoch is whatever
``set_epoch`` last set, 0 if never called, so without it every epoch repeats the same order.
And it pads: with ``drop_last=False`` every rank gets ``ceil(n / N)`` indices, the missing ones
repeated from the start, so an evaluation over it counts some samples twice. The fix for
evaluation gives rank r the indices ``r, r + N, ...`` (unequal lengths, nothing repeated) and
all-reduces the counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from dplab import _checks
from dplab.failures._common import short_group


def epoch_orders(
    *, set_epoch: bool, epochs: int = 3, samples: int = 8, world_size: int = 2, rank: int = 0
) -> list[list[int]]:
    """The indices rank ``rank`` visits in each epoch (pure: the sampler needs no group)."""
    epochs = _checks.check_positive_int("epochs", epochs)
    sampler = DistributedSampler(
        range(_checks.check_positive_int("samples", samples)),
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=0,
    )
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def is_correct(index: int) -> bool:
    """The model's verdict on sample ``index``: right on the even ones (3 of 5 are even)."""
    return index % 2 == 0


@dataclass(frozen=True)
class EvalCount:
    """One rank's view of the global evaluation: its indices, the accuracy all ranks agree on."""

    indices: tuple[int, ...]
    correct: int
    seen: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.seen


def distributed_accuracy(
    *, exact: bool, samples: int = 5, group_timeout_s: float = 5.0
) -> EvalCount:
    """Rank function: accuracy over ``samples`` samples split across ranks, counts all-reduced.

    ``exact=False`` splits with ``DistributedSampler`` (padded); ``exact=True`` with
    ``range(rank, samples, N)``.
    """
    samples = _checks.check_positive_int("samples", samples)
    rank, world = dist.get_rank(), dist.get_world_size()
    if exact:
        indices = list(range(rank, samples, world))
    else:
        indices = list(DistributedSampler(range(samples), world, rank, shuffle=False))
    counts = torch.tensor([sum(is_correct(i) for i in indices), len(indices)], dtype=torch.int64)
    with short_group(group_timeout_s) as group:
        dist.all_reduce(counts, group=group)
    return EvalCount(tuple(indices), int(counts[0]), int(counts[1]))
