"""Reference solutions to the §3 exercises (the checkers' tests run them on real ranks).

Try the exercise first: the notebook's "your turn" cells say what each function must do.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn


def broadcast_weights(model: nn.Module) -> None:
    """Make every rank's model state equal to rank 0's, in place: one broadcast per tensor, for
    the parameters and the buffers (a BatchNorm's running statistics are state too)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=0)


def average_gradients(model: nn.Module) -> None:
    """Replace every ``p.grad`` by its average over the ranks: all-reduce (sum), divide by N.

    (``op=dist.ReduceOp.AVG`` is the same on NCCL, and on gloo from torch 2.7, where it is this
    very sum followed by a division; older gloo refuses it.)
    """
    n = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= n


def accumulation_step(
    ddp: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """One optimizer step over A micro-batches: scale each loss by 1/A, skip the all-reduce on all
    but the last (``no_sync``), step once, then zero the gradients."""
    a = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        quiet = ddp.no_sync() if i < a - 1 else contextlib.nullcontext()
        with quiet:
            loss = ddp(x, y) / a
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()
