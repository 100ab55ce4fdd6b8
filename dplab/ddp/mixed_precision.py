"""torch's native DDP mixed precision (``mixed_precision=_MixedPrecision(...)``), for dplab.DDP.

What torch does, and so what this module does (torch/nn/parallel/distributed.py:
``_setup_mixed_precision_params``, ``_cast_buffers``, ``_root_copy_hook``;
torch/distributed/algorithms/ddp_comm_hooks/mixed_precision_hooks.py:
``_reducer_allreduce_and_upcast_hook``):

- every parameter DDP keeps in sync gets a low-precision twin (``_mp_param``, ``param_dtype``)
  beside its full-precision data (``_fp_param``); the twin's storage exists only from a forward
  to the end of its synchronising backward. Buffers are cast to ``buffer_dtype`` once, for good;
- before each forward the twin is filled from the full-precision data and becomes the
  parameter's data, an existing ``.grad`` is cast down with it, and floating-point inputs are
  cast to ``param_dtype``: the forward and backward run in low precision;
- the buckets hold ``param_dtype``; each is cast to ``reduce_dtype``, summed across ranks, then
  divided by the world size (the division comes after the sum, as in torch's hook);
- when the synchronising backward ends, every parameter has its full-precision data back and
  ``.grad`` is the reduced gradient cast up, so the optimizer steps in full precision.

One difference, on purpose: torch leaves the low-precision data in the parameters after a
forward without gradients (an evaluation pass) until the next backward; dplab puts the full
precision back at once, so a checkpoint saved after evaluation holds full-precision weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn


def _checked_dtype(config: Any, name: str) -> torch.dtype | None:
    value = getattr(config, name, None)
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(f"mixed_precision.{name} must be a torch.dtype or None, got {value!r}")
    return value


class MixedPrecision:
    """One DDP's low-precision twins and the casts around its forward and its reduction."""

    def __init__(self, config: Any, module: nn.Module, ignored: set[str], world_size: int):
        self.config = config
        self.world_size = world_size
        param_dtype = _checked_dtype(config, "param_dtype")
        if param_dtype is None:
            raise ValueError(
                f"mixed_precision={config!r} has no param_dtype: DDP's mixed precision needs "
                "one (torch's _MixedPrecision(param_dtype=torch.float16, ...))"
            )
        self.param_dtype: torch.dtype = param_dtype
        self.reduce_dtype = _checked_dtype(config, "reduce_dtype") or param_dtype
        self.buffer_dtype = _checked_dtype(config, "buffer_dtype")
        self.params = [p for name, p in module.named_parameters() if name not in ignored]
        for p in self.params:
            if not hasattr(p, "_mp_param"):
                twin = torch.zeros_like(p, dtype=self.param_dtype, requires_grad=p.requires_grad)
                _free(twin)
                p._mp_param = twin
                p._fp_param = p.data
        if self.buffer_dtype is not None:
            for name, buffer in module.named_buffers():
                if name not in ignored:
                    buffer.data = buffer.to(dtype=self.buffer_dtype)
        self.low = False  # do the parameters hold their low-precision twins now?

    def to_low(self) -> None:
        """Before a forward: the twins, filled from the full-precision data, become the data."""
        with torch.no_grad():
            for p in self.params:
                twin = p._mp_param
                _alloc(twin)
                twin.copy_(p.data)
                if p.grad is not None and p.grad.dtype != self.param_dtype:
                    p.grad.data = p.grad.to(self.param_dtype)
                p.data = twin
        self.low = True

    def cast_inputs(self, obj: Any) -> Any:
        """Floating-point tensors in the forward's arguments, cast to ``param_dtype``."""
        if isinstance(obj, torch.Tensor):
            return obj.to(self.param_dtype) if torch.is_floating_point(obj) else obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(self.cast_inputs(x) for x in obj))
        if isinstance(obj, list | tuple):
            return type(obj)(self.cast_inputs(x) for x in obj)
        if isinstance(obj, dict):
            return {k: self.cast_inputs(v) for k, v in obj.items()}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = {
                f.name: self.cast_inputs(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            }
            return dataclasses.replace(obj, **fields)
        return obj

    def start_reduction(self, bucket: torch.Tensor) -> torch.Tensor:
        """The tensor a bucket's all-reduce sums: the bucket itself, or a ``reduce_dtype`` copy."""
        return bucket if bucket.dtype == self.reduce_dtype else bucket.to(self.reduce_dtype)

    def averaged(
        self, outputs: dict[int, torch.Tensor], layout: Any, params: list, untouched: set[int]
    ) -> dict[int, torch.Tensor]:
        """Each reduced bucket (``outputs``: bucket → its sum, in ``reduce_dtype``) divided by
        the world size after the sum, as torch's hook does; returned as each parameter's view of
        it (``id`` of the parameter → view), leaving out the ``untouched`` parameters."""
        grads: dict[int, torch.Tensor] = {}
        for b, out in outputs.items():
            out.div_(self.world_size)
            for i, offset in zip(layout.members[b], layout.offsets[b], strict=True):
                p = params[i][1]
                if i not in untouched:
                    grads[id(p)] = out[offset : offset + p.numel()].view(p.shape)
        return grads

    def to_full(self, grads: dict[int, torch.Tensor] | None = None) -> None:
        """After the synchronising backward (or a forward without one): full-precision data back
        in every parameter, and each ``.grad`` in full precision: ``grads`` (parameter ``id`` →
        its reduced gradient, in ``reduce_dtype``) cast up, or the one it has cast up."""
        with torch.no_grad():
            for p in self.params:
                p.data = p._fp_param
                _free(p._mp_param)
                reduced = grads.get(id(p)) if grads else None
                if reduced is not None:
                    p.grad = torch.empty_like(p).copy_(reduced)
                elif p.grad is not None and p.grad.dtype != p.dtype:
                    p.grad = p.grad.to(p.dtype)
        self.low = False


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)
