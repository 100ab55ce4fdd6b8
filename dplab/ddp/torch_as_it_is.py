"""Torch's DDP as it is, measured on real ranks: the rank functions behind lesson 08b.

Each function runs on every rank (``dplab.launch`` / ``dplab.Cluster.run``) and returns a small
dataclass. Where torch can say something itself, the function asks torch: its
``DistributedDataParallel`` runs on the same model beside ``dplab.DDP``, and its own logging
(``_get_ddp_logging_data()``) is returned next to dplab's numbers, so a lesson checks dplab
against torch, not against dplab's own rules.

- :func:`buckets_as_torch`: iteration 0's single bucket, the rebuild after it, the 1 MiB first
  bucket (default cap only), ``DDP_SET_LAST_BUCKET_CAP=1``, MiB not MB.
- :func:`gradient_memory`: bytes of gradients + buckets with and without
  ``gradient_as_bucket_view``, dplab's and torch's.
- :func:`buffer_traffic`: what a model with buffers (BatchNorm) communicates per step.
- :func:`comm_time_side_by_side`: torch's ``backward_comm_time`` beside dplab's spans.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab._units import MIB
from dplab.ddp.ddp import DDP
from dplab.ddp.torch_probe import (
    LAST_BUCKET_CAP,
    LOGGING_KEYS,
    env_var,
    linear_stack,
    torch_logging,
)
from dplab.ddp.torch_probe import probe_batch as _batch
from dplab.ddp.torch_probe import probe_loss as _loss
from dplab.trace import StepTrace, Tracer

# -- 1. buckets: iteration 0, the rebuild, the first bucket, DDP_SET_LAST_BUCKET_CAP ------------


@dataclass
class BucketsAsTorch:
    """One rank's dplab.DDP and torch DDP on the same model, after each of the steps.

    ``traces``: dplab's traced steps (step 0 first); ``dplab_bucket_bytes[k]``: the bytes of
    each bucket dplab used in step k; ``torch_logging[k]``: torch's logging fields after step k;
    ``bucket_cap_bytes``: dplab's cap in bytes (``int(bucket_cap_mb * 2**20)``) and torch's
    ``bucket_bytes_cap`` attribute; ``grad_diff[k]``: the largest |dplab − torch| gradient
    difference after step k (both average the same two local gradients).
    """

    traces: list[StepTrace]
    dplab_bucket_bytes: list[list[int]]
    dplab_bucket_params: list[list[int]]
    torch_logging: list[dict[str, Any]]
    bucket_cap_mb: float | None
    dplab_bucket_cap_bytes: int
    torch_bucket_bytes_cap: int
    grad_diff: list[float]
    last_bucket_cap: bool

    @property
    def torch_bucket_bytes(self) -> list[int]:
        """The buckets torch reduced with after the steps: rebuilt ones if it rebuilt."""
        last = self.torch_logging[-1]
        return last["rebuilt_bucket_sizes"] if last["has_rebuilt_buckets"] else last["bucket_sizes"]


def buckets_as_torch(
    *,
    width: int = 256,
    depth: int = 6,
    bucket_cap_mb: float | None = None,
    last_bucket_cap: bool = False,
    steps: int = 3,
    batch: int = 8,
    seed: int = 0,
) -> BucketsAsTorch:
    """dplab.DDP and torch DDP, both with torch's defaults (and ``bucket_cap_mb`` if given),
    ``steps`` steps each, interleaved; dplab's traces and buckets beside torch's logging.

    ``last_bucket_cap``: run both with ``DDP_SET_LAST_BUCKET_CAP=1`` (set on this rank before
    either DDP is built, restored afterwards: torch and dplab read it at the rebuild).
    """
    rank = dist.get_rank()
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    with env_var(LAST_BUCKET_CAP, "1" if last_bucket_cap else None):
        tracer = Tracer()
        ours = DDP(linear_stack(width, depth, seed=seed), tracer=tracer, **kwargs)
        theirs = nn.parallel.DistributedDataParallel(
            linear_stack(width, depth, seed=seed), **kwargs
        )
        byte_sizes, param_counts, logged, diffs = [], [], [], []
        for step in range(steps):
            x = _batch(width, batch, seed + 1000 * step + rank)
            for net in (ours, theirs):
                net.zero_grad(set_to_none=False)
                _loss(net, x).backward()
            byte_sizes.append([b.nbytes for b in ours.buckets])
            param_counts.append([len(b.param_names) for b in ours.buckets])
            logged.append(torch_logging(theirs))
            diffs.append(
                max(
                    (a.grad - b.grad).abs().max().item()
                    for a, b in zip(
                        ours.module.parameters(), theirs.module.parameters(), strict=True
                    )
                )
            )
        traces = tracer.steps
    return BucketsAsTorch(
        traces=traces,
        dplab_bucket_bytes=byte_sizes,
        dplab_bucket_params=param_counts,
        torch_logging=logged,
        bucket_cap_mb=bucket_cap_mb,
        dplab_bucket_cap_bytes=int(ours.bucket_cap_mb * MIB),
        torch_bucket_bytes_cap=int(theirs.bucket_bytes_cap),
        grad_diff=diffs,
        last_bucket_cap=last_bucket_cap,
    )


# -- 2. gradient_as_bucket_view: the second copy of the gradients ------------------------------


def _storages(tensors: Sequence[torch.Tensor]) -> dict[int, int]:
    """Distinct storages among ``tensors``: data pointer → bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


