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
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from dplab.sim.constants_fit import UNFITTED, fit_calibration
from dplab.sim.fabric import Fabric
from dplab.sim.nccl_model import DEFAULT_CALIBRATION, Calibration
from dplab.sim.published import (
    Row,
    box_class,
    excluded_why,
    fabric_of,
    forced_algorithm,
    published_rows,
    source_of,
)

__all__ = [
    "BANDS",
    "UNFITTED",
    "BandError",
    "Prediction",
    "Row",
    "band_errors",
    "band_line",
    "band_of",
    "box_class",
    "class_errors",
    "excluded_why",
    "fabric_of",
    "fit_calibration",
    "forced_algorithm",
    "leave_one_source_out",
    "published_rows",
    "self_calibration",
    "source_of",
    "validation_bands",
]  # fmt: skip

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


# -- fitting the constants NCCL's source does not give ------------------------------------------


def leave_one_source_out(rows: Sequence[Row] | None = None) -> list[Prediction]:
    """Every row predicted with constants fitted on the other sources' rows only."""
    rows = published_rows() if rows is None else list(rows)
    out = []
    for src in dict.fromkeys(r.source for r in rows):
        cal = fit_calibration([r for r in rows if r.source != src])
        fabs: dict[str, Fabric] = {}
        for r in rows:
            if r.source == src:
                f = fabs.get(r.run) or fabs.setdefault(r.run, r.fabric_with(cal))
                us = f.allreduce_s(r.nbytes, algorithm=r.algorithm) * 1e6
                out.append(Prediction(r, us, cal))
    return out


def band_of(nbytes: float) -> str:
    return next(name for name, lo, hi in BANDS if lo <= nbytes <= hi)


def band_errors(predictions: Iterable[Prediction]) -> tuple[BandError, ...]:
    """Median error, median and worst factor per band (bands with no row are left out)."""
    by_band: dict[str, list[Prediction]] = {name: [] for name, _, _ in BANDS}
    for p in predictions:
        if not p.row.excluded:
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
            fab = (
                rs[0]
                .fabric_with(DEFAULT_CALIBRATION)
                .calibrated_from(log, algorithm=rs[0].algorithm)
            )
            for r in predict:
                us = fab.allreduce_s(r.nbytes, algorithm=r.algorithm) * 1e6
                out.append(Prediction(r, us, fab.calibration))
    return out


def band_line(bands: Sequence[BandError] | None = None) -> str:
    """The simulator's error by message size in one line, for a lesson to print beside a
    prediction: leave one published source out, median and worst per band (default
    :func:`validation_bands`)."""
    parts = []
    for b in validation_bands() if bands is None else bands:
        med = f"×{b.median_factor:.2f}" if b.band == "≤ 64 KiB" else f"{b.median_error:.0%}"
        parts.append(f"{b.band}: {med} median, worst ×{b.worst_factor:.2f}")
    return "simulated all-reduce vs published runs (leave one source out) — " + "; ".join(parts)


def class_errors(predictions: Iterable[Prediction]) -> dict[str, tuple[BandError, ...]]:
    """:func:`band_errors` per kind of box (:func:`box_class`): where the model can be trusted
    for a learner's box."""
    by: dict[str, list[Prediction]] = {}
    for p in predictions:
        by.setdefault(box_class(p.row.fabric), []).append(p)
    return {k: band_errors(v) for k, v in sorted(by.items())}
