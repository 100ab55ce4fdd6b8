"""Gradient accumulation: A micro-batches, one all-reduce (the loop every training run shares).

Only the last micro-batch's backward may all-reduce; the others run under ``no_sync()`` and just
add into ``.grad``. Dividing each loss by A makes the summed gradient the mean over the big batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["accumulate"]


def accumulate(
    net: nn.Module,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    no_sync: bool = True,
    scale_loss: bool = True,
) -> float:
    """Forward and backward over the micro-batches, summing into ``.grad``; returns the loss.

    Right: loss / A on every micro-batch, and ``no_sync()`` on all but the last, so the one
    all-reduce happens after the last backward. ``scale_loss=False`` forgets the 1/A (the
    gradient is the sum of A means: A× too large); ``no_sync=False`` forgets no_sync (an
    all-reduce per micro-batch: A× the traffic, same result).
    """
    a = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        quiet = no_sync and i < a - 1 and hasattr(net, "no_sync")
        with net.no_sync() if quiet else contextlib.nullcontext():
            loss = net(x, y)
            if scale_loss:
                loss = loss / a
            loss.backward()
        total += loss.item()
    return total
