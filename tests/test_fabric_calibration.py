"""Fabric calibrated from a user's own measurements: ``Fabric.calibrated_from``, the
``net_latency_us`` keyword, and ``simulate --nccl-tests-log`` / ``--net-latency-us``.

Oracles: synthetic nccl-tests logs printed from a fabric whose constants are known (the fit must
find them), NCCL's latency formula for one network hop (``src/graph/tuning.cc``: a ring's
inter-node step pays the network's latency once, twice with Simple's flush), and each published
run taken as "the user's log": fitted on alternate rows, it must predict the rows it did not see
within 10 % median per size band (issue 28). Where it does not yet, the case is a strict xfail
that states the measured figure, so the shortfall is visible and a fix is noticed.
"""

from __future__ import annotations

import statistics
from collections import Counter

import pytest

from dplab.sim import Fabric
from dplab.sim.nccl_model import DEFAULT_CALIBRATION
from dplab.sim.nccl_tests import format_nccl_tests
from dplab.sim.validation import band_of, published_rows, self_calibration

GOAL = 0.10
# (source, band): median error measured on 2026-12-04 with the shipped model (the graph-file
# run, a configuration the model has no setting for, is left out: test_fabric_loso names it)
SHORT = {
    ("aws-samples/awsome-distributed-training", "1–32 MiB"): "20.7 %: 1 MiB ×1.30, 16 MiB ×0.88",
    ("stas00/ml-engineering", "1–32 MiB"): "16.8 %: A100 1 MiB ×0.80 (-g 8), H200 16 MiB ×0.84",
    ("Azure/AI-benchmarking-guide", "≤ 64 KiB"): "19.2 %: NVLS 1 KiB ×1.31, 64 KiB ×0.81",
    ("Azure/AI-benchmarking-guide", "1–32 MiB"): "10.8 %: NVLS 16 MiB ×1.15",
    ("dstackai/dstack", "64 KiB–1 MiB"): "15.6 %: Nebius 512 KiB ×0.74, 256 KiB ×1.16",
    (
        "JingchaoZhang/JingchaoZhang.github.io",
        "64 KiB–1 MiB",
    ): "12.3 %: 512 KiB ×1.22, 128 KiB ×1.12",
    ("oracle-japan/ocitutorials", "1–32 MiB"): "10.1 %: 32 MiB ×1.65, 1 MiB ×1.62 (noisy RoCE run)",
}


@pytest.fixture(scope="module")
def own_log_predictions():
    return self_calibration()


def _cases():
    rows = [r for r in published_rows() if not r.excluded]
    seen = dict.fromkeys((r.source, band_of(r.nbytes)) for r in rows)
    for source, band in seen:
        marks = []
        if (source, band) in SHORT:
            reason = f"not yet within 10 %: {SHORT[source, band]}"
            marks = [pytest.mark.xfail(strict=True, reason=reason)]
        yield pytest.param(source, band, marks=marks, id=f"{source}|{band}")


@pytest.mark.parametrize(("source", "band"), list(_cases()))
def test_your_own_log_predicts_its_other_rows(own_log_predictions, source, band):
    preds = [
        p
        for p in own_log_predictions
        if p.row.source == source and band_of(p.row.nbytes) == band and not p.row.excluded
    ]
    assert preds
    errors = [abs(p.ratio - 1) for p in preds]
    assert statistics.median(errors) <= GOAL, [(p.row.run, p.row.nbytes, p.ratio) for p in preds]


def test_every_row_is_predicted_by_a_fit_that_never_saw_it(own_log_predictions):
    rows = published_rows()
    per_run = Counter(r.run for r in rows)  # a one-row log has nothing left to predict
    assert len(own_log_predictions) == sum(n for n in per_run.values() if n > 1)
    p4de = sorted((r for r in rows if r.run == "aws-p4de-2node-efa1"), key=lambda r: r.nbytes)
    fit_on = [{"size_bytes": r.nbytes, "time_s": r.measured_us * 1e-6} for r in p4de[0::2]]
    fab = p4de[0].fabric_with(DEFAULT_CALIBRATION).calibrated_from(fit_on)
    got = {p.row.nbytes: p.predicted_us for p in own_log_predictions if p.row.run == p4de[0].run}
    for r in p4de[1::2]:  # the odd rows come from the fit on the even ones
        assert got[r.nbytes] == pytest.approx(fab.allreduce_s(r.nbytes) * 1e6, rel=1e-12)


# --- the fit finds known constants -------------------------------------------------------------


def _truth(nodes: int, bw: float, lat: float, fill: float) -> Fabric:
    base = Fabric.from_hardware("h100", nodes=nodes, network="ib")
    c = base.calibration
    return base.with_calibration(
        c.with_(
            bw_efficiency=c.bw_efficiency * bw,
            nvls_efficiency=c.nvls_efficiency * bw,
            latency_scale=lat,
            fill_slices=fill,
        )
    )


