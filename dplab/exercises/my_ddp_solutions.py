"""Reference answers to "build your own DDP" (notebook 08b), in CS336's contract.

``MyDDP(module, bucket_size_mb=None)`` wraps the model, ``forward(*args, **kwargs)`` runs it, and
``finish_gradient_synchronization()`` is called after ``loss.backward()`` and before
``optimizer.step()``: when it returns, every ``.grad`` holds the average over the ranks.

Three steps, each the previous one made faster:

- :class:`NaiveMyDDP`: all-reduce every gradient once backward is over (nothing overlaps);
- :class:`OverlappedMyDDP`: a post-accumulate-grad hook per parameter launches that gradient's
  all-reduce asynchronously, while autograd computes the earlier layers' gradients;
- :class:`BucketedMyDDP`: the same, but gradients are packed into buckets (reverse registration
  order, at most ``bucket_size_mb`` MiB each) so there is one collective per bucket, not per
  tensor.

Try the exercises first: ``dplab.exercises.check_my_ddp`` says what is wrong with yours.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab._units import MIB
from dplab.exercises.my_ddp_buckets import greedy_plan as greedy_buckets


def _broadcast_from_rank0(module: nn.Module) -> None:
    """Every replica starts from rank 0's weights and buffers (in place)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src=0)


class NaiveMyDDP(nn.Module):
    """All-reduce (sum) each gradient after backward, then divide by the world size."""

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = None):
        super().__init__()
        self.module = module
        _broadcast_from_rank0(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        n = dist.get_world_size()
        for p in self.module.parameters():  # a tied parameter is listed once
            if p.grad is not None:  # frozen parameters have none
                dist.all_reduce(p.grad)
                p.grad.div_(n)


class OverlappedMyDDP(nn.Module):
    """One asynchronous all-reduce per gradient, launched by a hook the moment it is ready."""

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = None):
        super().__init__()
        self.module = module
        self._handles: list[Any] = []
        _broadcast_from_rank0(module)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._launch)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _launch(self, param: torch.Tensor) -> None:
        param.grad.div_(dist.get_world_size())  # the sum of g_i / N is the average
        self._handles.append(dist.all_reduce(param.grad, async_op=True))

    def finish_gradient_synchronization(self) -> None:
        for handle in self._handles:
            handle.wait()
        self._handles.clear()


class BucketedMyDDP(nn.Module):
    """Gradients packed into flat buckets, each all-reduced asynchronously once it is full."""

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = None):
        super().__init__()
        self.module = module
        _broadcast_from_rank0(module)
        cap = math.inf if bucket_size_mb is None else bucket_size_mb * MIB
        params = [p for p in module.parameters() if p.requires_grad][::-1]  # last layer first
        # The exercise's rule, at most the cap per bucket (written once, for the checker too).
        plan = greedy_buckets([p.numel() * p.element_size() for p in params], cap)
        self._buckets = [[params[i] for i in members] for members in plan]
        self._buffers = [
            torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
            for b in self._buckets
        ]
        self._slot: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, offset)
        for b, members in enumerate(self._buckets):
            offset = 0
            for p in members:
                self._slot[id(p)] = (b, offset)
                offset += p.numel()
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._reset()

    def _reset(self) -> None:
        self._pending = [len(b) for b in self._buckets]
        self._handles: list[Any] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _grad_ready(self, param: torch.Tensor) -> None:
        b, offset = self._slot[id(param)]
        self._buffers[b][offset : offset + param.numel()].copy_(param.grad.reshape(-1))
        self._pending[b] -= 1
        if self._pending[b] == 0:  # the bucket is full: launch it now, while backward goes on
            self._buffers[b].div_(dist.get_world_size())
            self._handles.append(dist.all_reduce(self._buffers[b], async_op=True))

    def finish_gradient_synchronization(self) -> None:
        for handle in self._handles:
            handle.wait()
        for members, buffer in zip(self._buckets, self._buffers, strict=True):
            offset = 0
            for p in members:
                p.grad.copy_(buffer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self._reset()
