"""Reference solutions to the §3 exercises (the checkers' tests run them on real ranks).

Try the exercise first: the notebook's "your turn" cells say what each function must do.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn


def broadcast_weights(model: nn.Module) -> None:
    """Make every rank's parameters equal to rank 0's, in place: one broadcast per tensor."""
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)


def average_gradients(model: nn.Module) -> None:
    """Replace every ``p.grad`` by its average over the ranks: all-reduce (sum), divide by N."""
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
