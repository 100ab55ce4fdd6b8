"""dplab.DDP against torch's DistributedDataParallel: step time, side by side, on 2 gloo ranks.

Each bucket cap gets a dplab model and a torch model built with the same arguments (same
weights, the same `bucket_cap_mb`): both then cut the same buckets, one bucket in step 0 and the
rebuild after it, and keep gradients apart from the buckets (torch's default
``gradient_as_bucket_view=False``). All configs are interleaved step by step in one shuffled
order that both ranks share; every timed step starts at a barrier. Reported: the median step of
each, the ratio dplab / torch with a 95% bootstrap interval. Goal <= 1.02; it must not exceed 1.05.

    python benchmarks/ddp_vs_torch.py [--steps 30] [--model gpt-7m]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from _stats import interleaved, machine, median_ratio, race_setup
from torch import nn

import dplab
from dplab.models import make_batch, make_model, n_params


def race(model: str, caps: list[float], steps: int, batch_size: int) -> dict:
    """On every rank: one dplab and one torch model per cap, their steps interleaved."""
    x, y = make_batch(model, batch_size, seed=dist.get_rank())
    nets = {}
    for cap in caps:
        nets[("dplab", cap)] = dplab.DDP(make_model(model), bucket_cap_mb=cap)
        nets[("torch", cap)] = nn.parallel.DistributedDataParallel(
            make_model(model), bucket_cap_mb=cap
        )

    def step_of(net):
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)

        def step():
            net(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        return step

    # The warm-up steps also let torch rebuild its buckets after its first iteration.
    times = interleaved({key: step_of(net) for key, net in nets.items()}, steps)
    buckets = {cap: len(nets[("dplab", cap)].buckets) for cap in caps}
    return {"times": {f"{k[0]}@{k[1]}": v for k, v in times.items()}, "buckets": buckets}


def main() -> None:
    args, run = race_setup(__doc__)
    out = run(race)
    times = out["times"]
    print(
        f"machine: {machine()}; model {args.model} ({n_params(make_model(args.model)) / 1e6:.1f} M "
        f"params), local batch {args.batch_size}, {args.steps} steps per config, 2 gloo ranks"
    )
    print("| bucket cap | buckets | dplab median | torch median | dplab / torch (95% CI) |")
    print("|---|---|---|---|---|")
    for cap in args.caps:
        ours, theirs = times[f"dplab@{cap}"], times[f"torch@{cap}"]
        ratio, lo, hi = median_ratio(ours, theirs)
        print(
            f"| {cap:g} MiB | {out['buckets'][cap]} | {statistics.median(ours):.1f} ms | "
            f"{statistics.median(theirs):.1f} ms | {ratio:.3f} ({lo:.3f}–{hi:.3f}) |"
        )
    all_ours = [t for cap in args.caps for t in times[f"dplab@{cap}"]]
    all_theirs = [t for cap in args.caps for t in times[f"torch@{cap}"]]
    ratio, lo, hi = median_ratio(all_ours, all_theirs)
    print(f"| all caps | | | | {ratio:.3f} ({lo:.3f}–{hi:.3f}) |")


if __name__ == "__main__":
    main()
