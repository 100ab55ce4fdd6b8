"""How far to trust :class:`~dplab.sim.Fabric`: its error on published runs it was never fitted to.

The repository carries published nccl-tests runs (``assets/data/nccl-tests-published.json``),
each quoted from a source (a vendor's repository, a maintainer's issue thread, a blog). The model
has a few constants NCCL's source does not give (:class:`~dplab.sim.nccl_model.Calibration`), and
a constant fitted on a row must never validate that row. So the check is *leave one source out*:
for each source, fit the constants on every other source's rows, then predict the held-out
source's rows. Runs from one source share an author's habits (harness, flags, machines), so a
source, not a run, is the unit held out.

The result, per message-size band, is what a learner should read beside a prediction:

    for band in dplab.sim.validation_bands():
        print(band.band, band.rows, f"{band.median_error:.0%}", f"×{band.worst_factor:.2f}")

Errors are ``predicted / measured − 1`` of time; a factor is ``max(p/m, m/p)``, so a prediction
twice too fast and one twice too slow both count as ×2.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from dplab.sim.fabric import Fabric
from dplab.sim.nccl_model import DEFAULT_CALIBRATION, NCCL_NET_LATENCY_US, Calibration
from dplab.sim.nccl_tests import published_runs

KIB, MIB = 2**10, 2**20
SMALL, LARGE = 64 * KIB, 64 * MIB
# name, smallest and largest bytes (inclusive): the bands the issue reports in; 1–32 MiB holds
# DDP's bucket sizes (torch's default cap is 25 MiB, its first bucket 1 MiB).
BANDS: tuple[tuple[str, float, float], ...] = (
    ("≤ 64 KiB", 0, SMALL),
    ("64 KiB–1 MiB", SMALL + 1, MIB - 1),
    ("1–32 MiB", MIB, LARGE - 1),
    ("≥ 64 MiB", LARGE, math.inf),
)
NETWORK_GROUPS = (("efa",), ("ib", "roce"))  # one latency each; RoCE rides IB's verbs plugin


@dataclass(frozen=True)
class Row:
    """One published size of one run: what was measured and the fabric that run was."""

    run: str
    source: str
    config: str
    algorithm: str
    nbytes: int
    measured_us: float
    fabric: Fabric

    def ratio(self, fabric: Fabric | None = None) -> float:
        """predicted / measured time (with ``fabric``'s constants, default the run's own)."""
        f = fabric or self.fabric
        return f.allreduce_s(self.nbytes, algorithm=self.algorithm) * 1e6 / self.measured_us


@dataclass(frozen=True)
class Prediction:
    """A row predicted with constants fitted without its source."""

    row: Row
    predicted_us: float
    calibration: Calibration

    @property
    def ratio(self) -> float:
        return self.predicted_us / self.row.measured_us


@dataclass(frozen=True)
class BandError:
    """The model's leave-one-source-out error in one message-size band."""

    band: str
    rows: int
    median_error: float  # median |predicted/measured − 1|
    median_factor: float  # median max(p/m, m/p)
    worst_factor: float
    worst_row: str  # "run @ size: predicted/measured"


def source_of(run: dict[str, Any]) -> str:
    """The source a run was quoted from: a GitHub repository (``owner/name``), a gist author
    (``gist:owner``), or the source text itself."""
    text = run["source"]
    if m := re.search(r"gist\.github\.com/([^/\s]+)", text):
        return f"gist:{m.group(1)}"
    if m := re.search(r"github\.com/([^/\s]+)/([^/\s#]+)", text):
        return f"{m.group(1)}/{m.group(2)}"
    return text


def _gpu(text: str) -> str:
    t = text.lower()
    for g in ("gb200", "b200", "h200", "h100", "h20", "a100", "v100"):
        if g in t:
            return g
    raise ValueError(f"unknown GPU in the data: {text!r}")


def forced_algorithm(text: str | None) -> str:
    """The algorithm a run's source forced (``NCCL_ALGO``, ``NCCL_NVLS_ENABLE=0``), else auto."""
    t = (text or "default").lower()
    if t.startswith("ring") or "nvls_enable=0" in t:
        return "ring"
    if "forced" in t and not t.startswith("default"):
        for a in ("nvlstree", "nvls", "tree", "ring"):
            if t.startswith(a):
                return a
    return "auto"


