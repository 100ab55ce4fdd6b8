"""Where this torch keeps FSDP2, or a sentence saying it has none.

FSDP2 (``fully_shard``: every parameter a DTensor sharded on dim 0) arrived in torch 2.4 as
``torch.distributed._composable.fsdp`` and moved to ``torch.distributed.fsdp`` in 2.6. The course
runs on whatever torch the learner has, so the sharded cells ask here first and, on a torch
without it, say so in words instead of failing deep inside an import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

MIN_TORCH = (2, 4)


class ShardingUnavailable(RuntimeError):
    """The installed torch cannot run this part of the lesson (the message says which and why)."""


def fully_shard_api() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(fully_shard, init_device_mesh)`` from wherever this torch keeps them.

    Raises :class:`ShardingUnavailable` naming the installed version when FSDP2 is missing.
    """
    try:
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError as e:  # torch < 2.2
        raise ShardingUnavailable(_missing("DeviceMesh", e)) from e
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard  # torch 2.4, 2.5
        except ImportError as e:
            raise ShardingUnavailable(_missing("FSDP2 (fully_shard)", e)) from e
    return fully_shard, init_device_mesh


def fsdp2_available() -> bool:
    """Whether :func:`fully_shard_api` would succeed on this torch."""
    try:
        fully_shard_api()
    except ShardingUnavailable:
        return False
    return True


def _missing(what: str, error: Exception) -> str:
    need = ".".join(map(str, MIN_TORCH))
    return (
        f"{what} is not in the installed torch {torch.__version__} ({error}); the FSDP/ZeRO-3 "
        f"parts of this lesson need torch >= {need}. DDP and ZeRO-1 (ZeroRedundancyOptimizer) "
        "still run."
    )
