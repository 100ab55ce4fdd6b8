"""Fabric: NCCL's cost model against published nccl-tests runs, and its parts on their own.

The oracle is measurement nobody here made: ``assets/data/nccl-tests-published.json`` (vendor
and maintainer logs) and nccl-tests' own printed columns. The model's few constants are fitted
on a training subset (benchmarks/fabric_validation.py); the held-out runs must meet the goals
too, and the shipped constants must be what that fit gives, so none is tuned by hand.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

from dplab.collectives.cost import ring_time
from dplab.sim.fabric import PRESETS, Fabric, busbw_from_time, with_straggler
from dplab.sim.nccl_model import DEFAULT_CALIBRATION, Calibration
from dplab.sim.nccl_tests import PUBLISHED_JSON, format_nccl_tests, parse_nccl_tests
from dplab.sim.validation import published_rows

ROOT = Path(__file__).resolve().parents[1]
DATA = PUBLISHED_JSON


def _validation():
    spec = importlib.util.spec_from_file_location(
        "fabric_validation", ROOT / "benchmarks" / "fabric_validation.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def val():
    return _validation()


@pytest.fixture(scope="module")
def rows():
    return published_rows()


# --- the shipped constants on every published run (leave-one-source-out: test_fabric_loso) --


def _band(rows, lo, hi):
    ratios = [r.ratio() for r in rows if lo <= r.nbytes <= hi and not r.excluded]
    errors = [abs(x - 1) for x in ratios]
    factors = [max(x, 1 / x) for x in ratios]
    return len(ratios), statistics.median(errors), statistics.median(factors), max(factors)


@pytest.mark.parametrize("subset", ["all", "held-out"])
def test_published_runs_meet_the_goals(val, rows, subset):
    """The shipped constants were fitted on TRAIN_IDS: the held-out runs must meet the goals
    too (notebook 08 labels them so)."""
    sel = rows if subset == "all" else [r for r in rows if r.run not in val.TRAIN_IDS]
    n, median_error, _, worst = _band(sel, 64 * 2**20, math.inf)
    assert n >= (20 if subset == "all" else 5)
    assert median_error <= 0.10, median_error
    _, _, median_factor, _ = _band(sel, 0, 64 * 2**10)
    assert median_factor <= 1.5
    if subset == "held-out":
        assert worst <= 1.5, worst


@pytest.mark.xfail(
    strict=True,
    reason="measured ×5.5 at worst: OCI's 2-node RoCE run at 64 MiB (measured 6,058 µs, "
    "out-of-place; its in-place time is 3,710 µs); its plateau is 37 % of NCCL's model",
)
def test_every_large_row_within_1_5x_with_the_shipped_constants(rows):
    _, _, _, worst = _band(rows, 64 * 2**20, math.inf)
    assert worst <= 1.5, worst


def test_every_published_row_is_compared(val, rows):
    runs = json.loads(DATA.read_text())
    usable = sum(
        1
        for r in runs
        for row in r["rows"]
        if row["bytes"] and (row["time_us"] is not None or row["busbw_GBps"])
    )
    plateaus = {r.run for r in rows if r.plateau is not None}  # one row each sets the NICs
    assert len(rows) == usable - len(plateaus) and len(plateaus) == 2
    held = {r.run for r in rows if r.run not in val.TRAIN_IDS}
    assert held and {r.run for r in rows} > set(val.TRAIN_IDS)


def test_shipped_constants_are_the_training_fit(val, rows):
    fitted = val.shipped_fit(rows)
    d = DEFAULT_CALIBRATION
    assert fitted.bw_efficiency == pytest.approx(d.bw_efficiency, rel=0.01)
    assert fitted.nvls_efficiency == pytest.approx(d.nvls_efficiency, rel=0.01)
    assert fitted.fill_slices == pytest.approx(d.fill_slices, rel=0.05, abs=0.05)
    for net in ("efa", "ib"):
        assert fitted.net_latency_us[net] == pytest.approx(d.net_latency_us[net], rel=0.02)


def test_issue_quoted_p5_two_nodes():
    """Issue 16 quotes 487 GB/s busbw for 2 × p5 (32 × 100 Gb/s EFA) at 16 GiB, a run outside
    the shared file; the flat ring said 50. NCCL picks NVLS-tree here."""
    fab = Fabric.preset("aws-p5", nodes=2)
    assert fab.busbw_GBps(16 * 2**30) == pytest.approx(487, rel=0.15)
    assert fab.choice(16 * 2**30)[0] == "nvlstree"


# --- definitions and algorithm choice -------------------------------------------------------


def test_busbw_is_nccl_tests_definition():
    """Against nccl-tests' own printed columns (aws-p4de log: 16 ranks, 2 GiB, 51406 µs)."""
    assert busbw_from_time(2147483648, 51406e-6, 16) == pytest.approx(78.33, abs=0.01)
    algbw = 2147483648 / 51406e-6 / 1e9
    assert algbw == pytest.approx(41.78, abs=0.01)  # its algbw column
    fab = Fabric.preset("dgx-h100", nodes=4)
    s = 2**28
    t = fab.allreduce_s(s)
    assert fab.busbw_GBps(s) == pytest.approx(s / t / 1e9 * 2 * 31 / 32, rel=1e-12)


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("nodes", [1, 2, 16, 128])
def test_auto_is_the_fastest_available(name, nodes):
    fab = Fabric.preset(name, nodes=nodes)
    for s in (8, 2**12, 2**16, 2**20, 2**24, 2**28, 2**32):
        times = {a: fab.allreduce_s(s, algorithm=a) for a in fab.algorithms()}
        assert fab.allreduce_s(s) == min(times.values())
        assert fab.choice(s)[0] == min(times, key=times.__getitem__)