@dataclass
class GradMemory:
    """Gradient memory after one synchronised step, in bytes, with and without bucket views.

    ``dplab[view]``: distinct storages among dplab's bucket buffers and ``.grad`` tensors.
    ``torch_grad_storages[view]``: distinct storages among torch DDP's ``.grad`` tensors (its
    bucket buffers are internal); ``torch_bucket_bytes[view]``: torch's logged bucket sizes, so
    torch's total is ``grad storages + buckets`` when its grads are their own tensors and just the
    grad storages when they are views of the buckets. ``param_bytes``: one copy of the gradients.
    """

    param_bytes: int
    dplab: dict[bool, int]
    torch_grad_storages: dict[bool, int]
    torch_grad_storage_count: dict[bool, int]
    torch_bucket_bytes: dict[bool, list[int]]

    def torch_total(self, view: bool) -> int:
        storages = self.torch_grad_storages[view]
        return storages if view else storages + sum(self.torch_bucket_bytes[view])


def gradient_memory(*, width: int = 256, depth: int = 6, batch: int = 8) -> GradMemory:
    """Three steps of dplab.DDP and torch DDP with each ``gradient_as_bucket_view``; the bytes.

    Three because torch's logging shows ``rebuilt_bucket_sizes`` only from the step after the
    rebuild (the rebuild itself is at step 1's forward)."""
    rank = dist.get_rank()
    dplab_bytes, torch_bytes, torch_count, torch_buckets = {}, {}, {}, {}
    param_bytes = 0
    for view in (False, True):
        ours = DDP(linear_stack(width, depth), gradient_as_bucket_view=view)
        theirs = nn.parallel.DistributedDataParallel(
            linear_stack(width, depth), gradient_as_bucket_view=view
        )
        for step in range(3):
            x = _batch(width, batch, 1000 * step + rank)
            for net in (ours, theirs):
                net.zero_grad(set_to_none=False)
                _loss(net, x).backward()
        grads = [p.grad for p in ours.module.parameters()]
        param_bytes = sum(g.numel() * g.element_size() for g in grads)
        dplab_bytes[view] = sum(_storages([*ours.bucket_buffers, *grads]).values())
        theirs_grads = _storages([p.grad for p in theirs.module.parameters()])
        torch_bytes[view] = sum(theirs_grads.values())
        torch_count[view] = len(theirs_grads)
        log = torch_logging(theirs)
        torch_buckets[view] = log["rebuilt_bucket_sizes"]
    return GradMemory(param_bytes, dplab_bytes, torch_bytes, torch_count, torch_buckets)


