"""Fabric's error on clusters it never saw: leave one source out over the published runs
(``dplab.sim.validation``), and ``validation_bands()``, the record a notebook shows beside its
predictions.

A constant fitted on a row never validates that row: every fold's constants are refitted
without the held-out source, and where a network kind has no row left (the only InfiniBand run
is NVIDIA/nccl#812's), its hop latency comes from the other networks, not from the shipped
value fitted on that very run. Issue 28's goals are asserted as stated; those not met yet are
strict xfails carrying the figure measured, so they cannot pass silently or be forgotten.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from dplab.sim import BandError, validation_bands
from dplab.sim.nccl_model import DEFAULT_CALIBRATION
from dplab.sim.validation import (
    BANDS,
    band_errors,
    band_of,
    fit_calibration,
    leave_one_source_out,
    published_rows,
)


@pytest.fixture(scope="module")
def rows():
    return published_rows()


@pytest.fixture(scope="module")
def loso(rows):
    return leave_one_source_out(rows)


def _band(preds, name):
    return next(b for b in band_errors(preds) if b.band == name)


def test_every_fold_is_fitted_without_its_source(rows, loso):
    assert len(loso) == len(rows) and len({p.row.source for p in loso}) >= 5
    for source in {p.row.source for p in loso}:
        fitted = fit_calibration([r for r in rows if r.source != source])
        assert all(p.calibration == fitted for p in loso if p.row.source == source), source
    # the held-out rows matter to the fit: with them in, the constants would differ
    stas00 = next(p for p in loso if p.row.source == "stas00/ml-engineering")
    assert stas00.calibration != fit_calibration(rows)


def test_a_network_with_no_row_left_borrows_the_others_latency(loso):
    """nccl#812 is the only IB run: held out, IB's hop latency is fitted on EFA's rows, not
    the shipped value (which was fitted on that run)."""
    fold = next(p.calibration for p in loso if p.row.source == "NVIDIA/nccl")
    assert fold.net_latency_us["ib"] == fold.net_latency_us["efa"]
    assert fold.net_latency_us["ib"] != DEFAULT_CALIBRATION.net_latency_us["ib"]


def test_validation_bands_are_the_leave_one_source_out_errors(loso):
    bands = validation_bands()
    assert all(isinstance(b, BandError) for b in bands)
    assert bands == band_errors(loso)
    order = [name for name, _, _ in BANDS]
    assert [b.band for b in bands] == sorted((b.band for b in bands), key=order.index)
    assert sum(b.rows for b in bands) == len(loso)
    counts = Counter(band_of(p.row.nbytes) for p in loso)
    for b in bands:
        assert b.rows == counts[b.band]
        assert b.median_error >= 0 and 1 <= b.median_factor <= b.worst_factor < math.inf
        run = b.worst_row.split(" @ ")[0]
        assert any(p.row.run == run for p in loso)


# --- issue 28's goals, leave one source out --------------------------------------------------


def test_small_messages_median_within_1_5x(loso):
    assert _band(loso, "≤ 64 KiB").median_factor <= 1.5


def test_large_messages_median_within_15_percent(loso):
    assert _band(loso, "≥ 64 MiB").median_error <= 0.15


@pytest.mark.xfail(
    strict=True,
    reason="measured 16.4 % (8 rows): stas00's A100 sweep (a -g 8 run) 1 MiB ×0.36 and 16 MiB "
    "×0.65, p4de 16 MiB ×0.80, Azure NVLS 1 MiB ×0.76",
)
def test_bucket_sizes_median_within_15_percent(loso):
    assert _band(loso, "1–32 MiB").median_error <= 0.15


@pytest.mark.xfail(
    strict=True,
    reason="measured: stas00's A100 sweep (a -g 8 run) 1 MiB ×0.36, 16 MiB ×0.65",
)
def test_every_row_from_1_mib_within_1_5x(loso):
    bad = [
        (p.row.run, p.row.nbytes, round(p.ratio, 2))
        for p in loso
        if p.row.nbytes >= 2**20 and max(p.ratio, 1 / p.ratio) > 1.5
    ]
    assert not bad


def test_the_error_figure_draws_every_band(loso):
    from dplab.viz.fabric_error import fabric_error_figure

    bands = band_errors(loso)
    fig = fabric_error_figure(bands)
    median, worst = fig.data
    assert list(median.y) == [b.median_factor for b in bands]
    assert list(worst.y) == [b.worst_factor for b in bands]
    assert all(f"({b.rows} rows)" in x for b, x in zip(bands, median.x, strict=True))
    with pytest.raises(ValueError, match="bands must be BandError records"):
        fabric_error_figure([{"band": "≤ 64 KiB"}])