def test_tree_beats_ring_at_many_nodes_for_small_messages():
    fab = Fabric.preset("dgx-h100", nodes=128)
    ring, tree = (fab.allreduce_s(2**15, algorithm=a) for a in ("ring", "tree"))
    assert tree * 10 < ring  # log2(128) network hops against 2·127
    one = Fabric.preset("dgx-h100")
    assert one.allreduce_s(2**34, algorithm="ring") < one.allreduce_s(2**34, algorithm="tree")
    assert one.choice(2**34)[0] == "nvls"


def test_algorithms_need_their_hardware():
    assert Fabric.from_hardware("a100").algorithms() == ("ring", "tree")  # no NVLink SHARP
    assert Fabric.from_hardware("h100").algorithms() == ("ring", "tree", "nvls")
    assert Fabric.from_hardware("h100", nodes=2).algorithms() == ("ring", "tree", "nvlstree")
    assert "nvls" not in Fabric.from_hardware("h100", intra="pcie").algorithms()
    with pytest.raises(ValueError, match=r"'nvls'.*available: ring, tree"):
        Fabric.from_hardware("a100").allreduce_s(2**20, algorithm="nvls")


def test_more_nic_bandwidth_never_slows_a_multi_node_all_reduce():
    slow = Fabric.from_hardware("h100", nodes=8, nic_gbps=100)
    fast = Fabric.from_hardware("h100", nodes=8, nic_gbps=400)
    for s in (2**10, 2**20, 2**30):
        assert fast.allreduce_s(s) <= slow.allreduce_s(s)
    assert fast.allreduce_s(2**30) < 0.5 * slow.allreduce_s(2**30)


def test_fabric_stands_where_a_link_does():
    fab = Fabric.preset("aws-p5", nodes=16)
    assert fab.world_size == 128
    assert fab.allreduce_s(2**20, 128) == fab.allreduce_s(2**20)
    assert fab.allreduce_s(0, 128) == 0.0
    with pytest.raises(ValueError, match="world_size 64 does not match"):
        fab.allreduce_s(2**20, 64)
    assert fab.with_nodes(8).allreduce_s(2**20, 64) > 0
    assert fab.to_dict()["world_size"] == 128 and "aws-p5" in fab.describe()


# --- two measured levels (loopback inside a node, a shaped link between nodes) --------------


def test_two_levels_reduce_to_the_ring_on_one_node():
    fab = Fabric.from_levels(gpus_per_node=4, nodes=1, intra_alpha_s=50e-6,
                             intra_beta_s_per_byte=1e-9)  # fmt: skip
    s = 3 * 2**20
    assert fab.allreduce_s(s, algorithm="ring") == pytest.approx(ring_time(s, 4, 50e-6, 1e-9))


