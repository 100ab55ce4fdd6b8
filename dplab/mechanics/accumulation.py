"""Gradient accumulation: what it saves (activation memory) and what it must not cost (traffic).

Autograd keeps, for every operation in the forward, the tensors its backward will need ("saved
for backward"): the layer inputs, the activations. That memory grows with the batch the forward
sees. With A micro-batches the forward sees B_local / A samples at a time, and each
micro-batch's saved tensors are freed by its own backward before the next forward starts, so the
peak is set by the micro-batch, while the gradients (summed in ``.grad``) are those of the whole
local batch.

:class:`SavedTensorMeter` measures that peak with ``torch.autograd.graph.saved_tensors_hooks``:
the pack hook notes each saved tensor's storage; the note is released when autograd drops the
saved tensor. Weights that autograd saves (a Linear keeps its weight for the input gradient) are
model state, not activations, and are left out. Counting storages, not tensors, means a tensor
saved twice (tanh's output is also the next layer's input) counts once, as in memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dplab._checks import check_positive_int
from dplab.mechanics._common import as_dtype
from dplab.mechanics.batch import local_batch_size
from dplab.models import make_batch, make_model


class _Saved:
    """What the pack hook hands to autograd: the tensor, plus a release when autograd drops it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: int | None, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


class SavedTensorMeter:
    """Bytes of tensors saved for backward that are alive right now, and the peak so far.

    ``exclude``: tensors (the model's parameters) whose storage is not counted.
    Use as a context manager around forward *and* backward.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage pointer → [bytes, references]
        self.current = 0
        self.peak = 0
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> _Saved:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded:
            return _Saved(self, None, t)
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        return _Saved(self, key, t)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


def peak_saved_bytes(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, accum: int = 1
) -> dict[str, int]:
    """Peak activation bytes of one optimizer step's forward/backward over (x, y) in ``accum``
    micro-batches (each freed by its backward before the next forward)."""
    check_positive_int("accum", accum)
    b = x.shape[0]
    if b % accum:
        raise ValueError(f"a batch of {b} does not split into accum={accum} micro-batches")
    # Each micro-batch its own tensor, as a data loader hands them out: a chunk() view would keep
    # (and be counted as) the whole batch's storage.
    pairs = zip(x.chunk(accum), y.chunk(accum), strict=True)
    micro_batches = [(xm.clone(), ym.clone()) for xm, ym in pairs]
    model.zero_grad(set_to_none=True)
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        for xm, ym in micro_batches:
            (model(xm, ym) / accum).backward()
    model.zero_grad(set_to_none=True)
    return {"peak_bytes": meter.peak, "left_bytes": meter.current}


def activation_memory(
    *,
    local_batch: int = 256,
    accums: Iterable[int] = (1, 2, 4, 8),
    model: str = "mlp",
    dtype: Any = "float32",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """For each A: the micro-batch and the measured peak of saved activations for one step.

    Runs in one process: activation memory is a per-rank quantity (each rank holds only its own
    micro-batch's activations), so one rank is the whole story.
    """
    dt = as_dtype(dtype)
    net = make_model(model, seed=seed, dtype=dt)
    x, y = make_batch(model, local_batch, seed=seed + 1, dtype=dt)
    rows = []
    for a in accums:
        micro = local_batch_size(local_batch, 1, a)
        measured = peak_saved_bytes(net, x, y, accum=a)
        rows.append({"accum": a, "micro_batch": micro, "local_batch": local_batch, **measured})
    return rows