# -- 3. broadcast_buffers: buffers move every step ----------------------------------------------


@dataclass
class BufferTraffic:
    """What one rank handed to collectives in each step of a model with BatchNorm buffers.

    ``per_step[k][op]``: bytes per collective op in step k (``broadcast``, ``all_reduce``);
    ``buffer_bytes`` / ``grad_bytes``: the model's buffers and gradients, counted from the model;
    ``torch_synced``: torch DDP made rank 1's perturbed running mean rank 0's at the next forward
    (torch broadcasts buffers too; its C++ broadcast is not seen by a Python-level counter).
    """

    broadcast_buffers: bool
    per_step: list[dict[str, int]]
    buffer_bytes: int
    grad_bytes: int
    rebuild_order_bytes: int
    torch_synced: bool | None


def buffer_traffic(
    counter: Callable[[], Any],
    *,
    broadcast_buffers: bool = True,
    width: int = 64,
    depth: int = 3,
    batch: int = 8,
    steps: int = 3,
) -> BufferTraffic:
    """Count every collective's bytes, step by step, for dplab.DDP on a BatchNorm model.

    ``counter`` makes a collective counter: pass ``dplab.mechanics.CommCounter`` (it lives in a
    higher layer, so this function takes it as an argument). The rebuild's one broadcast of the
    ready order (int64 per parameter, step 1's forward) is reported apart.
    """
    rank = dist.get_rank()
    model = linear_stack(width, depth, batchnorm=True)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = DDP(model, broadcast_buffers=broadcast_buffers)
    per_step = []
    with counter() as count:
        for step in range(steps):
            with count.phase(f"step {step}"):
                ddp.zero_grad(set_to_none=False)
                _loss(ddp, _batch(width, batch, 1000 * step + rank)).backward()
    for step in range(steps):
        phase = f"step {step}"
        per_step.append({op: count.nbytes(op, phase) for op in ("broadcast", "all_reduce")})
    torch_synced = None
    if broadcast_buffers:
        theirs = nn.parallel.DistributedDataParallel(linear_stack(width, depth, batchnorm=True))
        torch_synced = _buffers_started_equal(theirs, width, batch, rank)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    return BufferTraffic(
        broadcast_buffers=broadcast_buffers,
        per_step=per_step,
        buffer_bytes=buffer_bytes,
        grad_bytes=grad_bytes,
        rebuild_order_bytes=n_params * 8,
        torch_synced=torch_synced,
    )


def _buffers_started_equal(
    theirs: nn.parallel.DistributedDataParallel, width: int, batch: int, rank: int
) -> bool:
    """Give each rank its own running mean, run one training forward on the SAME batch on every
    rank, and check the running means agree after it: they can only if torch broadcast rank 0's
    buffers before that forward (the update is running = 0.9 * running + 0.1 * batch mean)."""
    bn = next(m for m in theirs.module.modules() if isinstance(m, nn.BatchNorm1d))
    with torch.no_grad():
        bn.running_mean.fill_(float(rank + 1))
    _loss(theirs, _batch(width, batch, 12345)).backward()
    gathered = [torch.zeros_like(bn.running_mean) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, bn.running_mean.detach().clone())
    return all(torch.equal(g, gathered[0]) for g in gathered)


# -- 4. torch's backward_comm_time beside dplab's spans ----------------------------------------