def test_two_levels_hierarchy():
    kw = dict(intra_alpha_s=20e-6, intra_beta_s_per_byte=0.2e-9, inter_alpha_s=500e-6)
    slow = Fabric.from_levels(gpus_per_node=2, nodes=8, inter_beta_s_per_byte=8e-9, **kw)
    # ring: 2·15 steps, 2·7 of them over the link, the link's bandwidth bounds every byte
    s = 2**24
    expect = (30 - 14) * 20e-6 + 14 * 500e-6 + 2 * 15 / 16 * s * 8e-9
    assert slow.allreduce_s(s, algorithm="ring") == pytest.approx(expect)
    # tree: 2·(1·α_intra + 3·α_inter) latency wins for small messages, ring for large
    assert slow.choice(8)[0] == "tree" and slow.choice(2**28)[0] == "ring"
    with pytest.raises(ValueError, match="'nvls'"):
        slow.allreduce_s(8, algorithm="nvls")
    shaped = Fabric.from_levels(gpus_per_node=2, nodes=8, link_mbit=1000, **kw)  # 125 MB/s
    assert shaped.levels.inter_beta_s_per_byte == pytest.approx(8e-9)


def test_a_straggler_delays_every_gradient():
    from dplab.sim import BackwardProfile, ParamTiming

    prof = BackwardProfile(
        "toy",
        (ParamTiming("a", 10, 40, "float32", 30.0), ParamTiming("b", 10, 40, "float32", 60.0)),
        forward_ms=5.0,
        backward_ms=60.0,
        optimizer_ms=1.0,
    )
    slow = with_straggler(prof, 0.25)
    assert [p.ready_ms for p in slow.params] == [37.5, 75.0] and slow.backward_ms == 75.0
    assert (slow.forward_ms, slow.optimizer_ms) == (5.0, 1.0)
    assert with_straggler(prof, 0) is prof
    with pytest.raises(ValueError, match=r"slower_by must be >= 0, got -0\.5"):
        with_straggler(prof, -0.5)


# --- calibration from the user's own measurements ------------------------------------------


def _truth(bw: float, lat: float) -> Fabric:
    base = Fabric.from_hardware("h100", nodes=2, network="ib")
    c = base.calibration
    return base.with_calibration(
        c.with_(bw_efficiency=c.bw_efficiency * bw, nvls_efficiency=c.nvls_efficiency * bw,
                latency_scale=lat)
    )  # fmt: skip


@pytest.mark.parametrize(("bw", "lat"), [(0.6, 2.5), (1.1, 0.5)])
def test_fit_recovers_known_parameters_from_nccl_tests_text(bw, lat):
    truth = _truth(bw, lat)
    sizes = [2**k for k in range(3, 34, 2)]
    text = format_nccl_tests([(s, truth.allreduce_s(s) * 1e6) for s in sizes], 16, prefix="0: ")
    fit = Fabric.fit(text, gpu="h100", nodes=2, network="ib")
    base = DEFAULT_CALIBRATION
    assert fit.calibration.bw_efficiency / base.bw_efficiency == pytest.approx(bw, rel=0.02)
    assert fit.calibration.latency_scale == pytest.approx(lat, rel=0.03)
    for s in (2**10, 2**22, 2**32):
        assert fit.allreduce_s(s) == pytest.approx(truth.allreduce_s(s), rel=0.02)


def test_fit_from_dplab_bandwidth_rows():
    truth = _truth(0.7, 3.0)
    rows = [
        {"algorithm": "all_reduce", "world_size": 16, "size_bytes": s,
         "time_s": truth.allreduce_s(s), "algbw_GBps": 0.0, "busbw_GBps": 0.0}
        for s in (2**k for k in range(4, 32, 3))
    ] + [{"algorithm": "ring", "world_size": 16, "size_bytes": 8, "time_s": 1.0}]  # fmt: skip
    fit = Fabric.fit({"rows": rows}, gpu="h100", nodes=2)
    assert fit.calibration.latency_scale == pytest.approx(3.0, rel=0.03)
    with pytest.raises(ValueError, match="from 16 ranks but the fabric has 8"):
        Fabric.fit(rows, gpu="h100", nodes=1)


