"""Per-gradient cost: dplab.DDP against torch DDP on a model of many tiny tensors, 2 gloo ranks.

400 x Linear(16, 16) (800 gradients of 1 KiB or less, compute negligible): each step's time is
mostly what a DDP pays per gradient (its hook, the copy into the bucket, the copy back). Configs,
all interleaved step by step in one shuffled order shared by both ranks, every timed step starting
at a barrier: the bare module (no DDP, no communication), torch DDP and dplab.DDP with torch's
defaults (``gradient_as_bucket_view=False``: a copy in and a copy out per gradient), both with
``gradient_as_bucket_view=True``, and dplab traced. Reported: medians, the ratio dplab / torch with
a 95% bootstrap interval, and µs per gradient above the bare module. Target: ratio <= 1.0.

    python benchmarks/ddp_many_tensors.py [--steps 60] [--layers 400]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from _stats import interleaved, machine, median_ratio
from torch import nn

import dplab

CONFIGS = ("bare", "torch", "dplab", "torch+views", "dplab+views", "dplab traced")


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])


def race(layers: int, steps: int) -> dict:
    """On every rank: one model per config, their steps interleaved."""
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    torch_ddp = nn.parallel.DistributedDataParallel
    tracer = dplab.Tracer()
    nets = {
        "bare": _model(layers),
        "torch": torch_ddp(_model(layers)),
        "dplab": dplab.DDP(_model(layers)),
        "torch+views": torch_ddp(_model(layers), gradient_as_bucket_view=True),
        "dplab+views": dplab.DDP(_model(layers), gradient_as_bucket_view=True),
        "dplab traced": dplab.DDP(_model(layers), tracer=tracer),
    }

    def step_of(key: str):
        net = nets[key]

        def step() -> None:
            net(x).sum().backward()
            net.zero_grad(set_to_none=False)
            if key == "dplab traced":
                tracer.steps  # resolving the marks is part of the price  # noqa: B018
                tracer.clear()

        return step

    # Warm-up steps let both DDPs rebuild their buckets after the first iteration.
    times = interleaved({key: step_of(key) for key in CONFIGS}, steps, warmup=3)
    buckets = {
        "dplab": len(nets["dplab"].buckets),
        "torch": len(nets["torch"].reducer._get_zeros_like_grad_buckets()),
    }
    grads = sum(1 for p in nets["dplab"].parameters() if p.requires_grad)
    return {"times": times, "buckets": buckets, "grads": grads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=400)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    out = dplab.launch(race, 2, args=(args.layers, args.steps), timeout_s=3600)[0]
    times, grads = out["times"], out["grads"]
    bare = statistics.median(times["bare"])
    print(
        f"machine: {machine()}; {args.layers} x Linear(16, 16) = {grads} gradients, "
        f"{args.steps} steps per config, 2 gloo ranks; buckets dplab {out['buckets']['dplab']}, "
        f"torch {out['buckets']['torch']}"
    )
    print("| config | median step | µs per gradient above the bare module |")
    print("|---|--:|--:|")
    for key in CONFIGS:
        med = statistics.median(times[key])
        print(f"| {key} | {med:.2f} ms | {(med - bare) * 1e3 / grads:.2f} |")
    print()
    print("| ratio | median ratio (95% CI) |")
    print("|---|--:|")
    for ours, theirs in (
        ("dplab", "torch"),
        ("dplab+views", "torch+views"),
        ("dplab traced", "torch"),
        ("dplab+views", "torch"),
    ):
        ratio, lo, hi = median_ratio(times[ours], times[theirs])
        print(f"| {ours} / {theirs} | {ratio:.3f} ({lo:.3f}–{hi:.3f}) |")


if __name__ == "__main__":
    main()
