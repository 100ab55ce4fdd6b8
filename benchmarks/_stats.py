"""What the side-by-side benchmarks share: interleaved timing, medians, bootstrap intervals."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from datetime import date

import torch.distributed as dist

from dplab.env import machine_info


def median_ratio(
    a: list[float], b: list[float], *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """median(a) / median(b) with a 95% bootstrap interval (each side resampled on its own)."""
    rng = random.Random(seed)
    point = statistics.median(a) / statistics.median(b)
    ratios = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
        for _ in range(resamples)
    )
    return point, ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def interleaved(
    steps: dict[Hashable, Callable[[], None]],
    repeats: int | Mapping[Hashable, int],
    *,
    warmup: int = 2,
    seed: int = 0,
) -> dict[Hashable, list[float]]:
    """Time each config's step ``repeats`` times (or ``repeats[config]``), all configs mixed in
    one shuffled order.

    Run on every rank: the order comes from ``seed``, so all ranks agree, and every timed step
    starts at a barrier. Mixing the configs spreads the machine's drift over all of them.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    count = repeats if isinstance(repeats, Mapping) else dict.fromkeys(steps, repeats)
    order = [key for key in steps for _ in range(count[key])]
    random.Random(seed).shuffle(order)
    times: dict[Hashable, list[float]] = {key: [] for key in steps}
    for key in order:
        dist.barrier()
        t0 = time.perf_counter()
        steps[key]()
        times[key].append((time.perf_counter() - t0) * 1e3)
    return times


def machine() -> str:
    """Cores, CPU model, torch and date, for the record in docs/benchmarks.md."""
    info = machine_info()
    return (
        f"{info['usable_cores']} cores ({info['cpu_model']}), torch {info['torch']}, "
        f"{date.today().isoformat()}"
    )


def race_setup(doc: str) -> tuple[argparse.Namespace, Callable[[Callable], object]]:
    """The command line the two-config races share, and a runner for their rank function.

    Returns the parsed arguments and ``run(race)``: rank 0's result of ``race(model, caps, steps,
    batch_size)`` launched on 2 ranks (rank 0's clock; every timed step began at a barrier).
    """
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default="gpt-7m")
    p.add_argument("--caps", type=float, nargs="+", default=[0.5, 5.0, 25.0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4)
    args = p.parse_args()

    def run(race: Callable) -> object:
        import dplab

        call_args = (args.model, args.caps, args.steps, args.batch_size)
        return dplab.launch(race, 2, args=call_args, timeout_s=3600)[0]

    return args, run
