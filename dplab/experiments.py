"""Rank functions that the notebooks, widgets, CLI and benchmarks launch.

Each runs on every rank (inside :func:`dplab.launch` or a :class:`dplab.Cluster`) and returns
plain data: lists of ``StepTrace.to_dict()`` and numbers, which travel back to the caller cheaply.
``traces(results)`` turns what the ranks returned into ``StepTrace`` objects again.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab.ddp import DDP, NaiveDDP, PerParameterDDP
from dplab.launch import device as rank_device
from dplab.models import MODELS, make_batch, make_model
from dplab.trace import StepTrace, Tracer

VARIANTS = {"bucketed": DDP, "per_parameter": PerParameterDDP, "naive": NaiveDDP}


def _check(model: str, variant: str, steps: int, warmup: int, micro_batches: int) -> None:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if steps < 1 or warmup < 0 or micro_batches < 1:
        raise ValueError(
            f"need steps >= 1, warmup >= 0, micro_batches >= 1; got steps={steps}, "
            f"warmup={warmup}, micro_batches={micro_batches}"
        )


def wrap(module: nn.Module, variant: str, tracer: Tracer | None, **ddp_kwargs: Any) -> DDP:
    """``module`` in the DDP of ``variant`` (bucketed, per_parameter or naive)."""
    cls = VARIANTS[variant]
    if cls is not DDP:
        ddp_kwargs = {k: v for k, v in ddp_kwargs.items() if "cap" not in k}
    return cls(module, tracer=tracer, **ddp_kwargs)


def train_step(ddp: nn.Module, opt: torch.optim.Optimizer, x, y, micro_batches: int) -> float:
    """One optimizer step over ``micro_batches`` micro-batches, all but the last under no_sync."""
    total = 0.0
    xs, ys = x.chunk(micro_batches), y.chunk(micro_batches)
    for i, (xm, ym) in enumerate(zip(xs, ys, strict=True)):
        quiet = ddp.no_sync() if i < micro_batches - 1 else contextlib.nullcontext()
        with quiet:
            loss = ddp(xm, ym) / micro_batches
            loss.backward()
        total += loss.item()
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
) -> list[dict[str, Any]]:
    """Train ``steps`` traced steps after ``warmup`` ones; return this rank's StepTrace dicts.

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
    return [s.to_dict() for s in tracer.steps]


def traces(results: list[list[dict[str, Any]]]) -> list[list[StepTrace]]:
    """Per-rank lists of dicts (as the ranks return them) → per-rank lists of StepTrace."""
    return [[StepTrace.from_dict(d) for d in rank_steps] for rank_steps in results]


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
) -> dict[str, Any]:
    """dplab.DDP and torch DDP on the same model, same caps, steps interleaved one by one.

    Returns the first step's largest gradient difference, each side's step times, dplab's
    traced metrics and torch's own logging fields (``_get_ddp_logging_data``, ns → ms) for the
    same iterations. torch logs iterations 1-10 and then every 100th, so keep ``steps`` <= 9.
    First-bucket caps are equal on both sides: torch only shrinks the first bucket to 1 MiB
    when ``bucket_cap_mb`` is left at its default.
    """
    _check(model, "bucketed", steps, 0, 1)
    tracer = Tracer()
    dev = rank_device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ours = DDP(
        make_model(model, seed=seed).to(dev),
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=bucket_cap_mb,
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
    dplab_steps = tracer.steps[1:]
    return {
        "grad_diff": grad_diff,
        "step_ms": times,
        "dplab_metrics": [s.metrics.to_dict() for s in dplab_steps],
        "dplab_traces": [s.to_dict() for s in dplab_steps],
        "torch_logging_ms": logged,
    }
