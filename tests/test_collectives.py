"""The all-reduce from send/recv: equal to dist.all_reduce, its schedule, its cost model, the fit,
the bench, the CLI, the figures and the widget."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import dplab
from dplab.collectives import (
    ALL_GATHER,
    REDUCE_SCATTER,
    algbw,
    bandwidth_bench,
    bandwidth_report,
    bus_factor,
    busbw,
    chunk_bounds,
    fit_alpha_beta,
    fit_rows,
    naive_all_reduce,
    naive_bytes_per_rank,
    naive_schedule,
    naive_time,
    ring_all_reduce,
    ring_bytes_per_rank,
    ring_partial_sums,
    ring_schedule,
    ring_steps,
    ring_time,
)

WORLD_SIZES = [2, 3, 4]


def sizes_for(n: int) -> list[int]:
    """Sizes that stress the chunking: fewer elements than ranks, N±1, and a large odd one."""
    return sorted({1, n - 1, n + 1, 1001})


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N={n}")
def ranks(request):
    with dplab.Cluster(request.param, backend="gloo") as c:
        yield c


# ---------------------------------------------------------------------------------------------
# Rank functions (run on every rank, return tensors and records to the test)


def _float_results(sizes: list[int]) -> list[dict]:
    r = dist.get_rank()
    out = []
    shapes = [(s,) for s in sizes] + [(7, 13)]
    for shape in shapes:
        g = torch.Generator().manual_seed(1234 + 17 * r + len(shape))
        x = torch.randn(shape, generator=g)
        ref, ring, naive, naive1 = x.clone(), x.clone(), x.clone(), x.clone()
        dist.all_reduce(ref)
        returned = ring_all_reduce(ring)
        naive_all_reduce(naive)
        naive_all_reduce(naive1, root=1)
        out.append(
            {
                "ref": ref,
                "ring": ring,
                "naive": naive,
                "naive_root1": naive1,
                "in_place": returned is ring,
            }
        )
    return out


def _int_results(sizes: list[int]) -> list[dict]:
    r = dist.get_rank()
    out = []
    for dtype in (torch.int64, torch.int32):
        for s in sizes:
            g = torch.Generator().manual_seed(99 + r)
            x = torch.randint(-(2**20), 2**20, (s,), generator=g).to(dtype)
            ref, ring, naive = x.clone(), x.clone(), x.clone()
            dist.all_reduce(ref)
            ring_all_reduce(ring)
            naive_all_reduce(naive)
            out.append({"ref": ref, "ring": ring, "naive": naive})
    return out


def _ops_results() -> dict:
    r = dist.get_rank()
    g = torch.Generator().manual_seed(7 + r)
    x = torch.randn(101, generator=g)
    s, mx, mn = x.clone(), x.clone(), x.clone()
    dist.all_reduce(s)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    dist.all_reduce(mn, op=dist.ReduceOp.MIN)
    out = {"sum": s, "max": mx, "min": mn}
    for op in ("avg", "max", "min"):
        out[f"ring_{op}"] = ring_all_reduce(x.clone(), op=op)
        out[f"naive_{op}"] = naive_all_reduce(x.clone(), op=op)
    return out


def _records(sizes: list[int]) -> list[dict]:
    out = []
    for dtype in (torch.float32, torch.float64):
        for s in sizes:
            ring_rec: list = []
            naive_rec: list = []
            ring_all_reduce(torch.ones(s, dtype=dtype), record=ring_rec)
            naive_all_reduce(torch.ones(s, dtype=dtype), record=naive_rec)
            out.append({"numel": s, "dtype": dtype, "ring": ring_rec, "naive": naive_rec})
    return out


def _contents_after_each_step(numel: int) -> list[torch.Tensor]:
    """Rank r contributes 2**r, so an int64 partial sum is the set of ranks it holds, in bits."""
    r, n = dist.get_rank(), dist.get_world_size()
    return [
        ring_all_reduce(torch.full((numel,), 1 << r, dtype=torch.int64), steps=k)
        for k in range(ring_steps(n) + 1)
    ]


def _non_contiguous() -> dict:
    r = dist.get_rank()
    base = torch.arange(35, dtype=torch.float64).reshape(5, 7) * (r + 1)
    view = base.t()  # strided
    ref = view.contiguous()
    dist.all_reduce(ref)
    out = ring_all_reduce(view)
    return {"same_object": out is view, "view": view.clone(), "ref": ref, "base": base}


def _in_a_subgroup() -> dict | None:
    """Ranks 0 and N-1 reduce among themselves; every rank must create the group."""
    r, n = dist.get_rank(), dist.get_world_size()
    members = [0, n - 1]
    group = dist.new_group(members)
    if r not in members:
        return None
    x = torch.full((5,), float(r + 1))
    ref = x.clone()
    dist.all_reduce(ref, group=group)
    record: list = []
    ring_all_reduce(x, group=group, record=record)
    naive = naive_all_reduce(torch.full((5,), float(r + 1)), group=group)
    return {"ring": x, "naive": naive, "ref": ref, "record": record}


def _bad_calls() -> list[str]:
    msgs = []
    calls = [
        lambda: ring_all_reduce(torch.ones(3), steps=ring_steps(dist.get_world_size()) + 1),
        lambda: ring_all_reduce(torch.ones(3), steps=-1),
        lambda: ring_all_reduce(torch.ones(3), op="product"),
        lambda: ring_all_reduce(torch.ones(3, dtype=torch.int64), op="avg"),
        lambda: ring_all_reduce([1.0, 2.0]),
        lambda: naive_all_reduce(torch.ones(3), root=dist.get_world_size()),
    ]
    for call in calls:
        try:
            call()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    dist.barrier()
    return msgs


# ---------------------------------------------------------------------------------------------
# Equal to dist.all_reduce


def test_ring_and_naive_equal_all_reduce_for_floats(ranks):
    n = ranks.world_size
    per_rank = ranks.run(_float_results, sizes_for(n))
    for case in range(len(per_rank[0])):
        ref = per_rank[0][case]["ref"]
        for r in range(n):
            got = per_rank[r][case]
            assert got["in_place"]
            # Floats: same sum, possibly a different order of additions (see the module doc).
            torch.testing.assert_close(got["ring"], ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["naive"], ref, rtol=1e-5, atol=1e-5)
            # Every rank ends with the very same bits, whatever the algorithm.
            assert torch.equal(got["ring"], per_rank[0][case]["ring"])
            assert torch.equal(got["naive"], per_rank[0][case]["naive"])
            # The naive root reduces in rank order, so moving the root does not move the bits.
            assert torch.equal(got["naive_root1"], got["naive"])
            if n == 2:  # one addition, and a + b == b + a exactly
                assert torch.equal(got["ring"], ref)


def test_ring_and_naive_equal_all_reduce_exactly_for_integers(ranks):
    n = ranks.world_size
    per_rank = ranks.run(_int_results, sizes_for(n))
    for r in range(n):
        for got in per_rank[r]:
            assert got["ring"].dtype == got["ref"].dtype
            assert torch.equal(got["ring"], got["ref"])
            assert torch.equal(got["naive"], got["ref"])


def test_average_max_and_min(ranks):
    n = ranks.world_size
    for got in ranks.run(_ops_results):
        for algo in ("ring", "naive"):
            torch.testing.assert_close(got[f"{algo}_avg"], got["sum"] / n, rtol=1e-5, atol=1e-6)
            assert torch.equal(got[f"{algo}_max"], got["max"])
            assert torch.equal(got[f"{algo}_min"], got["min"])


def test_non_contiguous_tensor_is_reduced_in_place(ranks):
    for got in ranks.run(_non_contiguous):
        assert got["same_object"]
        torch.testing.assert_close(got["view"], got["ref"], rtol=0, atol=0)
        assert torch.equal(got["base"].t(), got["ref"])  # the storage itself was updated


def test_a_subgroup_reduces_among_its_members_only(ranks):
    n = ranks.world_size
    out = ranks.run(_in_a_subgroup)
    assert all(o is None for o in out[1 : n - 1])
    for o in (out[0], out[n - 1]):
        assert o["ring"].tolist() == o["ref"].tolist() == [1.0 + n] * 5
        assert o["naive"].tolist() == [1.0 + n] * 5
    # Records name ranks within the group (0 and 1), not global ranks.
    assert {(t.src, t.dst) for t in out[0]["record"] + out[n - 1]["record"]} == {(0, 1), (1, 0)}


def test_bad_arguments_on_ranks_are_clear_errors(ranks):
    n = ranks.world_size
    for msgs in ranks.run(_bad_calls):
        assert f"steps must be an int in 0..{2 * (n - 1)}" in msgs[0]
        assert f"got {2 * (n - 1) + 1}" in msgs[0]
        assert "got -1" in msgs[1]
        assert "op must be one of" in msgs[2] and "'product'" in msgs[2]
        assert "op='avg' needs a floating-point tensor" in msgs[3]
        assert "tensor must be a torch.Tensor, got list" in msgs[4]
        assert f"root must be a rank in 0..{n - 1}, got {n}" in msgs[5]


def test_outside_a_process_group_says_how_to_get_one():
    with pytest.raises(RuntimeError, match=r"dplab\.launch"):
        ring_all_reduce(torch.ones(3))


# ---------------------------------------------------------------------------------------------
# The recorded schedule is the pure one


def test_recorded_schedule_from_real_ranks_equals_the_pure_schedule(ranks):
    n = ranks.world_size
    per_rank = ranks.run(_records, sizes_for(n))
    for case in range(len(per_rank[0])):
        numel = per_rank[0][case]["numel"]
        element_size = torch.empty(0, dtype=per_rank[0][case]["dtype"]).element_size()
        for algo, pure in (
            ("ring", ring_schedule(n, numel, element_size)),
            ("naive", naive_schedule(n, numel, element_size)),
        ):
            recorded = [t for r in range(n) for t in per_rank[r][case][algo]]
            for r in range(n):
                assert all(t.src == r for t in per_rank[r][case][algo])
            key = lambda t: (t.step, t.src, t.dst)  # noqa: E731
            assert sorted(recorded, key=key) == sorted(pure, key=key)


def test_partial_sums_on_real_ranks_match_the_pure_states(ranks):
    n = ranks.world_size
    numel = 3 * n + 1  # uneven chunks
    per_rank = ranks.run(_contents_after_each_step, numel)
    states = ring_partial_sums(n)
    bounds = chunk_bounds(numel, n)
    for k in range(ring_steps(n) + 1):
        for r in range(n):
            got = per_rank[r][k]
            for c, (start, stop) in enumerate(bounds):
                expected = sum(1 << m for m in states[k][r][c])
                assert got[start:stop].tolist() == [expected] * (stop - start), (k, r, c)


@pytest.mark.slow
def test_world_size_eight_matches_all_reduce_and_its_schedule():
    def check() -> dict:
        r = dist.get_rank()
        x = torch.randint(-1000, 1000, (1001,), generator=torch.Generator().manual_seed(r))
        ref, ring = x.clone(), x.clone()
        dist.all_reduce(ref)
        record: list = []
        ring_all_reduce(ring, record=record)
        return {"equal": torch.equal(ref, ring), "record": record}

    out = dplab.launch(check, 8, backend="gloo")
    assert all(o["equal"] for o in out)
    recorded = sorted((t for o in out for t in o["record"]), key=lambda t: (t.step, t.src))
    assert recorded == ring_schedule(8, 1001, 8)


# ---------------------------------------------------------------------------------------------
# The pure schedule


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("numel", [0, 1, 7, 1001])
def test_chunks_cover_the_tensor_and_differ_by_at_most_one(n, numel):
    bounds = chunk_bounds(numel, n)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_schedule_shape_and_bytes(n):
    numel = 4 * n * 10  # divisible: every message is exactly S/N
    schedule = ring_schedule(n, numel, 4)
    assert len(schedule) == ring_steps(n) * n == 2 * (n - 1) * n
    assert {t.phase for t in schedule if t.step < n} == {REDUCE_SCATTER}
    assert {t.phase for t in schedule if t.step >= n} == {ALL_GATHER}
    for r in range(n):
        sent = [t for t in schedule if t.src == r]
        received = [t for t in schedule if t.dst == r]
        assert all(t.dst == (r + 1) % n for t in sent)
        assert len(sent) == len(received) == 2 * (n - 1)
        assert sum(t.nbytes for t in sent) == ring_bytes_per_rank(numel * 4, n)
    for step in range(1, ring_steps(n) + 1):  # each step moves every chunk exactly once
        assert sorted(t.chunk for t in schedule if t.step == step) == list(range(n))


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_partial_sums_reduce_scatter_then_all_gather(n):
    states = ring_partial_sums(n)
    everyone = frozenset(range(n))
    assert len(states) == ring_steps(n) + 1
    assert all(states[0][r][c] == {r} for r in range(n) for c in range(n))
    after_rs = states[n - 1]
    for r in range(n):  # after reduce-scatter, rank r owns the finished chunk r+1
        assert [c for c in range(n) if after_rs[r][c] == everyone] == [(r + 1) % n]
    assert all(states[-1][r][c] == everyone for r in range(n) for c in range(n))


def test_naive_schedule_loads_the_root():
    sched = naive_schedule(4, 10, 4)
    into_root = sum(t.nbytes for t in sched if t.dst == 0)
    out_of_root = sum(t.nbytes for t in sched if t.src == 0)
    assert into_root == out_of_root == 3 * 40
    assert naive_bytes_per_rank(40, 4) == [120, 40, 40, 40]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: chunk_bounds(10, 0), "world_size must be an int >= 1, got 0"),
        (lambda: chunk_bounds(-1, 2), "numel must be an int >= 0, got -1"),
        (lambda: ring_schedule(2.0, 4), "world_size must be an int >= 1, got 2.0"),
        (lambda: ring_schedule(True, 4), "world_size must be an int >= 1, got True"),
        (lambda: naive_schedule(3, 4, root=3), "root must be a rank in 0..2, got 3"),
        (lambda: ring_partial_sums(-2), "got -2"),
        (lambda: ring_time(-5, 2, 1e-6, 1e-9), "size_bytes must be >= 0, got -5"),
        (lambda: ring_time(5, 0, 1e-6, 1e-9), "world_size must be an int >= 1, got 0"),
        (lambda: ring_time(5, 2, -1e-6, 1e-9), "alpha must be >= 0"),
        (lambda: naive_time(5, 2, 1e-6, math.nan), "beta must be a finite number"),
        (lambda: algbw(100, 0), "time_s must be > 0, got 0"),
        (lambda: busbw(100, 1.0, 0), "world_size must be an int >= 1, got 0"),
        (lambda: ring_bytes_per_rank(-1, 4), "size_bytes must be >= 0, got -1"),
    ],
)
def test_bad_inputs_are_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# Cost model, bandwidths and the fit


def test_alpha_beta_times():
    alpha, beta, s = 10e-6, 1 / 5e9, 100e6
    assert ring_time(s, 4, alpha, beta) == pytest.approx(6 * alpha + 1.5 * s * beta)
    assert naive_time(s, 4, alpha, beta) == pytest.approx(6 * alpha + 6 * s * beta)
    assert ring_time(s, 1, alpha, beta) == naive_time(s, 1, alpha, beta) == 0
    # The ring's bandwidth term tends to 2·S·β as N grows; the naive one grows without bound.
    assert ring_time(s, 1024, 0, beta) < 2 * s * beta < naive_time(s, 2, 0, beta) * 1.01


def test_algbw_and_busbw_as_nccl_tests_defines_them():
    assert algbw(1e9, 0.5) == 2e9
    assert busbw(1e9, 0.5, 4) == pytest.approx(2e9 * 2 * 3 / 4)
    assert busbw(1e9, 0.5, 1) == 0
    assert bus_factor(8) == pytest.approx(1.75)
    # For large S, busbw of a model ring tends to the link bandwidth 1/β.
    beta = 1 / 3e9
    t = ring_time(2**34, 8, 20e-6, beta)
    assert busbw(2**34, t, 8) == pytest.approx(1 / beta, rel=1e-3)


SIZES = [2**k for k in range(10, 29, 2)]  # 1 KiB .. 256 MiB


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_planted_alpha_and_beta(n):
    alpha, beta = 35e-6, 1 / 2.5e9
    times = [ring_time(s, n, alpha, beta) for s in SIZES]
    fit = fit_alpha_beta(SIZES, times, n)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-9)
    assert fit.bandwidth_GBps == pytest.approx(2.5, rel=1e-9)
    assert fit.max_rel_error < 1e-9
    assert fit.predict(SIZES[3]) == pytest.approx(times[3])


def test_fit_recovers_planted_values_through_noise():
    alpha, beta, n = 35e-6, 1 / 2.5e9, 2
    rng = np.random.default_rng(0)
    times = [ring_time(s, n, alpha, beta) * (1 + rng.normal(0, 0.02)) for s in SIZES * 3]
    fit = fit_alpha_beta(SIZES * 3, times, n)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.05)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.05)
    assert 0.005 < fit.median_rel_error < 0.05
    assert fit.max_rel_error >= fit.median_rel_error


def test_fit_of_the_naive_model_and_nonnegative_coefficients():
    times = [naive_time(s, 4, 5e-6, 1e-9) for s in SIZES]
    fit = fit_alpha_beta(SIZES, times, 4, model="naive")
    assert fit.alpha_s == pytest.approx(5e-6) and fit.beta_s_per_byte == pytest.approx(1e-9)
    # Times that fall with size would need a negative β: the fit clamps it to zero instead.
    fit = fit_alpha_beta([1000, 2000, 4000], [3e-5, 2e-5, 1e-5], 2)
    assert fit.alpha_s >= 0 and fit.beta_s_per_byte >= 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1, 2], [1e-3], 2), "equally long"),
        (([1024, 1024], [1e-3, 2e-3], 2), "two distinct sizes"),
        (([1, 2], [1e-3, 2e-3], 1), "world_size must be an int >= 2, got 1"),
        (([1, 2], [1e-3, -2e-3], 2), "times must be finite and > 0"),
        (([-1, 2], [1e-3, 2e-3], 2), "sizes must be finite and >= 0"),
    ],
)
def test_fit_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        fit_alpha_beta(*args)
    with pytest.raises(ValueError, match="model must be one of"):
        fit_alpha_beta([1, 2], [1e-3, 2e-3], 2, model="tree")


# ---------------------------------------------------------------------------------------------
# The bench, its report and the CLI (structure only: timings belong to benchmarks/)


def test_bench_rows_report_and_fit(ranks):
    n = ranks.world_size
    sizes = [1024, 8192]
    per_rank = ranks.run(
        bandwidth_bench, sizes, algorithms=("all_reduce", "ring", "naive"), repeats=2, warmup=1
    )
    rows = per_rank[0]
    assert all(len(r) == len(rows) for r in per_rank)
    # The slowest rank's time is all-reduced, so every rank reports the same time.
    assert [r.time_s for r in per_rank[1]] == [r.time_s for r in rows]
    assert {(r.algorithm, r.size_bytes) for r in rows} == {
        (a, s) for a in ("all_reduce", "ring", "naive") for s in sizes
    }
    for r in rows:
        assert r.world_size == n and r.time_s > 0 and len(r.repeats_s) == 2
        assert r.time_s == pytest.approx(float(np.median(r.repeats_s)))
        assert r.algbw_GBps == pytest.approx(r.size_bytes / r.time_s / 1e9)
        assert r.busbw_GBps == pytest.approx(r.algbw_GBps * 2 * (n - 1) / n)
    fits = fit_rows(rows)
    assert set(fits) == {(a, n) for a in ("all_reduce", "ring", "naive")}
    assert fits[("naive", n)].model == "naive"
    report = json.loads(json.dumps(bandwidth_report(rows, command="test")))
    assert report["link"]["world_size"] == n
    link = report["link"]  # two tiny sizes may well fit β = 0: no bandwidth then
    if link["beta_s_per_byte"] > 0:
        assert link["bandwidth_GBps"] == pytest.approx(1e-9 / link["beta_s_per_byte"])
    else:
        assert link["bandwidth_GBps"] is None
    assert report["machine"]["cpu_cores"] >= 1 and report["machine"]["torch"] == torch.__version__


def test_bench_refuses_bad_sizes(ranks):
    def bad() -> str:
        try:
            bandwidth_bench([1000, 1002])
        except ValueError as e:
            return str(e)
        return "no error"

    assert all("multiples of 4 bytes" in m and "1002" in m for m in ranks.run(bad))


def test_cli_measures_fits_and_saves(tmp_path, capsys):
    from dplab.cli import main

    out, page = tmp_path / "bw.json", tmp_path / "bw.html"
    argv = ["bandwidth", "--world-size", "2", "--max-size-mb", str(16 / 1024)]
    argv += ["--repeats", "1", "--out", str(out), "--html", str(page)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| N | algorithm | size |" in printed and "alpha =" in printed
    report = json.loads(out.read_text())
    assert [r["size_bytes"] for r in report["rows"]] == [1024, 4096, 16384]
    assert report["link"]["alpha_s"] >= 0 and report["command"].startswith("python -m dplab")
    assert "plotly" in page.read_text()[:200_000].lower()


def test_cli_refuses_bad_sizes_and_world_size(capsys):
    from dplab.cli import main

    assert main(["bandwidth", "--world-size", "1"]) == 2
    assert "world_size must be an int >= 2, got 1" in capsys.readouterr().err
    assert main(["bandwidth", "--max-size-mb", "-3"]) == 2
    assert "--max-size-mb -3" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Figures and the widget


def test_ring_figure_draws_the_pure_state_and_this_steps_messages():
    from dplab.viz.collectives import ring_step_figure

    n, step = 4, 2
    fig = ring_step_figure(n, step, numel=10)
    state = ring_partial_sums(n)[step]
    assert [list(row) for row in fig.data[0].z] == [
        [len(state[r][c]) for c in range(n)] for r in range(n)
    ]
    assert len(fig.layout.shapes) == n  # one outlined receiver per message
    assert "step 2 of 6" in fig.layout.title.text
    assert "reduce-scatter" in fig.layout.title.text
    assert ring_step_figure(n, 0).layout.shapes == ()
    with pytest.raises(ValueError, match=r"step must be an int in 0\.\.6 for world size 4, got 7"):
        ring_step_figure(4, 7)
    with pytest.raises(ValueError, match=r"world_size must be in 2\.\.16"):
        ring_step_figure(1, 0)


def test_bandwidth_figure():
    from dplab.collectives import BandwidthRow
    from dplab.viz.collectives import bandwidth_figure

    alpha, beta = 30e-6, 1 / 2e9
    rows = []
    for s in SIZES:
        t = ring_time(s, 2, alpha, beta)
        rows.append(BandwidthRow("all_reduce", 2, s, t, algbw(s, t) / 1e9, busbw(s, t, 2) / 1e9, 1))
    fig = bandwidth_figure([r.to_dict() for r in rows], fit_rows(rows))
    names = [t.name for t in fig.data if t.name]
    assert any("α-β fit" in name and "2.00 GB/s" in name for name in names)
    with pytest.raises(ValueError, match="no rows"):
        bandwidth_figure([])


def test_ring_stepper_steps_and_refuses_bad_values_with_a_message():
    from dplab.widgets.ring import RingStepper

    w = RingStepper(world_size=4, numel=10)
    assert w.step_slider.max == 6 and w.prev_button.disabled
    w.go(+1)
    assert w.step == 1 and "step 1 of 6" in w.figure.layout.title.text
    w.world_size_box.value = 9
    assert "world size must be a whole number in 2..8, got 9" in w.message
    assert "got 9" in w.message_html.value
    assert w.world_size_box.value == 4 and "N=4" in w.figure.layout.title.text
    w.numel_box.value = -5
    assert "tensor length" in w.message and "got -5" in w.message
    w.step_slider.value = 6
    w.world_size_box.value = 2  # fewer steps: the step is clamped, the message cleared
    assert w.step == 2 and w.step_slider.max == 2 and w.message == ""
    assert "N=2" in w.figure.layout.title.text and w.next_button.disabled
    with pytest.raises(ValueError, match=r"world size must be a whole number in 2\.\.8"):
        RingStepper(world_size=1)