# --- reading nccl-tests output --------------------------------------------------------------


def test_parser_reads_the_published_logs_verbatim():
    runs = {r["id"]: r for r in json.loads(DATA.read_text())}
    for rid in ("aws-p4de-2node-efa1", "aws-p3dn-2node-efa", "stas00-a100-1node",
                "nccl-812-dgxa100-2node-ring"):  # fmt: skip
        run = parse_nccl_tests(runs[rid]["quote"])
        want = {r["bytes"]: r for r in runs[rid]["rows"] if r["bytes"]}
        assert run.rows, rid
        for row in run.rows:
            assert row.time_us == pytest.approx(want[row.bytes]["time_us"]), (rid, row)
            assert row.busbw_GBps == pytest.approx(want[row.bytes]["busbw_GBps"]), (rid, row)
    assert parse_nccl_tests(runs["nccl-812-dgxa100-2node-ring"]["quote"]).nccl_version == "2.16.5"


def test_parser_formats_and_errors():
    text = format_nccl_tests([(8, 20.5), (1024, 21.0)], 8, prefix="[1,0]<stdout>:")
    run = parse_nccl_tests(text)
    assert run.ranks == 8 and [r.bytes for r in run.rows] == [8, 1024]
    assert run.rows[1].in_place_time_us == pytest.approx(21.0) and run.rows[1].dtype == "float"
    # 2019 format: no root column, error magnitudes for #wrong, integer times
    old = parse_nccl_tests("8 2 float sum 164 0.00 0.00 2e-07 165 0.00 0.00 1e-07\n").rows[0]
    assert (old.time_us, old.busbw_GBps, old.in_place_time_us) == (164.0, 0.0, 165.0)
    with pytest.raises(ValueError, match="no nccl-tests data lines"):
        parse_nccl_tests("# nothing here\n")
    with pytest.raises(ValueError, match=r"line 1: .*'8 2 floot sum"):
        parse_nccl_tests("8 2 floot sum -1 12.0 0.0 0.0 0\n8 2 float sum\n")


# --- bad input names the bad value ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gpu": "x100"}, "gpu must be one of .*'x100'"),
        ({"network": "myrinet"}, "network must be one of .*'myrinet'"),
        ({"nodes": 0}, "nodes must be a positive int, got 0"),
        ({"gpus_per_node": 2.5}, "gpus_per_node must be a positive int, got 2.5"),
        ({"nic_gbps": -100}, "nic_gbps must be > 0, got -100"),
        ({"intra": "ethernet"}, "intra must be one of .*'ethernet'"),
    ],
)
def test_bad_hardware_names_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fabric.from_hardware(**kwargs)


def test_bad_calls_name_the_value():
    fab = Fabric.preset("dgx-a100", nodes=2)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        fab.allreduce_s(-1)
    with pytest.raises(ValueError, match=r"algorithm must be one of .*'butterfly'"):
        fab.busbw_GBps(2**20, "butterfly")
    with pytest.raises(ValueError, match="unknown fabric preset 'dgx-z9'"):
        Fabric.preset("dgx-z9")
    with pytest.raises(ValueError, match=r"bw_efficiency must be .*got 0"):
        Calibration(bw_efficiency=0)
    with pytest.raises(ValueError, match=r"a measured time must be > 0 s, got -1\.0"):
        Fabric.fit([{"size_bytes": 8, "time_s": -1.0}, {"size_bytes": 16, "time_s": 1.0}])
    assert math.isfinite(fab.allreduce_s(2**40))


# --- the simulator on a fabric ----------------------------------------------------------------


