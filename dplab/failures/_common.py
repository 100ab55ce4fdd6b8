"""What every failure here needs: a group that gives up in seconds, and a replica's fingerprint.

A failure that waits (a rank in a collective its partner never joins) must end in seconds, not
the 30 minutes of a default gloo group, and must leave the rank usable: so each experiment runs
on a fresh gloo group with a short ``timeout``, made and destroyed inside the rank function. The
pool's default group is never touched, so a timed-out collective cannot poison the next cell.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab import _checks

# The longest any failure here may wait before it is declared (issue 26: bounded, <= 15 s).
MAX_WAIT_S = 15.0


def check_wait(name: str, seconds: Any) -> float:
    """A wait of ``seconds`` in (0, MAX_WAIT_S]: a failure must be caught in seconds."""
    value = _checks.check_positive(name, seconds)
    if value > MAX_WAIT_S:
        raise ValueError(
            f"{name}={value:g} s is longer than the {MAX_WAIT_S:g} s a failure may wait"
        )
    return value


@contextlib.contextmanager
def short_group(group_timeout_s: float, *, debug: str = "OFF") -> Iterator[Any]:
    """A fresh gloo group of every rank whose collectives raise after ``group_timeout_s``.

    A DDP built on the group must be gone (``del model``) before the block ends: one torn down
    after its group was destroyed can hang its rank (3 runs in 100 of §8e's two-forwards
    experiment did, on this machine; 0 in 300 once the DDP went first).

    ``debug`` is torch's ``TORCH_DISTRIBUTED_DEBUG`` level (OFF, INFO, DETAIL), set for the
    block: torch reads it when a group is made (DETAIL wraps the group in a checker of every
    collective) and when DDP is built (INFO names unused parameters). Setting it here is what the
    environment variable does at start-up, for one experiment only.
    """
    group_timeout_s = check_wait("group_timeout_s", group_timeout_s)
    levels = dist.DebugLevel.__members__
    if debug not in levels:
        raise ValueError(f"debug must be one of {sorted(levels)}, got {debug!r}")
    before = dist.get_debug_level()
    dist.set_debug_level(levels[debug])
    group = None
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=group_timeout_s))
        yield group
    finally:
        if group is not None:
            # Every rank leaves together (a barrier on the pool's own group): a rank that
            # skipped a collective must not close its sockets under a partner still waiting in
            # it, which would turn that partner's timeout into a "connection closed".
            dist.barrier()
            dist.destroy_process_group(group)
        dist.set_debug_level(before)


def replica_digest(module: nn.Module) -> str:
    """A short fingerprint of every parameter's bytes: equal replicas have equal digests."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def every_rank(value: Any, group: Any = None) -> list[Any]:
    """``value`` from every rank, by rank (all_gather_object on ``group``)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def first_line(error: BaseException) -> str:
    """The message's first line: enough to assert on, short enough to print."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def mlp(width: int = 16, depth: int = 3, *, seed: int = 0) -> nn.Sequential:
    """A small MLP, equal on every rank for one seed (DDP broadcasts rank 0's anyway)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)
