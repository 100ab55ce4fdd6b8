"""Medians and bootstrap intervals for side-by-side benchmark ratios."""

from __future__ import annotations

import platform
import random
import statistics
from datetime import date


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


def machine() -> str:
    """Cores, CPU model and date, for the record in docs/benchmarks.md."""
    import os

    import torch

    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores ({model}), torch {torch.__version__}, {date.today().isoformat()}"
