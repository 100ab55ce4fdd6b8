"""§5 Collective desync: ranks that issue different collectives can never meet.

Collectives pair up by *order*: every rank's n-th collective on a group must be the same call
with the same shapes. A rank-dependent ``if`` around an all-reduce, or metrics logged with
different keys on different ranks, breaks that. Two real tools see it:

- ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps every group in a checker that first compares each
  collective's *fingerprint* (sequence number, op, shapes, dtypes) across ranks, and raises
  "Detected mismatch between collectives on ranks" naming both sides.
- torch's flight recorder (``TORCH_FR_BUFFER_SIZE=N`` at start-up) keeps each rank's last N
  collectives with their sequence id, op, sizes and state; dumping every rank's and comparing
  the last entries shows which rank went one further. This torch (2.13) records gloo
  collectives too (``profiling_name`` ``gloo:all_reduce``); an older one may record only NCCL's,
  so :func:`flight_recorder_on` checks rather than assumes.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dplab import _checks
from dplab.failures._common import short_group

FR_VARIABLE = "TORCH_FR_BUFFER_SIZE"


def flight_recorder_on() -> bool:
    """Whether this process records collectives (the variable must be set before torch starts)."""
    return int(os.environ.get(FR_VARIABLE, "0") or 0) > 0


@dataclass(frozen=True)
class Recorded:
    """One flight-recorder entry: the group's collective number, what it was, and how it ended."""

    seq: int
    op: str
    sizes: tuple[tuple[int, ...], ...]
    state: str


def flight_record(group: object) -> list[Recorded]:
    """This rank's recorded collectives on ``group``, oldest first (empty if not recording)."""
    if not flight_recorder_on():
        return []
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    name = dist._get_process_group_name(group)
    return [
        Recorded(
            int(e["collective_seq_id"]),
            str(e["profiling_name"]),
            tuple(tuple(s) for s in e["input_sizes"]),
            str(e["state"]),
        )
        for e in dump.get("entries", [])
        if e.get("process_group", ("",))[0] == name and e.get("collective_seq_id", 0) > 0
    ]


@dataclass(frozen=True)
class DesyncRun:
    """One rank's side: the error it got (None if none), and its flight record of the group."""

    error: str | None
    record: tuple[Recorded, ...]


def rank_dependent_allreduce(*, fixed: bool, group_timeout_s: float = 2.0) -> DesyncRun:
    """Rank function: both ranks all-reduce the loss; then only rank 0 all-reduces a metric.

    The bug is ``if rank == 0: all_reduce(metric)``; rank 0 waits for a partner that never
    comes, until the group's ``timeout``. The fix issues the all-reduce on every rank and lets
    rank 0 alone *use* the result.
    """
    rank = dist.get_rank()
    error = None
    with short_group(group_timeout_s) as group:
        dist.all_reduce(torch.ones(4), group=group)  # the loss, on every rank
        try:
            if fixed or rank == 0:
                dist.all_reduce(torch.ones(2), group=group)  # the metric
        except RuntimeError as e:
            error = str(e)
        record = tuple(flight_record(group))
    return DesyncRun(error, record)


METRICS = ("loss", "accuracy", "grad_norm")


def metrics_by_rank(rank: int) -> dict[str, float]:
    """What a rank logs: rank 0 also measured the gradient norm this step (others did not)."""
    metrics = {"loss": 1.0 + rank, "accuracy": 0.5}
    if rank == 0:
        metrics["grad_norm"] = 3.0
    return metrics


def mismatched_metrics(
    *, fixed: bool, debug: str = "DETAIL", group_timeout_s: float = 3.0
) -> str | None:
    """Rank function: all-reduce each rank's logged metrics; return the error text (or None).

    The bug sends ``list(metrics.values())``, whose length differs by rank. The fix sends the
    agreed key list ``METRICS``, 0 where a rank has no value, so every rank's tensor matches.
    """
    _checks.check_choice("debug", debug, ("OFF", "INFO", "DETAIL"))
    if debug == "OFF" and not fixed:
        # Mismatched sizes on a bare gloo group are undefined behaviour (garbage, a crash).
        raise ValueError("the unfixed run needs debug='DETAIL' (without it gloo may crash)")
    metrics = metrics_by_rank(dist.get_rank())
    values = [metrics.get(k, 0.0) for k in METRICS] if fixed else list(metrics.values())
    with short_group(group_timeout_s, debug=debug) as group:
        try:
            dist.all_reduce(torch.tensor(values), group=group)
        except RuntimeError as e:
            return str(e)
    return None
