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
from dataclasses import replace

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


def test_a_network_with_no_row_left_borrows_the_others_latency(rows):
    """With every IB and RoCE run held out, IB's hop latency is fitted on EFA's rows, not the
    shipped value (which was fitted on those runs)."""
    no_ib = [r for r in rows if r.fabric.nodes == 1 or r.fabric.network == "efa"]
    fold = fit_calibration(no_ib)
    assert fold.net_latency_us["ib"] == fold.net_latency_us["efa"]
    assert fold.net_latency_us["ib"] != DEFAULT_CALIBRATION.net_latency_us["ib"]


def test_validation_bands_are_the_leave_one_source_out_errors(loso):
    bands = validation_bands()
    assert all(isinstance(b, BandError) for b in bands)
    assert bands == band_errors(loso)
    order = [name for name, _, _ in BANDS]
    assert [b.band for b in bands] == sorted((b.band for b in bands), key=order.index)
    kept = [p for p in loso if not p.row.excluded]  # the graph-file run: named, not banded
    assert sum(b.rows for b in bands) == len(kept) < len(loso)
    counts = Counter(band_of(p.row.nbytes) for p in kept)
    for b in bands:
        assert b.rows == counts[b.band]
        assert b.median_error >= 0 and 1 <= b.median_factor <= b.worst_factor < math.inf
        run = b.worst_row.split(" @ ")[0]
        assert any(p.row.run == run for p in loso)


# --- issues 28's and 42's goals, leave one source out -----------------------------------------


def _factor(p) -> float:
    return max(p.ratio, 1 / p.ratio)


def test_small_messages_median_within_1_5x(loso):
    assert _band(loso, "≤ 64 KiB").median_factor <= 1.5


def test_every_small_message_row_within_3x(loso):
    small = [p for p in loso if p.row.nbytes <= 2**16 and not p.row.excluded]
    assert len(small) > 50
    bad = [(p.row.run, p.row.nbytes, round(p.ratio, 2)) for p in small if _factor(p) > 3]
    assert not bad


def test_large_messages_median_within_10_percent(loso):
    assert _band(loso, "≥ 64 MiB").median_error <= 0.10


def test_bucket_sizes_median_within_15_percent(loso):
    assert _band(loso, "1–32 MiB").median_error <= 0.15


@pytest.mark.xfail(
    strict=True,
    reason="measured: OCI's 2-node RoCE run ×0.17–0.63 from 4 MiB up (its plateau, 71.6 GB/s, "
    "is 37 % of what its 16 × 100 Gb/s NICs carry in NCCL's model); every other row within 1.5×",
)
def test_every_row_from_1_mib_within_1_5x(loso):
    bad = [
        (p.row.run, p.row.nbytes, round(p.ratio, 2))
        for p in loso
        if p.row.nbytes >= 2**20 and _factor(p) > 1.5 and not p.row.excluded
    ]
    assert not bad


def test_the_graph_file_run_is_named_and_kept_out(rows, loso):
    """Azure's preset NCCL_GRAPH_FILE caps the NC48 A100 box at a quarter of its bandwidth: a
    setting the model does not have. It is kept out of fits and bands, named, and predicted as
    the hardware (so ×0.25–0.3 at ≥ 64 MiB), while the same box without the file is banded."""
    out = {r.run for r in rows if r.excluded}
    assert out == {"azure-nc48v4-a100pcie-2gpu-graphfile"}
    graph = [p for p in loso if p.row.run in out and p.row.nbytes >= 2**26]
    assert graph and all(0.2 < p.ratio < 0.35 for p in graph)
    bridged = [p for p in loso if p.row.run == "azure-nc48v4-a100pcie-2gpu-nvlink"]
    assert bridged and all(not p.row.excluded for p in bridged)
    assert all(_factor(p) < 1.5 for p in bridged if p.row.nbytes >= 2**26)


def test_runs_without_nic_fields_are_calibrated_on_their_own_plateau(rows):
    """GKE's and Nebius's sources give no NIC speed: their largest row sets the NICs (and is
    then not a row); every other row is predicted."""
    runs = {r.run: r for r in rows if r.plateau is not None}
    assert set(runs) == {"gke-h200-2node-1gpu-rdma", "nebius-h100-2node-ib"}
    for run, r in runs.items():
        b, us = r.plateau
        assert all(x.nbytes < b for x in rows if x.run == run)
        fab = r.fabric_with(DEFAULT_CALIBRATION)
        assert "plateau" in fab.source
        got = fab.allreduce_s(b, algorithm=r.algorithm) * 1e6
        # where NVLS, not the NICs, sets the plateau, the slowest NICs reaching it are taken
        floor = replace(fab, nic_gbps=12800.0, _cache={}).allreduce_s(b, algorithm=r.algorithm)
        assert got == pytest.approx(max(us, floor * 1e6), rel=0.01)
