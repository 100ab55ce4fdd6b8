"""Fitting the constants NCCL's source does not give (:class:`~dplab.sim.nccl_model.Calibration`)
on published rows (:mod:`dplab.sim.published`), each constant on the rows it governs, starting
from NCCL's own model (:data:`UNFITTED`) so no shipped constant leaks into a fold of
:func:`dplab.sim.validation.leave_one_source_out`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dplab.sim.fabric import Fabric
from dplab.sim.nccl_model import (
    DEFAULT_CALIBRATION,
    NCCL_NET_LATENCY_US,
    PROTOCOLS,
    Calibration,
)
from dplab.sim.published import Row

KIB, MIB = 2**10, 2**20
SMALL, LARGE = 64 * KIB, 64 * MIB
NETWORK_GROUPS = (("efa",), ("ib", "roce"))  # one latency each; RoCE rides IB's verbs plugin


def _log_loss(cal: Calibration, rows: Sequence[Row], bases: dict[str, Fabric]) -> float:
    """Sum of |log(predicted/measured)|: a robust loss (one odd row cannot drag a constant).
    ``bases``: each run's fabric (NICs already calibrated on its plateau where it has one)."""
    fabs: dict[str, Fabric] = {}
    total = 0.0
    for r in rows:
        f = fabs.get(r.run)
        if f is None:
            f = fabs[r.run] = bases[r.run].with_calibration(cal)
        total += abs(math.log(r.ratio(f)))
    return total


