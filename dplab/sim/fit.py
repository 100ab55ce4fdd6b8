"""Fitting a fabric's constants to measured all-reduce times (a user's nccl-tests log, or
``python -m dplab bandwidth`` rows): the machinery behind :meth:`dplab.sim.Fabric.fit` and
:meth:`dplab.sim.Fabric.calibrated_from`. It takes a prediction function, not a fabric, so the
imports point one way: ``fabric`` imports this module, never the reverse.

The models are piecewise smooth (a minimum over algorithms and protocols), so the fit is a
coordinate-wise search in log space with a coarse scan first, deterministic and dependency-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dplab.sim.nccl_model import Calibration
from dplab.sim.nccl_tests import NcclTestsRow, parse_nccl_tests

# From this many measured sizes a user's log also fits LL's and LL128's bandwidth: a sweep at
# every power of two has then a few rows on each protocol, and the protocol switch (64 KiB-1 MiB)
# is where one bandwidth factor for all protocols misses most.
PROTOCOL_FIT_POINTS = 8


def fit_constants(
    cal0: Calibration,
    predict: Callable[[Calibration, float], float],
    points: Sequence[tuple[float, float]],
) -> tuple[Calibration, str]:
    """``cal0`` with bandwidth, latency (and, from 3 points, pipeline fill; from
    :data:`PROTOCOL_FIT_POINTS`, LL's and LL128's own bandwidth) fitted so that
    ``predict(calibration, bytes)`` (seconds) meets the measured ``points``; and a sentence
    saying what was fitted. Knows nothing of fabrics: the caller says how to predict."""
    top = 2.0 / max(cal0.bw_efficiency, cal0.nvls_efficiency)
    lows = sorted(cal0.proto_bw)  # the protocols below Simple whose bandwidth has a factor

    def cal_of(x: Sequence[float]) -> Calibration:
        proto_bw = {p: min(100.0, cal0.proto_bw[p] * f) for p, f in zip(lows, x[3:], strict=False)}
        return cal0.with_(
            bw_efficiency=min(2.0, cal0.bw_efficiency * x[0]),
            nvls_efficiency=min(2.0, cal0.nvls_efficiency * x[0]),
            latency_scale=cal0.latency_scale * x[1],
            fill_slices=x[2] - 1e-3,
            proto_bw={**cal0.proto_bw, **proto_bw},
        )

    def err(x: Sequence[float]) -> float:
        cal = cal_of(x)
        return sum(math.log(predict(cal, b) / t) ** 2 for b, t in points)

    x0 = [1.0, 1.0, cal0.fill_slices + 1e-3]
    bounds = [(0.05, top), (0.02, 50.0), (1e-3, 50.0)]
    if len(points) >= 2:  # bandwidth and latency first, then the fill from there
        x = [*minimize_log(lambda y: err([*y, x0[2]]), x0[:2], bounds=bounds[:2]), x0[2]]
        if len(points) >= 3:
            x = minimize_log(err, x, bounds=bounds)
        if len(points) >= PROTOCOL_FIT_POINTS and lows:
            more = [(0.1, 10.0)] * len(lows)
            x = minimize_log(err, [*x, *[1.0] * len(lows)], bounds=[*bounds, *more])
    else:  # one row: the factor its size depends on
        i = 0 if points[0][0] >= 2**20 else 1
        xi = minimize_log(lambda y: err([*x0[:i], y[0], *x0[i + 1 :]]), [1.0], bounds=[bounds[i]])
        x = [*x0[:i], xi[0], *x0[i + 1 :]]
    what = (
        f"fit to {len(points)} measured sizes: bandwidth × {x[0]:.3g}, latency × "
        f"{x[1]:.3g}, pipeline fill {x[2] - 1e-3:.3g} slices"
    ) + "".join(f", {p} bandwidth × {f:.3g}" for p, f in zip(lows, x[3:], strict=False))
    return cal_of(x), what


def measured_points(data: Any, *, minimum: int = 2) -> tuple[list[tuple[float, float]], int | None]:
    """(bytes, seconds) pairs and the rank count, from nccl-tests text or dplab bandwidth rows."""
    if isinstance(data, str):
        run = parse_nccl_tests(data)
        pts = [(float(r.bytes), r.time_us * 1e-6) for r in run.rows if r.bytes > 0]
        ranks = run.ranks
    else:
        rows = data.get("rows") if isinstance(data, Mapping) else data
        if rows is None:
            raise ValueError("a bandwidth report needs 'rows'")
        pts, sizes = [], set()
        for i, r in enumerate(rows):
            if isinstance(r, NcclTestsRow):
                r = {"size_bytes": r.bytes, "time_s": r.time_us * 1e-6}
            elif hasattr(r, "to_dict"):
                r = r.to_dict()
            if not isinstance(r, Mapping) or "size_bytes" not in r or "time_s" not in r:
                raise ValueError(f"row {i} needs size_bytes and time_s, got {r!r}")
            if r.get("algorithm", "all_reduce") != "all_reduce":
                continue
            if "world_size" in r:
                sizes.add(r["world_size"])
            pts.append((float(r["size_bytes"]), float(r["time_s"])))
        if len(sizes) > 1:
            raise ValueError(f"rows mix world sizes {sorted(sizes)}: fit one at a time")
        ranks = sizes.pop() if sizes else None
    pts = [(b, t) for b, t in pts if b > 0]
    for b, t in pts:
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"a measured time must be > 0 s, got {t!r} at {b:g} bytes")
    if len(pts) < minimum:
        raise ValueError(f"need at least {minimum} measured sizes to fit, got {len(pts)}")
    return pts, ranks


def minimize_log(
    f: Any, x0: Sequence[float], *, bounds: Sequence[tuple[float, float]], sweeps: int = 8
) -> list[float]:
    """Minimise ``f`` over positive parameters by coordinate-wise golden-section search in
    log space. Deterministic and dependency-free: the models here are piecewise smooth (a min
    over algorithms), where a coarse scan then a golden refinement is robust."""
    x = [min(max(v, lo), hi) for v, (lo, hi) in zip(x0, bounds, strict=True)]
    g = (math.sqrt(5) - 1) / 2
    for sweep in range(sweeps):
        for i, (lo, hi) in enumerate(bounds):
            a, b = math.log(lo), math.log(hi)

            def at(u: float, i: int = i) -> float:
                y = list(x)
                y[i] = math.exp(u)
                return f(y)

            if sweep == 0:  # a coarse scan finds the right basin
                grid = [a + (b - a) * k / 24 for k in range(25)]
                k = min(range(25), key=lambda k: at(grid[k]))
                a, b = grid[max(0, k - 1)], grid[min(24, k + 1)]
            else:
                u = math.log(x[i])
                w = (b - a) / 4**sweep
                a, b = max(a, u - w), min(b, u + w)
            c, d = b - g * (b - a), a + g * (b - a)
            fc, fd = at(c), at(d)
            for _ in range(40):
                if fc < fd:
                    b, d, fd = d, c, fc
                    c = b - g * (b - a)
                    fc = at(c)
                else:
                    a, c, fc = c, d, fd
                    d = a + g * (b - a)
                    fd = at(d)
            u = (a + b) / 2
            if at(u) <= f(x):
                x[i] = math.exp(u)
    return x