def _profile():
    from dplab.sim import BackwardProfile, ParamTiming

    sizes = [4 * 2**20] * 24 + [2**16] * 40  # 24 big matrices, 40 small vectors
    k = len(sizes)
    params = tuple(
        ParamTiming(f"p{i}", s // 4, s, "float32", 50.0 * (k - i) / k) for i, s in enumerate(sizes)
    )
    return BackwardProfile("synthetic", params, forward_ms=20.0, backward_ms=50.0, optimizer_ms=2)


def test_simulate_times_each_bucket_with_the_fabric():
    from dplab.sim import simulate

    fab = Fabric.preset("dgx-h100", nodes=128)
    trace = simulate(_profile(), bucket_cap_mb=10, fabric=fab)
    assert trace.world_size == 1024 and trace.meta["fabric"] is True
    spans = [s for s in trace.spans if s.kind == "allreduce"]
    assert len(spans) == len(trace.buckets) > 1
    for s, b in zip(sorted(spans, key=lambda s: s.bucket), trace.buckets, strict=True):
        assert s.end_ms - s.start_ms == pytest.approx(fab.allreduce_s(b.nbytes) * 1e3)


def test_best_bucket_cap_on_a_fabric_is_the_sweeps_best():
    from dplab.sim import best_bucket_cap, candidate_caps, sweep

    prof, fab = _profile(), Fabric.preset("aws-p4d", nodes=64)
    best = best_bucket_cap(prof, fabric=fab)
    steps = {
        c: t.metrics.t_step_ms
        for c, t in zip(
            candidate_caps(prof), sweep(prof, candidate_caps(prof), fabric=fab), strict=True
        )
    }
    assert steps[best] == min(steps.values())


def test_simulate_takes_one_network():
    from dplab.sim import get_link, simulate

    fab = Fabric.preset("dgx-a100", nodes=2)
    with pytest.raises(ValueError, match="world_size 8 does not match"):
        simulate(_profile(), fabric=fab, world_size=8)
    with pytest.raises(ValueError, match="exactly one of link"):
        simulate(_profile(), fabric=fab, link=get_link("ib-400g"))
    with pytest.raises(ValueError, match="world_size is required with a link"):
        simulate(_profile(), link=get_link("ib-400g"))


def test_cli_simulate_on_a_preset(capsys):
    from dplab.cli import main

    assert main(["simulate", "--preset", "aws-p5", "--nodes", "16", "--model", "gpt-7m"]) == 0
    out = capsys.readouterr().out
    assert "128 ranks" in out and "aws-p5 × 16" in out and "NCCL algorithm/protocol" in out
    argv = ["simulate", "--gpu", "a100", "--nodes", "4", "--nic-gbps", "200", "--model", "gpt-7m"]
    assert main(argv) == 0
    assert "32 ranks" in capsys.readouterr().out
    assert main(["simulate", "--preset", "aws-p5", "--world-size", "8", "--model", "gpt-7m"]) == 2
    assert "carries its own ranks" in capsys.readouterr().err
    assert main(["simulate", "--gpu", "h100", "--nic-gbps", "-1", "--model", "gpt-7m"]) == 2
    assert "nic_gbps must be > 0, got -1.0" in capsys.readouterr().err


def test_overlap_contention_slows_backward_not_the_all_reduce():
    from dplab.sim import simulate
    from dplab.sim.fabric import NCCL_OVERLAP_SLOWDOWN, overlap_contention

    fab = Fabric.preset("aws-p4d", nodes=32)  # slow enough that comm overlaps backward
    quiet = simulate(_profile(), bucket_cap_mb=10, fabric=fab)
    busy = simulate(_profile(), bucket_cap_mb=10, fabric=fab, contention=overlap_contention())
    q, b = ({s.name: s.end_ms - s.start_ms for s in t.spans} for t in (quiet, busy))
    assert q["backward"] < b["backward"] <= q["backward"] * (1 + NCCL_OVERLAP_SLOWDOWN)
    reduces = [name for name in q if name.startswith("all-reduce")]
    assert reduces and all(b[name] == pytest.approx(q[name]) for name in reduces)


def test_a_straggler_lengthens_the_simulated_step():
    from dplab.sim import simulate, with_straggler

    fab = Fabric.preset("dgx-h100", nodes=16)
    base = simulate(_profile(), bucket_cap_mb=10, fabric=fab).metrics.t_step_ms
    slow = simulate(with_straggler(_profile(), 0.2), bucket_cap_mb=10, fabric=fab)
    assert base < slow.metrics.t_step_ms <= base + 0.2 * 50.0 + 1e-9  # backward is 50 ms
