"""What the torch-as-it-is probes share: torch's own logging, and the small models they run.

:mod:`dplab.ddp.torch_as_it_is` asks torch's ``DistributedDataParallel`` about itself through
``_get_ddp_logging_data()``; :func:`torch_logging` reads the fields it uses (bucket sizes as lists).
:func:`linear_stack`, :func:`probe_batch` and :func:`probe_loss` are the models, batches and loss
every probe runs on; :func:`env_var` sets torch's ``DDP_SET_LAST_BUCKET_CAP`` for one block.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# torch 2.13's _get_ddp_logging_data() keys this module reads (checked: all present on gloo).
LOGGING_KEYS = (
    "iteration",
    "bucket_cap_bytes",
    "bucket_sizes",
    "has_rebuilt_buckets",
    "rebuilt_bucket_sizes",
    "rebuilt_per_bucket_param_indices",
    "prev_iteration_grad_ready_order_indices",
    "num_buckets_reduced",
    "gradient_as_bucket_view",
    "broadcast_buffers",
    "total_parameter_size_bytes",
    "forward_compute_time",
    "backward_compute_time",
    "backward_comm_time",
    "backward_compute_comm_overlap_time",
    "backward_compute_time_start",
    "backward_compute_time_end",
    "backward_comm_time_start",
    "backward_comm_time_end",
)
LIST_KEYS = ("bucket_sizes", "rebuilt_bucket_sizes")
LAST_BUCKET_CAP = "DDP_SET_LAST_BUCKET_CAP"


def linear_stack(
    width: int = 256, depth: int = 6, *, batchnorm: bool = False, seed: int = 0
) -> nn.Sequential:
    """``depth`` × Linear(width, width) with tanh between (BatchNorm1d after each if asked).

    Every layer is one weight and one bias, all the same size, so bucket boundaries are easy to
    read off parameter counts; ``batchnorm`` gives the model buffers (running statistics).
    """
    for name, v in (("width", width), ("depth", depth)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if batchnorm:
            layers.append(nn.BatchNorm1d(width))
        if i < depth - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def probe_batch(width: int, batch: int, seed: int) -> torch.Tensor:
    """A ``batch`` x ``width`` batch of standard normals, the same for the same ``seed``."""
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(seed))


def probe_loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The probes' loss: the mean square of the output (every parameter gets a gradient)."""
    return net(x).pow(2).mean()


@contextlib.contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (or, with None, unset) an environment variable inside the block, then restore it.

    A warm ``dplab.Cluster`` reuses its processes: a variable left set would change every later
    DDP built on them.
    """
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def torch_logging(ddp: nn.parallel.DistributedDataParallel) -> dict[str, Any]:
    """torch's own logging fields, bucket sizes as lists of ints (torch gives "a, b" strings).

    Times are torch's nanoseconds, as torch logs them. A key torch does not have (yet: the
    ``rebuilt_*`` ones appear with the rebuild) is left out, except that ``rebuilt_bucket_sizes``
    is ``[]`` and ``has_rebuilt_buckets`` 0 until torch rebuilds.
    """
    data = ddp._get_ddp_logging_data()
    out: dict[str, Any] = {"rebuilt_bucket_sizes": [], "has_rebuilt_buckets": 0}
    for key in LOGGING_KEYS:
        if key not in data:
            continue
        value = data[key]
        if key in LIST_KEYS:
            value = [int(v) for v in str(value).split(",") if v.strip()]
        out[key] = value
    return out
