"""Measuring all-reduce bandwidth on ranks and fitting α-β (the ``bandwidth`` verb prints it).

The bench times ``dist.all_reduce`` (and, for contrast, this package's ring and naive
all-reduce) over sizes from 1 KiB to 256 MiB, and reports nccl-tests' algbw and busbw.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from numbers import Integral
from typing import Any

from dplab._checks import check_count, check_positive_int, check_world_size
from dplab._units import GB, KIB, MIB, format_size
from dplab.collectives.allreduce import group_info, naive_all_reduce, ring_all_reduce
from dplab.collectives.cost import AlphaBetaFit, algbw, busbw, fit_alpha_beta
from dplab.env import machine_info

ALGORITHMS = ("all_reduce", "ring", "naive")


def geometric_sizes(min_bytes: int = KIB, max_bytes: int = 256 * MIB, factor: int = 4) -> list[int]:
    """Message sizes from ``min_bytes`` to ``max_bytes``, each ``factor`` times the last."""
    lo, hi = check_count("min_bytes", min_bytes), check_count("max_bytes", max_bytes)
    if lo < 4:
        raise ValueError(f"min_bytes must be >= 4 (one float32), got {min_bytes!r}")
    if hi < lo:
        raise ValueError(f"max_bytes ({max_bytes!r}) must be >= min_bytes ({min_bytes!r})")
    if isinstance(factor, bool) or not isinstance(factor, Integral) or factor < 2:
        raise ValueError(f"factor must be an int >= 2, got {factor!r}")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


@dataclass
class BandwidthRow:
    """The median time of one all-reduce of ``size_bytes`` (slowest rank), and its bandwidths."""

    algorithm: str
    world_size: int
    size_bytes: int
    time_s: float
    algbw_GBps: float
    busbw_GBps: float
    iters: int
    repeats_s: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run_op(algorithm: str, x: Any) -> None:
    import torch.distributed as dist

    if algorithm == "all_reduce":
        dist.all_reduce(x)
    elif algorithm == "ring":
        ring_all_reduce(x)
    else:
        naive_all_reduce(x)


def bandwidth_bench(
    sizes: Sequence[int] | None = None,
    *,
    algorithms: Sequence[str] = ("all_reduce",),
    repeats: int = 5,
    warmup: int = 2,
    min_time_s: float = 0.01,
) -> list[BandwidthRow]:
    """Time all-reduces of each size on the current process group (call on every rank).

    For each size, every algorithm is warmed up, then timed ``repeats`` times, the algorithms
    interleaved so that a slow moment of the machine hits them all alike. One timing is a
    barrier, then ``iters`` back-to-back calls (enough to last ``min_time_s``, so the clock's
    resolution does not matter), divided by ``iters``; the slowest rank's figure counts (the
    collective is done when the last rank is). The row holds the median over repeats.
    Tensors are float32 zeros, so the sums never overflow.
    """
    import torch
    import torch.distributed as dist

    from dplab.launch import device

    _, n, _ = group_info(None)
    sizes = list(geometric_sizes()) if sizes is None else [int(s) for s in sizes]
    for s in sizes:
        if s < 4 or s % 4:
            raise ValueError(f"sizes must be whole float32 counts (multiples of 4 bytes), got {s}")
    for a in algorithms:
        if a not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {a!r}")
    repeats = max(1, check_count("repeats", repeats))
    warmup = check_count("warmup", warmup)
    dev = device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(algorithm: str, x: Any, iters: int) -> float:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            _run_op(algorithm, x)
        sync()
        return slowest((time.perf_counter() - t0) / iters)

    rows = []
    for size in sizes:
        x = torch.zeros(size // 4, dtype=torch.float32, device=dev)
        iters = {}
        for a in algorithms:
            for _ in range(warmup):
                _run_op(a, x)
            # The quickest of three single calls: one call slowed by another process on a
            # busy machine must not shrink the batch to a single call.
            once = timed(a, x, 1)
            if once < min_time_s:
                once = min(once, timed(a, x, 1), timed(a, x, 1))
            iters[a] = max(1, min(1000, math.ceil(min_time_s / max(once, 1e-9))))
        times: dict[str, list[float]] = {a: [] for a in algorithms}
        for _ in range(repeats):
            for a in algorithms:
                times[a].append(timed(a, x, iters[a]))
        for a in algorithms:
            t = statistics.median(times[a])
            rows.append(
                BandwidthRow(
                    a, n, size, t, algbw(size, t) / GB, busbw(size, t, n) / GB, iters[a], times[a]
                )
            )
        del x
    return rows


def measure_bandwidth(
    world_size: int = 2,
    *,
    sizes: Sequence[int] | None = None,
    algorithms: Sequence[str] = ("all_reduce",),
    repeats: int = 5,
    warmup: int = 2,
    backend: str = "auto",
    cluster: Any = None,
    timeout_s: float = 600.0,
) -> list[BandwidthRow]:
    """Run :func:`bandwidth_bench` on ``world_size`` ranks (or on a warm ``dplab.Cluster``)."""
    from dplab.launch import launch

    kwargs = {"sizes": sizes, "algorithms": tuple(algorithms), "repeats": repeats}
    kwargs["warmup"] = warmup
    if cluster is not None:
        return cluster.run(bandwidth_bench, **kwargs)[0]
    n = check_world_size(world_size)
    return launch(bandwidth_bench, n, backend=backend, kwargs=kwargs, timeout_s=timeout_s)[0]


def fit_rows(rows: Sequence[BandwidthRow]) -> dict[tuple[str, int], AlphaBetaFit]:
    """One α-β fit per (algorithm, world size) among ``rows`` (the naive one with its model)."""
    groups: dict[tuple[str, int], list[BandwidthRow]] = {}
    for r in rows:
        groups.setdefault((r.algorithm, r.world_size), []).append(r)
    return {
        key: fit_alpha_beta(
            [r.size_bytes for r in g],
            [r.time_s for r in g],
            key[1],
            model="naive" if key[0] == "naive" else "ring",
        )
        for key, g in groups.items()
        if key[1] >= 2 and len({r.size_bytes for r in g}) >= 2
    }


def measure_fit(
    cluster: Any,
    sizes: Sequence[int],
    *,
    fit_on: Sequence[int] | None = None,
    repeats: int = 3,
    attempts: int = 3,
) -> tuple[AlphaBetaFit, list[BandwidthRow]]:
    """Time all-reduces of ``sizes`` on a warm ``dplab.Cluster`` and fit α-β to those in
    ``fit_on`` (all of them by default): the fit and every row.

    Every message costs some time and every byte some more, so a fit that puts α or β at zero
    says that a busy moment of the machine landed on one size (under load a 4 KiB all-reduce
    can take as long as a 4 MiB one). Such a measurement is taken again, up to ``attempts``
    times in all; if every one is degenerate, the error says so with the times measured.
    """
    fit_on = list(sizes if fit_on is None else fit_on)
    if len(set(fit_on)) < 2:
        raise ValueError(f"an α-β fit needs two or more distinct sizes, got {fit_on!r}")
    if not set(fit_on) <= set(sizes):
        raise ValueError(f"fit_on {fit_on!r} must be among the measured sizes {list(sizes)!r}")
    tries = check_positive_int("attempts", attempts)
    for _ in range(tries):
        rows = measure_bandwidth(cluster=cluster, sizes=list(sizes), repeats=repeats)
        fits = fit_rows([r for r in rows if r.size_bytes in fit_on])
        fit = fits[("all_reduce", rows[0].world_size)]
        if fit.alpha_s > 0 and fit.beta_s_per_byte > 0:
            return fit, rows
    times = ", ".join(f"{r.size_bytes:,} B: {r.time_s * 1e6:.0f} µs" for r in rows)
    raise RuntimeError(
        f"{tries} measurements in a row fitted α = {fit.alpha_s:.3g} s, β = "
        f"{fit.beta_s_per_byte:.3g} s/B: the all-reduce times did not grow with size ({times}). "
        "The machine is too busy to time a link; run again when it is quieter."
    )


def bandwidth_report(
    rows: Sequence[BandwidthRow], *, command: str, backend: str = "gloo"
) -> dict[str, Any]:
    """A JSON-ready record: machine, date, command, rows, fits, and the link a simulator uses.

    ``link`` is the fit of ``dist.all_reduce`` at the smallest world size measured (2, normally):
    ``alpha_s``, ``beta_s_per_byte`` and ``bandwidth_GBps`` (= 1/β / 1e9).
    """
    fits = fit_rows(rows)
    report: dict[str, Any] = {
        "kind": "dplab.allreduce_bandwidth",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "backend": backend,
        "machine": machine_info(),
        "rows": [r.to_dict() for r in rows],
        "fits": [f.to_dict() | {"algorithm": a} for (a, _), f in sorted(fits.items())],
    }
    ws = sorted(n for a, n in fits if a == "all_reduce")
    if ws:
        f = fits[("all_reduce", ws[0])]
        report["link"] = {
            "name": f"{backend} loopback, this machine",
            "alpha_s": f.alpha_s,
            "beta_s_per_byte": f.beta_s_per_byte,
            "bandwidth_GBps": f.to_dict()["bandwidth_GBps"],
            "world_size": f.world_size,
            "algorithm": "all_reduce",
            "max_rel_error": f.max_rel_error,
        }
    return report


def format_table(rows: Sequence[BandwidthRow]) -> str:
    """A Markdown table: one line per (size), one column group per algorithm."""
    lines = [
        "| N | algorithm | size | time (µs) | algbw (GB/s) | busbw (GB/s) |",
        "|--:|---|--:|--:|--:|--:|",
    ]
    for r in sorted(rows, key=lambda r: (r.world_size, r.algorithm, r.size_bytes)):
        lines.append(
            f"| {r.world_size} | {r.algorithm} | {format_size(r.size_bytes)} | "
            f"{r.time_s * 1e6:,.1f} | {r.algbw_GBps:.3f} | {r.busbw_GBps:.3f} |"
        )
    return "\n".join(lines)


def format_fit(algorithm: str, fit: AlphaBetaFit) -> str:
    return (
        f"{algorithm}, N={fit.world_size}: alpha = {fit.alpha_s * 1e6:.1f} us, "
        f"beta = {fit.beta_s_per_byte:.3e} s/B (bandwidth {fit.bandwidth_GBps:.2f} GB/s); "
        f"relative error median {fit.median_rel_error:.0%}, max {fit.max_rel_error:.0%} "
        f"over {fit.n_points} sizes"
    )
