"""One configurable data-parallel training run, with the knobs that §3's claims turn.

:func:`train_run` is a rank function (it also runs in a plain process as world size 1). Every
rank draws the same global batch for each step from the seed, takes its shard, cuts the shard
into A micro-batches, and steps. Flags switch on the classic mistakes (``no_sync=False``,
``scale_loss=False``) or switch off the all-reduce altogether (``synchronise=False``), and the
run returns what the claims need: the weights and their hash, every collective it made
(counted by :class:`~dplab.mechanics.traffic.CommCounter`), and the first step's gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab._checks import check_positive_int
from dplab.ddp import DDP, accumulate, first_bucket_cap
from dplab.mechanics._common import (
    as_dtype,
    flat_grads,
    flat_params,
    params_hash,
    rank_and_world,
    shard,
)
from dplab.mechanics.batch import local_batch_size
from dplab.mechanics.traffic import CommCounter
from dplab.models import make_batch, make_model


def broadcast_from_rank0(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank's model (what DDP does once)."""
    _, n = rank_and_world()
    if n == 1:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=0)


def local_gradient_l1(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], *, scale_loss: bool
) -> float:
    """Sum of |g| of this rank's own gradient for ``batches``, on a plain copy of the replica.

    The oracle for "DDP sends the gradients": computed without DDP (a fresh model loaded with the
    replica's weights, so no DDP hook is copied along), the same micro-batches and loss scaling.
    """
    plain = make_model("mlp", dtype=next(model.parameters()).dtype)
    plain.load_state_dict(model.state_dict())
    for x, y in batches:
        loss = plain(x, y)
        (loss / len(batches) if scale_loss else loss).backward()
    return sum(float(p.grad.abs().double().sum()) for p in plain.parameters() if p.grad is not None)


def step_batches(
    step: int, *, global_batch: int, accum: int, seed: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's A micro-batches for ``step``: the step's global batch, my shard, cut A ways."""
    rank, n = rank_and_world()
    x, y = make_batch("mlp", global_batch, seed=seed + 1 + step, dtype=dtype)
    xs, ys = shard(x, rank, n), shard(y, rank, n)
    return list(zip(xs.chunk(accum), ys.chunk(accum), strict=True))


def train_run(
    *,
    global_batch: int = 32,
    accum: int = 1,
    steps: int = 3,
    lr: float = 0.05,
    dtype: Any = "float64",
    seed: int = 0,
    no_sync: bool = True,
    scale_loss: bool = True,
    synchronise: bool = True,
    different_init: bool = False,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float | None = None,
) -> dict[str, Any]:
    """Rank function: ``steps`` SGD steps of the MLP on B_global = B_local × N × A.

    ``different_init``: each rank initialises from its own seed, to show that DDP's broadcast
    makes the replicas equal anyway. ``synchronise=False``: broadcast the weights once, then
    train each replica on its own shard with no all-reduce (the replicas drift apart).
    ``first_bucket_cap_mb`` defaults to the smaller of 1 MiB (torch's) and ``bucket_cap_mb``.
    """
    check_positive_int("steps", steps)
    dt = as_dtype(dtype)
    rank, n = rank_and_world()
    b_local = local_batch_size(global_batch, n, accum)
    model = make_model("mlp", seed=seed + (1 + rank if different_init else 0), dtype=dt)
    hashes = {"initial": params_hash(model)}
    counter = CommCounter()
    losses, first_grad, local_l1 = [], None, []
    with counter:
        with counter.phase("construction"):
            if n > 1 and synchronise:
                first = first_bucket_cap(bucket_cap_mb, first_bucket_cap_mb)
                net: nn.Module = DDP(model, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first)
            else:
                broadcast_from_rank0(model)
                net = model
        hashes["after_construction"] = params_hash(model)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for step in range(steps):
            with counter.phase(f"step {step + 1}"):
                batches = step_batches(
                    step, global_batch=global_batch, accum=accum, seed=seed, dtype=dt
                )
                local_l1.append(local_gradient_l1(model, batches, scale_loss=scale_loss))
                losses.append(accumulate(net, batches, no_sync=no_sync, scale_loss=scale_loss))
                if step == 0:
                    first_grad = flat_grads(model)
                opt.step()
                opt.zero_grad()
    hashes["final"] = params_hash(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {
        "rank": rank,
        "world_size": n,
        "accum": accum,
        "global_batch": global_batch,
        "b_local": b_local,  # samples per forward on this rank (the micro-batch)
        "samples_per_rank": b_local * accum,  # samples this rank sees per optimizer step
        "steps": steps,
        "hashes": hashes,
        "params": flat_params(model),
        "first_grad": first_grad,
        "losses": losses,
        "comm": counter.to_dicts(),
        "local_grad_l1": local_l1,  # per step: sum |g| of this rank's own gradient (no DDP)
        "grad_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "n_buckets": len(net.buckets) if isinstance(net, DDP) else 0,
    }


def comm_per_step(result: dict[str, Any], op: str = "all_reduce") -> list[dict[str, int]]:
    """Calls and payload bytes of ``op`` in each step of a :func:`train_run` result."""
    out = []
    for step in range(1, result["steps"] + 1):
        phase = f"step {step}"
        rows = [r for r in result["comm"] if r["op"] == op and r["phase"] == phase]
        out.append({"step": step, "calls": len(rows), "nbytes": sum(r["nbytes"] for r in rows)})
    return out


def comm_in_phase(result: dict[str, Any], phase: str, op: str | None = None) -> dict[str, int]:
    """Calls and payload bytes in one phase (``"construction"`` or ``"step k"``)."""
    rows = [r for r in result["comm"] if r["phase"] == phase and (op is None or r["op"] == op)]
    return {"calls": len(rows), "nbytes": sum(r["nbytes"] for r in rows)}