@dataclass
class CommTimes:
    """Per step (after the rebuild), in ms: torch's logged times and dplab's traced ones.

    torch (its reducer's timer, on its own DDP): ``backward_comm`` = first bucket launched →
    the end of the wait for the last one; ``backward_compute`` = backward's start → its end;
    ``overlap`` = the part of the comm interval inside the compute interval.
    dplab (the Tracer, on dplab.DDP): ``union`` = the union of the all-reduce spans (what
    ``StepMetrics.t_comm_ms`` is; time no all-reduce runs is not counted), ``launch_to_wait`` =
    the first bucket ready (its launch) → the end of the wait, torch's definition, and
    ``first_to_last`` = the first all-reduce start → the last all-reduce end.
    """

    torch_ms: dict[str, list[float]] = field(default_factory=dict)
    dplab_ms: dict[str, list[float]] = field(default_factory=dict)

    def medians(self) -> dict[str, float]:
        out = {f"torch {k}": statistics.median(v) for k, v in self.torch_ms.items()}
        out.update({f"dplab {k}": statistics.median(v) for k, v in self.dplab_ms.items()})
        return out


def launch_to_wait_ms(trace: StepTrace) -> float:
    """torch's backward_comm_time on a dplab trace: first launch (bucket 0 ready) → wait end."""
    ready = [s.start_ms for s in trace.of("bucket_ready")]
    waits = [s.end_ms for s in trace.of("wait")]
    if not ready or not waits:
        raise ValueError(f"step {trace.step} has no launched bucket or no wait span")
    return max(waits) - min(ready)


def first_to_last_ms(trace: StepTrace) -> float:
    """First all-reduce start → last all-reduce end (gaps between collectives included)."""
    spans = trace.of("allreduce")
    if not spans:
        raise ValueError(f"step {trace.step} has no all-reduce span")
    return max(s.end_ms for s in spans) - min(s.start_ms for s in spans)


def comm_time_side_by_side(
    *, width: int = 512, depth: int = 8, batch: int = 32, steps: int = 5, seed: int = 0
) -> CommTimes:
    """torch DDP and dplab.DDP on one model, steps interleaved; torch logs iterations 1-10, so
    ``steps`` + 2 warm-up steps must stay <= 10."""
    if not 1 <= steps <= 8:
        raise ValueError(f"steps must be 1..8 (torch logs only iterations 1-10), got {steps!r}")
    rank = dist.get_rank()
    tracer = Tracer()
    ours = DDP(linear_stack(width, depth, seed=seed), tracer=tracer)
    theirs = nn.parallel.DistributedDataParallel(linear_stack(width, depth, seed=seed))
    out = CommTimes(
        torch_ms={"backward_comm": [], "backward_compute": [], "overlap": []},
        dplab_ms={"union": [], "launch_to_wait": [], "first_to_last": [], "backward": []},
    )
    warmup = 2
    for step in range(warmup + steps):
        x = _batch(width, batch, seed + 1000 * step + rank)
        for net in (ours, theirs) if step % 2 == 0 else (theirs, ours):
            net.zero_grad(set_to_none=False)
            dist.barrier()
            _loss(net, x).backward()
        if step >= warmup:
            log = torch_logging(theirs)
            out.torch_ms["backward_comm"].append(log["backward_comm_time"] / 1e6)
            out.torch_ms["backward_compute"].append(log["backward_compute_time"] / 1e6)
            out.torch_ms["overlap"].append(log["backward_compute_comm_overlap_time"] / 1e6)
    for trace in tracer.steps[warmup:]:
        out.dplab_ms["union"].append(trace.metrics.t_comm_ms)
        out.dplab_ms["launch_to_wait"].append(launch_to_wait_ms(trace))
        out.dplab_ms["first_to_last"].append(first_to_last_ms(trace))
        out.dplab_ms["backward"].append(trace.metrics.t_backward_ms)
    return out


__all__ = [
    "LAST_BUCKET_CAP",
    "LOGGING_KEYS",
    "BucketsAsTorch",
    "BufferTraffic",
    "CommTimes",
    "GradMemory",
    "buckets_as_torch",
    "buffer_traffic",
    "comm_time_side_by_side",
    "env_var",
    "first_to_last_ms",
    "gradient_memory",
    "launch_to_wait_ms",
    "linear_stack",
    "torch_logging",
]
