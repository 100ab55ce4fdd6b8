"""Rank functions that train and trace DDP steps (what notebooks, widgets and the CLI launch).

Each runs on every rank (inside :func:`dplab.launch` or a :class:`dplab.Cluster`) and returns
typed values (``StepTrace`` objects), which pickle back to the caller as they are: the caller
gets per-rank lists of ``StepTrace`` with no conversion step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab._checks import check_choice, check_count, check_positive_int
from dplab.ddp.accumulation import accumulate
from dplab.ddp.ddp import DDP
from dplab.ddp.names import VARIANT_NAMES
from dplab.ddp.variants import ForwardOrderDDP, NaiveDDP, PerParameterDDP
from dplab.launch import device as rank_device
from dplab.models import MODELS, make_batch, make_model
from dplab.trace import StepMetrics, StepTrace, Tracer

VARIANTS = {
    "bucketed": DDP,
    "forward_order": ForwardOrderDDP,
    "per_parameter": PerParameterDDP,
    "naive": NaiveDDP,
}
assert tuple(VARIANTS) == VARIANT_NAMES, "dplab/ddp/names.py lists the variants the CLI offers"


def _check(model: str, variant: str, steps: int, warmup: int, micro_batches: int) -> None:
    check_choice("model", model, MODELS)
    check_choice("variant", variant, VARIANTS)
    check_positive_int("steps", steps)
    check_count("warmup", warmup)
    check_positive_int("micro_batches", micro_batches)


def wrap(module: nn.Module, variant: str, tracer: Tracer | None, **ddp_kwargs: Any) -> DDP:
    """``module`` in the DDP of ``variant`` (bucketed, forward_order, per_parameter or naive).

    Every variant takes DDP's arguments: the per-parameter and naive ones accept the bucket caps
    and ignore them (one tensor per all-reduce), so nothing is filtered here.
    """
    return VARIANTS[variant](module, tracer=tracer, **ddp_kwargs)


def train_step(ddp: nn.Module, opt: torch.optim.Optimizer, x, y, micro_batches: int) -> float:
    """One optimizer step over ``micro_batches`` micro-batches, all but the last under no_sync."""
    batches = list(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True))
    total = accumulate(ddp, batches)
    opt.step()
    opt.zero_grad(set_to_none=False)
    return total


def measure_ddp(
    model: str = "tiny-gpt",
    *,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    variant: str = "bucketed",
    steps: int = 3,
    warmup: int = 1,
    batch_size: int = 8,
    micro_batches: int = 1,
    rebuild_buckets: bool = False,
    seed: int = 0,
) -> list[StepTrace]:
    """Train ``steps`` traced steps after ``warmup`` ones; return this rank's traced steps.

    ``batch_size`` is the local batch of each rank (B_local); each rank draws its own data.
    """
    _check(model, variant, steps, warmup, micro_batches)
    tracer = Tracer()
    tracer.meta = {
        "model": model,
        "variant": variant,
        "bucket_cap_mb": bucket_cap_mb,
        "first_bucket_cap_mb": first_bucket_cap_mb,
        "batch_size": batch_size,
        "micro_batches": micro_batches,
    }
    dev = rank_device()  # cuda:LOCAL_RANK under NCCL, else the CPU
    ddp = wrap(
        make_model(model, seed=seed).to(dev),
        variant,
        tracer,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        rebuild_buckets=rebuild_buckets,
    )
    opt = tracer.watch(torch.optim.SGD(ddp.parameters(), lr=1e-3))
    rank = dist.get_rank()
    for step in range(warmup + steps):
        if step == warmup:
            tracer.clear()
        x, y = make_batch(model, batch_size, seed=seed + 1000 * step + rank)
        train_step(ddp, opt, x.to(dev), y.to(dev), micro_batches)
    return list(tracer.steps)


@dataclass
class TorchComparison:
    """One rank's side-by-side of dplab.DDP and torch DDP (see :func:`compare_with_torch`).

    ``grad_diff``: the first step's largest gradient difference; ``step_ms``: each side's step
    times (``"dplab"``, ``"torch"``); ``dplab_traces``: dplab's traced steps; ``torch_logging_ms``:
    torch's own logging fields for the same iterations, in ms.
    """

    grad_diff: float
    step_ms: dict[str, list[float]]
    dplab_traces: list[StepTrace]
    torch_logging_ms: list[dict[str, float]]

    @property
    def dplab_metrics(self) -> list[StepMetrics]:
        return [t.metrics for t in self.dplab_traces]


TORCH_LOGGING_FIELDS = (
    "forward_compute_time",
    "backward_compute_time",
    "backward_comm_time",
    "backward_compute_comm_overlap_time",
)


def compare_with_torch(
    model: str = "tiny-gpt",
    *,
    bucket_cap_mb: float = 25.0,
    steps: int = 6,
    batch_size: int = 8,
    seed: int = 0,
) -> TorchComparison:
    """dplab.DDP and torch DDP on the same model, same caps, steps interleaved one by one.

    Returns the first step's largest gradient difference, each side's step times, dplab's
    traced metrics and torch's own logging fields (``_get_ddp_logging_data``, ns → ms) for the
    same iterations. torch logs iterations 1-10 and then every 100th, so keep ``steps`` <= 9.
    Both are built with the same arguments, so they cut the same buckets: one bucket in the
    warm-up step, then the rebuild in the order the gradients arrived.
    """
    _check(model, "bucketed", steps, 0, 1)
    tracer = Tracer()
    dev = rank_device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ours = DDP(
        make_model(model, seed=seed).to(dev),
        bucket_cap_mb=bucket_cap_mb,
        tracer=tracer,
    )
    theirs = nn.parallel.DistributedDataParallel(
        make_model(model, seed=seed).to(dev),
        device_ids=[dev.index] if dev.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
    )
    opts = {
        "dplab": torch.optim.SGD(ours.parameters(), lr=1e-3),
        "torch": torch.optim.SGD(theirs.parameters(), lr=1e-3),
    }
    tracer.watch(opts["dplab"])
    rank = dist.get_rank()
    x, y = (t.to(dev) for t in make_batch(model, batch_size, seed=seed + rank))
    for net in (ours, theirs):  # a warm-up step on both, which lets torch rebuild its buckets
        net(x, y).backward()
    grad_diff = max(
        (a.grad - b.grad).abs().max().item()
        for a, b in zip(ours.module.parameters(), theirs.module.parameters(), strict=True)
    )
    for opt in opts.values():
        opt.step()
        opt.zero_grad(set_to_none=False)
    times: dict[str, list[float]] = {"dplab": [], "torch": []}
    logged: list[dict[str, float]] = []
    for step in range(1, steps + 1):
        x, y = (t.to(dev) for t in make_batch(model, batch_size, seed=seed + 1000 * step + rank))
        for name in ("dplab", "torch") if step % 2 else ("torch", "dplab"):
            net = ours if name == "dplab" else theirs
            dist.barrier()
            sync()  # on a GPU the host only enqueues: time the work, not the enqueueing
            t0 = time.perf_counter()
            net(x, y).backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=False)
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3)
        data = theirs._get_ddp_logging_data()
        logged.append({f: data.get(f, 0) / 1e6 for f in TORCH_LOGGING_FIELDS})
    return TorchComparison(
        grad_diff=grad_diff,
        step_ms=times,
        dplab_traces=list(tracer.steps[1:]),
        torch_logging_ms=logged,
    )