def fabric_of(run: dict[str, Any], calibration: Calibration = DEFAULT_CALIBRATION) -> Fabric:
    """A published run's own hardware as a Fabric (network ``efa`` where the source says EFA,
    ``ib`` otherwise)."""
    network = "efa" if "efa" in (run.get("inter_node") or "").lower() else "ib"
    nodes = int(run["nodes"])
    return Fabric.from_hardware(
        _gpu(run["gpu"]),
        int(run["gpus_per_node"]),
        nodes,
        int(run["nics_per_node"]) if nodes > 1 else None,
        float(run["nic_gbps"]) if nodes > 1 else None,
        network,
        calibration=calibration,
        name=run["id"],
    )


def published_rows(runs: Iterable[dict[str, Any]] | None = None) -> list[Row]:
    """Every sized row of the published runs. A row with only bus bandwidth is compared as the
    time it implies, ``t = bytes · 2(N−1)/N / busbw`` (nccl-tests' definition); a quoted peak
    with no size is left out (it has no size to put in a band)."""
    rows = []
    for run in published_runs() if runs is None else runs:
        fab = fabric_of(run)
        n = fab.world_size
        config = f"{run['gpus_per_node']}×{fab.gpu.upper()} × {run['nodes']}" + (
            f", {run['nics_per_node']}×{run['nic_gbps']:g}G {fab.network}" if fab.nodes > 1 else ""
        )
        for r in run["rows"]:
            b, t, bus = r.get("bytes"), r.get("time_us"), r.get("busbw_GBps")
            if not b:
                continue
            if t is None:
                if not bus:
                    continue
                t = b * 2 * (n - 1) / n / (bus * 1e9) * 1e6
            rows.append(Row(run["id"], source_of(run), config,
                            forced_algorithm(run.get("algo")), int(b), float(t), fab))  # fmt: skip
    return rows


# -- fitting the constants NCCL's source does not give ------------------------------------------


def _log_loss(cal: Calibration, rows: Sequence[Row]) -> float:
    """Sum of |log(predicted/measured)|: a robust loss (one odd row cannot drag a constant)."""
    fabs: dict[str, Fabric] = {}
    total = 0.0
    for r in rows:
        f = fabs.get(r.run)
        if f is None:
            f = fabs[r.run] = r.fabric.with_calibration(cal)
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
)


def fit_calibration(rows: Sequence[Row], *, passes: int = 2) -> Calibration:
    """The global constants, fitted on ``rows`` alone, starting from NCCL's own model
    (:data:`UNFITTED`), in stages, each to the rows it governs:

    1. ``bw_efficiency`` to the ring/tree rows ≥ 64 MiB, ``nvls_efficiency`` to the NVLS and
       NVLS-tree rows ≥ 64 MiB (NCCL's own 1.0 when no such row is given);
    2. the network hop latency of each network kind (EFA; IB and RoCE together) to the
       multi-node rows ≤ 64 KiB on it; a kind with no such row takes the latency fitted on all
       multi-node rows ≤ 64 KiB; with none at all, NCCL's own (:data:`NCCL_NET_LATENCY_US`);
    3. ``fill_slices`` to every row, the others fixed.

    The stages depend on each other a little (a large row has some latency and fill), so they
    run ``passes`` times, each pass from the last one's constants.
    """
    cal = UNFITTED
    for _ in range(passes):
        cal = _fit_stages(cal, rows)
    return cal


