"""What tracing costs: traced / untraced dplab.DDP step time, side by side, on 2 gloo ranks.

Two identical models, one with a Tracer (and the optimizer watched), one without; steps
interleaved in one shuffled order shared by both ranks, each starting at a barrier. Goal <= 1.03;
it must not exceed 1.05.

    python benchmarks/trace_overhead.py [--steps 40] [--caps 0.5 5 25]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from _stats import interleaved, machine, median_ratio, race_setup

import dplab
from dplab.models import make_batch, make_model


def race(model: str, caps: list[float], steps: int, batch_size: int) -> dict:
    """On every rank: a traced and an untraced model per cap, their steps interleaved."""
    x, y = make_batch(model, batch_size, seed=dist.get_rank())

    def step_of(cap: float, traced: bool):
        tracer = dplab.Tracer() if traced else None
        net = dplab.DDP(
            make_model(model), bucket_cap_mb=cap, first_bucket_cap_mb=cap, tracer=tracer
        )
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        if tracer is not None:
            tracer.watch(opt)

        def step():
            net(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            if tracer is not None:
                tracer.steps  # resolving the marks is part of the price  # noqa: B018

        return step

    steps_by_key = {(cap, traced): step_of(cap, traced) for cap in caps for traced in (True, False)}
    times = interleaved(steps_by_key, steps)
    return {f"{cap}/{'traced' if traced else 'plain'}": v for (cap, traced), v in times.items()}


def main() -> None:
    args, run = race_setup(__doc__)
    times = run(race)
    print(
        f"machine: {machine()}; model {args.model}, local batch {args.batch_size}, "
        f"{args.steps} steps per config, 2 gloo ranks"
    )
    print("| bucket cap | untraced median | traced median | traced / untraced (95% CI) |")
    print("|---|---|---|---|")
    for cap in args.caps:
        traced, plain = times[f"{cap}/traced"], times[f"{cap}/plain"]
        ratio, lo, hi = median_ratio(traced, plain)
        print(
            f"| {cap:g} MiB | {statistics.median(plain):.1f} ms | "
            f"{statistics.median(traced):.1f} ms | {ratio:.3f} ({lo:.3f}–{hi:.3f}) |"
        )


if __name__ == "__main__":
    main()
