"""Run N ranks from a notebook cell, a script, the CLI, or inside torchrun.

Why not ``torch.multiprocessing.spawn``? A function defined in a notebook cell lives in
``__main__``, and a spawned child cannot import the kernel's ``__main__``: the child fails with
"Can't get attribute ... on <module '__main__'>". So the function travels *by value*
(cloudpickle) to rank processes that we start ourselves with ``python -m dplab._worker``.

One idea per module:

- :mod:`~dplab.launch.errors`: :class:`RankError`, :class:`RankTimeout`;
- :mod:`~dplab.launch.protocol`: the wire protocol with the ranks, and :func:`pickle_call`;
- :mod:`~dplab.launch.capacity`: the checks made before any rank starts;
- :mod:`~dplab.launch.collect`: the state machine that collects the ranks' replies (shared with
  :mod:`dplab.nodes`);
- :mod:`~dplab.launch.output`: what ranks print, relayed and capped;
- :mod:`~dplab.launch.cluster`: the warm pool :class:`Cluster`;
- :mod:`~dplab.launch.processes`: a rank process (its environment, start, log folder, exit);
- :mod:`~dplab.launch.stacks`: where a stuck rank is, from its faulthandler dump;
- :mod:`~dplab.launch.torchrun`: running in place under torchrun, and :func:`device`;
- :mod:`~dplab.launch.history`: closing pools that only IPython's output history still holds.

``dplab.launch`` the attribute of ``dplab`` is the function below; this package is reached as
``importlib.import_module("dplab.launch")`` or ``from dplab.launch import …``.
What each fault gives, and how fast, is in docs/reliability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dplab.env import gpu_count, in_torchrun, resolve_backend
from dplab.launch.capacity import (
    RANK_MEMORY_BYTES,
    RANKS_PER_CORE,
    check_capacity,
    check_timeout,
    check_world_size,
)
from dplab.launch.cluster import Cluster
from dplab.launch.collect import ERROR_GRACE_S, Replies
from dplab.launch.errors import RankError, RankTimeout
from dplab.launch.protocol import pickle_call
from dplab.launch.torchrun import (
    DEFAULT_TIMEOUT_S,
    LAUNCHER_VARIABLES,
    check_launcher_env,
    device,
    run_in_place,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ERROR_GRACE_S",
    "LAUNCHER_VARIABLES",
    "RANKS_PER_CORE",
    "RANK_MEMORY_BYTES",
    "Cluster",
    "RankError",
    "RankTimeout",
    "Replies",
    "check_capacity",
    "check_launcher_env",
    "check_timeout",
    "check_world_size",
    "device",
    "gpu_count",
    "in_torchrun",
    "launch",
    "pickle_call",
    "resolve_backend",
]


def launch(
    fn: Callable,
    world_size: int,
    *,
    backend: str = "auto",
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    oversubscribe: bool = False,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return results by rank.

    Each rank has ``torch.distributed`` initialised (gloo or nccl) before ``fn`` runs; under nccl
    rank r owns ``cuda:r`` (see :func:`device`). Under torchrun the call runs ``fn`` in place on
    this process's rank and returns the list of all ranks' results.
    """
    check_world_size(world_size)
    timeout_s = check_timeout(timeout_s)
    if in_torchrun():
        return run_in_place(fn, world_size, backend, tuple(args), dict(kwargs or {}), timeout_s)
    check_capacity(world_size, oversubscribe=oversubscribe)
    pickle_call(fn, tuple(args), kwargs)  # fail fast, before paying for processes
    with Cluster(world_size, backend=backend, timeout_s=timeout_s, oversubscribe=True) as cluster:
        return cluster.run(fn, *args, **(kwargs or {}))
