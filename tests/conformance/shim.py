"""The CPU shim: run torch's CUDA-gated DDP tests on a machine without GPUs.

Most of torch's DDP tests are gated on CUDA only because torch's CI runs them on GPUs; their
logic (buckets, hooks, unused parameters, join) needs no device. The shim lets them run on CPU
and gloo, for torch's DDP and dplab.DDP alike, so that a test counts only where torch's own DDP
passes under the same shim. What it changes, and nothing else:

1. **Decorators lifted** (patched in ``torch.testing._internal.common_distributed`` *before*
   ``distributed_test`` is imported, so the class is built without them):
   ``skip_if_lt_x_gpu(n)`` and ``skip_if_no_gpu`` become no-ops. Every other gate stays
   (``require_world_size``, ``skip_if_small_worldsize``, NCCL-only tests, ``unittest.skip``).
2. **Devices mapped to the CPU** by a ``TorchFunctionMode`` active during the test: a
   ``device=`` argument that names CUDA (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda", 1)``
   or an integer), a CUDA device given positionally to ``Tensor.to``, and ``Tensor.cuda(i)``
   all become the CPU. ``nn.Module.cuda``/``.to(rank)`` go through ``Tensor.cuda``/``Tensor.to``
   and follow.
3. **torch.cuda answers as W devices would**: ``device_count()`` is the world size (so
   ``init_multigpu_helper`` gives rank r the "GPU" r), ``set_device``, ``synchronize``,
   ``empty_cache`` do nothing, ``torch.cuda.device(i)`` is a no-op context. ``is_available()``
   stays False: a test that branches on it takes its CPU branch.
4. **``device_ids`` and ``output_device`` dropped** by one wrapper class around each DDP
   (:func:`shimmed`): on CPU both DDPs refuse them, as they must.

Tests that need a real device (CUDA streams, SyncBatchNorm's CUDA kernels, autocast, NCCL) fail
under the shim for torch's DDP too, and so do not count.
"""

from __future__ import annotations

import functools
import os
from contextlib import nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


def _cuda_like(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return False


def _device_arg(value: Any) -> bool:
    return _cuda_like(value) or (isinstance(value, int) and not isinstance(value, bool))


class CudaToCpu(TorchFunctionMode):
    """Every CUDA device a torch function is asked for becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0].to(CPU)
        device = kwargs.get("device")
        if device is not None and _device_arg(device):
            kwargs["device"] = CPU
        # The device is the first positional argument of ``Tensor.to`` (after the tensor) and of
        # ``_parse_to`` (which ``nn.Module.to`` calls); an integer there means ``cuda:<int>``.
        at = 1 if func is torch.Tensor.to else 0 if func is torch._C._nn._parse_to else None
        if at is not None and len(args) > at and _device_arg(args[at]):
            args = (*args[:at], CPU, *args[at + 1 :])
        return func(*args, **kwargs)


def _identity_decorator(*_a: Any, **_k: Any):
    return lambda fn: fn


def lift_gpu_gates() -> None:
    """Make the GPU-count skip decorators no-ops (before ``distributed_test`` is imported)."""
    import torch.testing._internal.common_distributed as cd

    cd.skip_if_lt_x_gpu = _identity_decorator
    cd.skip_if_no_gpu = lambda fn: fn


def fake_cuda_runtime() -> None:
    """``torch.cuda`` answers as if each rank had its own device (see the module docstring)."""
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.device_count = lambda: world
    torch.cuda.set_device = lambda *_a, **_k: None
    torch.cuda.synchronize = lambda *_a, **_k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_device = lambda: 0
    torch.cuda.device = lambda *_a, **_k: nullcontext()


def shimmed(ddp_class: type) -> type:
    """``ddp_class`` with ``device_ids``/``output_device`` dropped (they name CUDA devices)."""

    class Shimmed(ddp_class):  # type: ignore[misc, valid-type]
        @functools.wraps(ddp_class.__init__)
        def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
            super().__init__(module, None, None, *args, **kwargs)

    # Module-level under this name, so that a test that pickles the DDP finds the class.
    Shimmed.__name__ = Shimmed.__qualname__ = "ShimmedDDP"
    Shimmed.__module__ = __name__
    globals()["ShimmedDDP"] = Shimmed
    return Shimmed