def _fit1(loss: Callable[[float], float], lo: float, hi: float, *, grid: int = 16) -> float:
    """The minimiser of a one-constant loss on [lo, hi]: a log-spaced scan finds the basin
    (the losses are sums of |log| terms, piecewise smooth), a golden-section search refines it
    to 0.1 %. Fast enough to refit every fold of :func:`leave_one_source_out` live."""
    a, b = math.log(lo), math.log(hi)
    xs = [a + (b - a) * k / grid for k in range(grid + 1)]
    k = min(range(grid + 1), key=lambda k: loss(math.exp(xs[k])))
    a, b = xs[max(0, k - 1)], xs[min(grid, k + 1)]
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = loss(math.exp(c)), loss(math.exp(d))
    while b - a > 1e-3:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = loss(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = loss(math.exp(d))
    return math.exp((a + b) / 2)


# NCCL's own model, nothing fitted: where every fit starts, so no shipped constant (fitted on
# rows that may be the very rows held out) leaks into a fold. TCP's latency is no fit either.
UNFITTED = Calibration(
    bw_efficiency=1.0,
    nvls_efficiency=1.0,
    fill_slices=0.0,
    net_latency_us={**NCCL_NET_LATENCY_US, "tcp": DEFAULT_CALIBRATION.net_latency_us["tcp"]},
    proto_latency=dict.fromkeys(PROTOCOLS, 1.0),
    proto_bw={"LL": 1.0, "LL128": 1.0},
    launch_us_per_gpu=0.0,
)


def fit_calibration(rows: Sequence[Row], *, passes: int = 2) -> Calibration:
    """The global constants, fitted on ``rows`` alone (a run NCCL's search did not lay out,
    ``Row.excluded``, is left out), starting from NCCL's own model (:data:`UNFITTED`), in
    stages, each to the rows it governs:

    1. ``bw_efficiency`` to the ring/tree rows ≥ 64 MiB, ``nvls_efficiency`` to the NVLS and
       NVLS-tree rows ≥ 64 MiB (NCCL's own 1.0 when no such row is given);
    2. the latency floor of each protocol (``proto_latency``, a factor on NCCL's base and
       per-hop latencies): LL's to the one-node rows ≤ 64 KiB of runs with one GPU per
       process; LL128's and Simple's to the one-node rows 64 KiB–64 MiB the model runs on them;
    3. ``launch_us_per_gpu`` to the rows ≤ 64 KiB of runs where one process drove several
       GPUs (nccl-tests ``-g``): the floor those runs add per extra GPU (0 with no such row);
    4. the network hop latency of each network kind (EFA; IB and RoCE together) to the
       multi-node rows ≤ 64 KiB on it; a kind with no such row takes the latency fitted on all
       multi-node rows ≤ 64 KiB; with none at all, NCCL's own (:data:`NCCL_NET_LATENCY_US`);
    5. the bandwidth of LL and LL128 (``proto_bw``) to the rows 64 KiB–64 MiB the model runs
       on them, then ``fill_slices`` to every row, the others fixed.

    The stages depend on each other (a large row has some latency and fill; the protocol the
    model picks moves with the constants), so they run ``passes`` times, each from the last.
    """
    rows = [r for r in rows if not r.excluded]
    cal = UNFITTED
    for _ in range(passes):
        cal = _fit_stages(cal, rows)
    return cal


def _fit_stages(cal: Calibration, rows: Sequence[Row]) -> Calibration:
    bases = {r.run: r.fabric_with(cal) for r in rows}

    def fit(field: str, sel: Sequence[Row], lo: float, hi: float, key: str | None = None) -> None:
        nonlocal cal
        if not sel:
            return

        def with_x(x: float) -> Calibration:
            if key is None:
                return cal.with_(**{field: x})
            return cal.with_(**{field: {**getattr(cal, field), key: x}})

        cal = with_x(round(_fit1(lambda x: _log_loss(with_x(x), sel, bases), lo, hi), 3))

    def proto(r: Row) -> str:
        """The ring/tree protocol the model runs the row on ('' for NVLS: its own latency)."""
        a, p = bases[r.run].with_calibration(cal).choice(r.nbytes, r.algorithm)
        return p if a in ("ring", "tree") else ""

    large = [r for r in rows if r.nbytes >= LARGE]
    nvls = [
        r
        for r in large
        if bases[r.run].with_calibration(cal).choice(r.nbytes, r.algorithm)[0][:4] == "nvls"
    ]
    fit("bw_efficiency", [r for r in large if r not in nvls], 0.5, 1.2)
    fit("nvls_efficiency", nvls, 0.4, 1.2)
    small = [r for r in rows if r.nbytes <= SMALL]
    one_node = [r for r in small if r.fabric.nodes == 1]
    own = [r for r in one_node if r.fabric.gpus_per_process == 1 and proto(r) == "LL"]
    fit("proto_latency", own, 0.3, 5.0, "LL")
    mid = [r for r in rows if SMALL <= r.nbytes < LARGE]
    for p in ("LL128", "Simple"):  # one node: the network hop has its own constant
        fit("proto_latency", [r for r in mid if r.fabric.nodes == 1 and proto(r) == p], 0.3, 5, p)
    fit("launch_us_per_gpu", [r for r in one_node if r.fabric.gpus_per_process > 1], 0.01, 30.0)
    multi = [r for r in small if r.fabric.nodes > 1]

    def lat_fit(sel: list[Row], kinds: Sequence[str], base: dict[str, float]) -> float:
        def loss(x: float) -> float:
            lat = {**base, **dict.fromkeys(kinds, x)}
            return _log_loss(cal.with_(net_latency_us=lat), sel, bases)

        return round(_fit1(loss, 0.1, 300.0), 1)

    lat = {k: NCCL_NET_LATENCY_US[k] for g in NETWORK_GROUPS for k in g}
    if multi:
        pooled = lat_fit(multi, [k for g in NETWORK_GROUPS for k in g], lat)
        for kinds in NETWORK_GROUPS:
            sel = [r for r in multi if r.fabric.network in kinds]
            lat.update(dict.fromkeys(kinds, lat_fit(sel, kinds, lat) if sel else pooled))
    cal = cal.with_(net_latency_us={**cal.net_latency_us, **lat})
    for p in ("LL", "LL128"):
        fit("proto_bw", [r for r in mid if proto(r) == p], 0.2, 2.0, p)
    x = _fit1(lambda x: _log_loss(cal.with_(fill_slices=x - 1e-3), rows, bases), 1e-3, 20.0)
    return cal.with_(fill_slices=round(x - 1e-3, 2))
