"""Gradient checkpointing under DDP: "Expected to mark a variable ready only once".

Activation checkpointing (``torch.utils.checkpoint.checkpoint``) recomputes a block's forward
during backward. The *reentrant* variant (``use_reentrant=True``, the old default) runs that
recomputation as a backward of its own, inside the outer one, so the block's parameters get their
gradients from a nested autograd pass. With ``find_unused_parameters=True`` DDP's reducer
(``reducer.cpp``, ``mark_variable_ready``) then sees a parameter marked ready that it already
counted, and raises "Expected to mark a variable ready only once" on the first backward. The
fixes: ``use_reentrant=False`` (one backward: the recomputation is saved-tensor hooks inside it),
or ``static_graph=True``, which tells DDP the graph is the same every step, so it records once
which parameters are used and no longer tracks readiness per hook the same way. Either way the
gradients are those of the same model without checkpointing, which the experiment checks.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

from dplab import _checks
from dplab.failures._common import first_line, short_group

MODES = ("reentrant", "non_reentrant", "reentrant_static_graph", "no_checkpoint")


class Checkpointed(nn.Module):
    """Two blocks, each under activation checkpointing (``use_reentrant`` or none), and a head."""

    def __init__(self, use_reentrant: bool | None, width: int = 16) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant  # None: no checkpointing
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.use_reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


@dataclass(frozen=True)
class CheckpointRun:
    """One rank's run: torch's error (first line, None if none), the steps done, and the largest
    gradient difference from the same model trained without checkpointing (None on error)."""

    mode: str
    error: str | None
    steps_done: int
    grad_diff: float | None


def _train(model: nn.Module, group: object, steps: int, *, static_graph: bool) -> list:
    with warnings.catch_warnings():  # static_graph says find_unused_parameters is not needed
        warnings.simplefilter("ignore", UserWarning)
        ddp = TorchDDP(
            model, process_group=group, find_unused_parameters=True, static_graph=static_graph
        )
    grads = []
    for step in range(steps):
        torch.manual_seed(100 * step + dist.get_rank())  # each rank its own batch
        x = torch.randn(8, 16, requires_grad=True)  # as a layer's input would
        ddp.zero_grad()
        ddp(x).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
    del ddp  # a DDP must not outlive its group (see short_group)
    return grads


def checkpointed_ddp(mode: str, *, steps: int = 2, group_timeout_s: float = 5.0) -> CheckpointRun:
    """Rank function: a checkpointed model under torch's DDP with ``find_unused_parameters=True``
    (what a trainer sets "to be safe"), in ``mode``: one of :data:`MODES`."""
    _checks.check_choice("mode", mode, MODES)
    steps = _checks.check_positive_int("steps", steps)
    use_reentrant = {"non_reentrant": False, "no_checkpoint": None}.get(mode, True)
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant)
    reference = Checkpointed(None)
    reference.load_state_dict(model.state_dict())
    with short_group(group_timeout_s) as group:
        done, error, grads = 0, None, None
        try:
            grads = _train(model, group, steps, static_graph=mode == "reentrant_static_graph")
            done = steps
        except RuntimeError as e:
            error = first_line(e)
        expected = _train(reference, group, steps, static_graph=False) if grads else None
    diff = None
    if grads is not None and expected is not None:
        diff = max(float((g - e).abs().max()) for g, e in zip(grads, expected, strict=True))
    return CheckpointRun(mode, error, done, diff)
