"""Sharded gradients, averaged, equal the global-batch gradient.

Rank i computes g_i = mean over its B/N samples of ∇ℓ; the all-reduce average is
ḡ = (1/N) Σ_i g_i = (1/B) Σ_x ∇ℓ(x): the same sum, grouped differently. In exact arithmetic they
are equal. In floating point the grouping changes the rounding (addition is not associative), so
the two agree to about one unit in the last place (ulp) of the largest gradient entry: ~1e-17 in
float64, ~1e-8 in float32 (eps 2.2e-16 and 1.2e-7, times entries of ~0.3).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab._checks import check_positive_int
from dplab.mechanics._common import (
    as_dtype,
    flat_grads,
    rank_and_world,
    shard,
    tensor_hash,
    ulp,
)
from dplab.models import make_batch, make_model


def gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∇ of the mean loss over (x, y), flattened: a fresh backward from zeroed grads."""
    model.zero_grad(set_to_none=True)
    model(x, y).backward()
    g = flat_grads(model)
    model.zero_grad(set_to_none=True)
    return g


def average_over_ranks(g: torch.Tensor) -> torch.Tensor:
    """ḡ = (1/N) Σ g_i: one all-reduce (sum) and a division. A new tensor; g is untouched."""
    out = g.clone()
    _, n = rank_and_world()
    if n > 1:
        dist.all_reduce(out)
        out /= n
    return out


def sharded_vs_global(*, global_batch: int = 64, dtype: Any = "float64", seed: int = 0) -> dict:
    """Rank function: my shard's gradient, the all-reduce average, and the global-batch gradient.

    Every rank builds the same model and the same global batch from ``seed`` (no broadcast needed
    for this check), computes g_i on its shard, averages over ranks, and compares with the
    gradient of the whole batch computed locally. Returns plain numbers.
    """
    check_positive_int("global_batch", global_batch)
    dt = as_dtype(dtype)
    rank, n = rank_and_world()
    model = make_model("mlp", seed=seed, dtype=dt)
    x, y = make_batch("mlp", global_batch, seed=seed + 1, dtype=dt)
    g_global = gradient(model, x, y)
    g_local = gradient(model, shard(x, rank, n), shard(y, rank, n))
    g_avg = average_over_ranks(g_local)
    diff = (g_avg - g_global).abs()
    grad_max = g_global.abs().max().item()
    return {
        "rank": rank,
        "world_size": n,
        "dtype": str(dt).removeprefix("torch."),
        "eps": torch.finfo(dt).eps,
        "local_batch": global_batch // n,
        "n_params": g_global.numel(),
        "grad_max": grad_max,
        "max_abs_diff": diff.max().item(),
        # the difference in units of the last place of the largest gradient entry
        "ulps_of_max": diff.max().item() / ulp(torch.tensor(grad_max, dtype=dt)).item(),
        "differing_elements": int((diff > 0).sum().item()),
        "shard_vs_global": (g_local - g_global).abs().max().item(),
        "avg_hash": tensor_hash(g_avg),
    }