def _fit_stages(cal: Calibration, rows: Sequence[Row]) -> Calibration:
    large = [r for r in rows if r.nbytes >= LARGE]
    nvls = [r for r in large if r.fabric.choice(r.nbytes, r.algorithm)[0].startswith("nvls")]
    rest = [r for r in large if r not in nvls]
    if rest:
        x = _fit1(lambda x: _log_loss(cal.with_(bw_efficiency=x), rest), 0.5, 1.2)
        cal = cal.with_(bw_efficiency=round(x, 3))
    if nvls:
        x = _fit1(lambda x: _log_loss(cal.with_(nvls_efficiency=x), nvls), 0.4, 1.2)
        cal = cal.with_(nvls_efficiency=round(x, 3))
    small = [r for r in rows if r.nbytes <= SMALL and r.fabric.nodes > 1]

    def lat_fit(sel: list[Row], kinds: Sequence[str], base: dict[str, float]) -> float:
        def loss(x: float) -> float:
            return _log_loss(cal.with_(net_latency_us={**base, **dict.fromkeys(kinds, x)}), sel)

        return round(_fit1(loss, 0.1, 300.0), 1)

    lat = {k: NCCL_NET_LATENCY_US[k] for g in NETWORK_GROUPS for k in g}
    if small:
        pooled = lat_fit(small, [k for g in NETWORK_GROUPS for k in g], lat)
        for kinds in NETWORK_GROUPS:
            sel = [r for r in small if r.fabric.network in kinds]
            lat.update(dict.fromkeys(kinds, lat_fit(sel, kinds, lat) if sel else pooled))
    cal = cal.with_(net_latency_us={**cal.net_latency_us, **lat})
    x = _fit1(lambda x: _log_loss(cal.with_(fill_slices=x - 1e-3), rows), 1e-3, 20.0)
    return cal.with_(fill_slices=round(x - 1e-3, 2))


def leave_one_source_out(rows: Sequence[Row] | None = None) -> list[Prediction]:
    """Every row predicted with constants fitted on the other sources' rows only."""
    rows = published_rows() if rows is None else list(rows)
    out = []
    for src in dict.fromkeys(r.source for r in rows):
        cal = fit_calibration([r for r in rows if r.source != src])
        fabs: dict[str, Fabric] = {}
        for r in rows:
            if r.source == src:
                f = fabs.setdefault(r.run, r.fabric.with_calibration(cal))
                us = f.allreduce_s(r.nbytes, algorithm=r.algorithm) * 1e6
                out.append(Prediction(r, us, cal))
    return out


def band_of(nbytes: float) -> str:
    return next(name for name, lo, hi in BANDS if lo <= nbytes <= hi)


def band_errors(predictions: Iterable[Prediction]) -> tuple[BandError, ...]:
    """Median error, median and worst factor per band (bands with no row are left out)."""
    by_band: dict[str, list[Prediction]] = {name: [] for name, _, _ in BANDS}
    for p in predictions:
        by_band[band_of(p.row.nbytes)].append(p)
    out = []
    for name, ps in by_band.items():
        if not ps:
            continue
        factors = [max(p.ratio, 1 / p.ratio) for p in ps]
        worst = ps[factors.index(max(factors))]
        out.append(BandError(
            band=name,
            rows=len(ps),
            median_error=statistics.median(abs(p.ratio - 1) for p in ps),
            median_factor=statistics.median(factors),
            worst_factor=max(factors),
            worst_row=f"{worst.row.run} @ {_size(worst.row.nbytes)}: ×{worst.ratio:.2f}",
        ))  # fmt: skip
    return tuple(out)


@lru_cache(maxsize=1)
def validation_bands() -> tuple[BandError, ...]:
    """The model's error per message-size band, leave-one-source-out over the published runs
    the repository carries, computed now (well under a second; cached for the session)."""
    return band_errors(leave_one_source_out())


def _size(b: int) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", MIB), ("KiB", KIB)):
        if b >= k and b % k == 0:
            return f"{b // k} {unit}"
    return f"{b} B"


# -- a user's own log: calibrate on some of its rows, predict the others -------------------------


def self_calibration(rows: Sequence[Row] | None = None) -> list[Prediction]:
    """Each run taken as a user's own nccl-tests log: :meth:`Fabric.calibrated_from` fitted on
    every other row of it (sizes in order), predicting the rows left out, then the other way
    round, so every row is predicted once by a fit that never saw it."""
    rows = published_rows() if rows is None else list(rows)
    runs: dict[str, list[Row]] = {}
    for r in rows:
        runs.setdefault(r.run, []).append(r)
    out = []
    for rs in runs.values():
        rs = sorted(rs, key=lambda r: r.nbytes)
        for fit_on, predict in ((rs[0::2], rs[1::2]), (rs[1::2], rs[0::2])):
            if not fit_on or not predict:
                continue
            log = [{"size_bytes": r.nbytes, "time_s": r.measured_us * 1e-6} for r in fit_on]
            fab = rs[0].fabric.calibrated_from(log, algorithm=rs[0].algorithm)
            for r in predict:
                us = fab.allreduce_s(r.nbytes, algorithm=r.algorithm) * 1e6
                out.append(Prediction(r, us, fab.calibration))
    return out