@pytest.mark.parametrize(("bw", "lat", "fill"), [(0.7, 2.0, 4.0), (1.05, 0.6, 0.5)])
def test_calibrated_from_a_two_node_log_predicts_sixteen_nodes(bw, lat, fill):
    """Calibrate on a 2-node log (its # Rank lines say 16 ranks), predict 16 nodes."""
    sizes = [2**k for k in range(3, 35)]
    log = format_nccl_tests([(s, _truth(2, bw, lat, fill).allreduce_s(s) * 1e6) for s in sizes], 16)
    fab = Fabric.from_hardware("h100", nodes=16, network="ib").calibrated_from(log)
    assert fab.nodes == 16 and "fitted" in fab.name
    truth16 = _truth(16, bw, lat, fill)
    for s in (2**12, 2**20, 2**25, 2**30):
        assert fab.allreduce_s(s) == pytest.approx(truth16.allreduce_s(s), rel=0.03), s
    assert fab.calibration.latency_scale == pytest.approx(lat, rel=0.03)


def test_a_sweep_of_eight_sizes_or_more_also_fits_each_protocols_bandwidth():
    """Where LL and LL128 run slower or faster than the shipped factors say, a 3-constant fit
    misses the protocol switch; from PROTOCOL_FIT_POINTS rows the fit finds them too."""
    base = Fabric.preset("dgx-a100")
    c = base.calibration
    bw = {"LL": c.proto_bw["LL"] * 0.6, "LL128": c.proto_bw["LL128"] * 1.8}
    truth = base.with_calibration(c.with_(proto_bw=bw))
    sizes = [2**k for k in range(3, 34)]
    fab = base.calibrated_from(
        format_nccl_tests([(s, truth.allreduce_s(s) * 1e6) for s in sizes], 8)
    )
    assert "LL bandwidth ×" in fab.source and "LL128 bandwidth ×" in fab.source
    for s in (2**16, 2**18, 2**20, 2**22, 2**24):
        assert fab.allreduce_s(s) == pytest.approx(truth.allreduce_s(s), rel=0.03), s
    few = base.calibrated_from(
        format_nccl_tests([(s, truth.allreduce_s(s) * 1e6) for s in sizes[:7]], 8)
    )
    assert "LL bandwidth" not in few.source


def test_calibrated_from_names_a_log_of_other_hardware():
    log = format_nccl_tests([(8, 30.0), (2**20, 60.0)], 12)
    with pytest.raises(ValueError, match="12 ranks, not a whole number of 8-GPU nodes"):
        Fabric.preset("dgx-h100", nodes=4).calibrated_from(log)
    with pytest.raises(ValueError, match="need at least 1 measured sizes to fit, got 0"):
        Fabric.preset("dgx-h100").calibrated_from([])


# --- the network hop latency no public source gives ---------------------------------------------


def test_net_latency_us_is_the_network_hop_in_nccls_formula():
    """A 2-node ring crosses the network 2·(nodes−1) = 2 times; LL pays the hop latency once
    per crossing, Simple twice (the flush): tuning.cc's interLat."""
    base = Fabric.preset("dgx-h100", nodes=2)
    slow = Fabric.preset(
        "dgx-h100", nodes=2, net_latency_us=base.calibration.net_latency_us["ib"] + 10
    )
    for proto, crossings in (("LL", 2), ("Simple", 4)):
        delta = slow.topology.time_us(8, "ring", proto) - base.topology.time_us(8, "ring", proto)
        assert delta == pytest.approx(10 * crossings)
    assert slow.calibration.net_latency_us["efa"] == base.calibration.net_latency_us["efa"]
    one = Fabric.preset("dgx-h100", net_latency_us=500)  # one node: no network hop
    assert one.allreduce_s(2**20) == Fabric.preset("dgx-h100").allreduce_s(2**20)
    with pytest.raises(ValueError, match="net_latency_us must be >= 0, got -1"):
        Fabric.preset("dgx-h100", nodes=2, net_latency_us=-1)


# --- the CLI -----------------------------------------------------------------------------------


def _comm_ms(capsys) -> float:
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("t_comm"))
    return float(line.split()[-2].replace(",", ""))


def test_cli_simulate_with_your_latency_and_your_log(capsys, tmp_path):
    from dplab.cli import main

    argv = ["simulate", "--preset", "aws-p5", "--nodes", "16", "--model", "gpt-7m"]
    assert main(argv) == 0
    base = _comm_ms(capsys)
    assert main([*argv, "--net-latency-us", "200"]) == 0
    assert _comm_ms(capsys) > base  # a slower hop: more time in all-reduces
    slow = _truth(2, 0.5, 3.0, 1.46)
    log = tmp_path / "all_reduce_perf.txt"
    log.write_text(
        format_nccl_tests([(2**k, slow.allreduce_s(2**k) * 1e6) for k in range(3, 33)], 16)
    )
    argv = ["simulate", "--gpu", "h100", "--nodes", "16", "--model", "gpt-7m"]
    assert main(argv) == 0
    fast = _comm_ms(capsys)
    assert main([*argv, "--nccl-tests-log", str(log)]) == 0
    assert _comm_ms(capsys) > 1.5 * fast
    assert main(["simulate", "--model", "gpt-7m", "--nccl-tests-log", str(log)]) == 2
    assert "--nccl-tests-log needs a fabric" in capsys.readouterr().err
    assert main([*argv, "--nccl-tests-log", str(tmp_path / "none.txt")]) == 2
    assert "no file at" in capsys.readouterr().err
    assert main([*argv, "--net-latency-us", "-5"]) == 2
    assert "net_latency_us must be >= 0, got -5.0" in capsys.readouterr().err
