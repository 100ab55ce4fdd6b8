"""Two ways to put a bucket's gradients into it times 1/N, timed side by side.

dplab.DDP fills a bucket when its last gradient is in (:func:`dplab.ddp.layout.fill`), either
with one ``mul(grad, 1/N, out=slot)`` per gradient (one pass over memory, one call each: torch's
``at::mul_out``) or with one ``_foreach_copy_`` into the slots and one multiply of the bucket (two
passes, two calls). Which is faster depends on how many gradients share how many bytes; this
measures both on a grid of (gradients, elements each) and on tiny-gpt's two buckets, and prints
which one :func:`dplab.ddp.layout.per_gradient` picks. One thread, interleaved, medians.

    flock /tmp/dplab-cpu.lock .venv/bin/python benchmarks/fill_paths.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _stats import machine

from dplab.ddp.layout import per_gradient, static_plan
from dplab.models import make_model

GRID = [  # (elements per gradient, gradients): 1 to 32 MiB, 1,024 to 1M elements each
    (1024, 200),
    (16384, 64),
    (16384, 512),
    (24576, 40),
    (32768, 32),
    (32768, 256),
    (49152, 20),
    (65536, 16),
    (262144, 4),
    (1 << 20, 6),
]


def tiny_gpt_buckets() -> list[list[int]]:
    """tiny-gpt's gradient sizes in its buckets (1 MiB first, then 25 MiB), backward order."""
    params = list(make_model("tiny-gpt").named_parameters())
    order = list(range(len(params)))[::-1]
    plan = static_plan(params, order, bucket_cap_mb=25, first_bucket_cap_mb=1)
    return [[params[i][1].numel() for i in bucket] for bucket in plan]


def race(numels: list[int], repeats: int) -> tuple[dict[str, float], str]:
    """Median µs of each fill of a bucket with gradients of these sizes, interleaved, and the
    way dplab picks for it."""
    grads = [torch.randn(n) for n in numels]
    bucket = torch.zeros(sum(numels))
    slots = list(bucket.split(numels))

    def per_gradient_mul() -> None:
        for slot, grad in zip(slots, grads, strict=True):
            torch.mul(grad, 0.5, out=slot)

    def copy_then_scale() -> None:
        torch._foreach_copy_(slots, grads)
        bucket.mul_(0.5)

    ways: dict[str, Callable[[], None]] = {
        "mul per gradient": per_gradient_mul,
        "copy, then scale": copy_then_scale,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            times[name].append((time.perf_counter() - start) * 1e6)
    picked = "mul per gradient" if per_gradient(slots) else "copy, then scale"
    return {k: statistics.median(v) for k, v in times.items()}, picked


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    cases = [(f"{count} x {numel}", [numel] * count) for numel, count in GRID]
    cases += [(f"tiny-gpt bucket {b}", sizes) for b, sizes in enumerate(tiny_gpt_buckets())]
    print(f"machine: {machine()}; 1 thread, {args.repeats} repeats, medians")
    print("| bucket | MiB | elements a gradient | mul per gradient | copy, then scale | picked |")
    print("|---|--:|--:|--:|--:|---|")
    for name, numels in cases:
        repeats = max(20, min(args.repeats, args.repeats * (4 << 20) // (4 * sum(numels))))
        r, picked = race(numels, repeats)
        mark = "" if picked == min(r, key=lambda k: r[k]) else " (slower)"
        print(
            f"| {name} | {4 * sum(numels) / 2**20:.2f} | {sum(numels) // len(numels):,} "
            f"| {r['mul per gradient']:.0f} µs | {r['copy, then scale']:.0f} µs "
            f"| {picked}{mark} |"
        )


if __name__ == "__main__":
    main()
