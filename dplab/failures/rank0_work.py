"""§6 Rank-0-only work: rank 0 evaluates while the others wait in the next collective.

``if rank == 0: evaluate()`` looks harmless, but the other ranks go straight on to the next
step's all-reduce and wait there for rank 0. If the evaluation outlasts the group's ``timeout``
they fail with gloo's "Timed out waiting ... for recv" (under NCCL, its watchdog aborts the
job the same way). The fix shares the work: every rank evaluates its shard and
one all-reduce adds the counts, so no rank waits longer than the slowest shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dplab import _checks
from dplab.failures._common import short_group


@dataclass(frozen=True)
class EvalRun:
    """One rank's side: the error it got (None if none) and the evaluation's seconds on it."""

    error: str | None
    eval_s: float


def evaluate(batches: range, batch_s: float) -> torch.Tensor:
    """An evaluation pass: ``batch_s`` seconds per batch (a sleep stands in for the forward)."""
    for _ in batches:
        time.sleep(batch_s)
    return torch.tensor([float(len(batches))])


def rank0_evaluates(
    *, sharded: bool, batches: int = 30, batch_s: float = 0.1, group_timeout_s: float = 2.0
) -> EvalRun:
    """Rank function: a step, an evaluation of ``batches`` batches, the next step's all-reduce.

    ``sharded=False``: rank 0 evaluates all of them (``batches * batch_s`` s) while the others
    wait; ``sharded=True``: each rank evaluates ``batches / N`` and the counts are all-reduced.
    """
    batches = _checks.check_positive_int("batches", batches)
    batch_s = _checks.check_positive("batch_s", batch_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    with short_group(group_timeout_s) as group:
        start = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(8), group=group)  # a training step's gradients
            start = time.perf_counter()
            if sharded:
                seen = evaluate(range(rank, batches, world), batch_s)
                dist.all_reduce(seen, group=group)
            elif rank == 0:
                evaluate(range(batches), batch_s)
            took = time.perf_counter() - start
            dist.all_reduce(torch.ones(8), group=group)  # the next step's gradients
        except RuntimeError as e:
            took = time.perf_counter() - start
            error = str(e)
    return EvalRun(error, took)
