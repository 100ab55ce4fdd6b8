"""torch's DistributedDataParallel arguments, checked the way torch checks them.

dplab.DDP takes torch's arguments, with torch's defaults. This module holds the part of that
contract that is about *arguments*, not about reducing gradients: the ones dplab refuses by name,
the process group a ``device_mesh`` stands for, ``device_ids``/``output_device``, the modules torch
cannot wrap (lazy ones), the parameters whose gradients come sparse, and moving inputs to the
module's device. Keeping it here leaves
``ddp.py`` to the mechanism a learner reads: hooks, buckets, launches, the end-of-backward wait.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch arguments dplab.DDP does not implement, with the value that means "not used".
NOT_SUPPORTED: dict[str, Any] = {
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
}


def refuse_unsupported(given: dict[str, Any], *, check_reduction: bool) -> None:
    """Refuse, by name, a torch argument dplab does not implement; warn as torch does about
    ``check_reduction`` (deprecated, ignored)."""
    for name, default in NOT_SUPPORTED.items():
        if given[name] is not default and given[name] != default:
            raise NotImplementedError(
                f"dplab.DDP does not support {name}={given[name]!r} (torch's "
                f"DistributedDataParallel does); leave it at {default!r}. See docs/ddp.md."
            )
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is "
            "deprecated. Please avoid using it.",
            FutureWarning,
            stacklevel=3,
        )


def sync_buffers_flags(broadcast_buffers: Any, forward_sync_buffers: Any) -> tuple[bool, bool]:
    """(sync buffers before forwards, sync them at construction), with torch 2.13's warnings:
    ``broadcast_buffers`` is deprecated in favour of ``forward_sync_buffers`` (which still syncs
    at construction); left at ``None`` it means True."""
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            message = (
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                "`broadcast_buffers` is deprecated and its value is ignored when "
                "`forward_sync_buffers` is provided."
            )
        else:
            message = (
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
                "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still "
                "syncs buffers at init. If you rely on buffers NOT being synced at init (e.g. "
                "rank-local buffers), keep using `broadcast_buffers=False` until "
                "`init_sync_buffers` is available."
            )
        warnings.warn(message, FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective


def resolve_group(process_group: Any, device_mesh: Any) -> Any:
    """The process group the DDP reduces over: given, a 1-D mesh's, or the default one."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    return process_group if process_group is not None else dist.group.WORLD


def check_wrappable(module: nn.Module) -> None:
    """Refuse the modules torch refuses (uninitialized lazy ones), naming the parameter."""
    for name, p in module.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with "
                f"`DistributedDataParallel` (parameter {name!r} of a lazy module). "
                "Run a dummy forward pass to correctly initialize the modules"
            )


def sparse_parameters(module: nn.Module) -> set[int]:
    """``id()`` of every parameter whose gradient comes sparse: those of an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` built with ``sparse=True``, the modules torch's DDP asks
    (``_build_params_for_reducer``). Each gets a bucket of its own."""
    return {
        id(p)
        for sub in module.modules()
        if isinstance(sub, nn.Embedding | nn.EmbeddingBag) and sub.sparse
        for p in sub.parameters(recurse=False)
    }


def check_devices(
    params: list[tuple[str, nn.Parameter]], device_ids: Any, output_device: Any
) -> tuple[list[int] | None, int | None]:
    """torch's checks of ``device_ids``/``output_device``: one device of a one-GPU module."""
    devices = {p.device for _, p in params}
    types = {d.type for d in devices}
    if len(types) != 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but "
            f"input module parameters locate in {types}."
        )
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(
            f"device_ids can only be None or contain a single element, got {device_ids!r}"
        )
    if not device_ids or types == {"cpu"} or len(devices) > 1:
        if device_ids or output_device is not None:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                f"{device_ids}, output_device {output_device}, and module parameters {devices}."
            )
        return None, None
    ids = [torch.device(d if not isinstance(d, int) else f"cuda:{d}").index for d in device_ids]
    (device,) = devices
    if ids[0] != device.index:
        raise ValueError(
            f"device_ids={device_ids!r} but the module's parameters are on {device}: move the "
            "module to that device first (model.to(device_ids[0]))"
        )
    out = ids[0] if output_device is None else torch.device(output_device).index
    if isinstance(output_device, int):
        out = output_device
    return ids, out


def to_device(obj: Any, device: torch.device) -> Any:
    """Inputs onto the module's device, as torch does with ``device_ids``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(x, device) for x in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
