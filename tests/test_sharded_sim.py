"""dplab.sim.sharded: the sharded step laid out by hand-checkable arithmetic, then its calibration
read from real gloo ranks (dplab.sharding.unit_profile, timed_step)."""

from __future__ import annotations

import dataclasses

import pytest

from dplab.cli import main
from dplab.collectives.cost import ring_time
from dplab.sim import BackwardProfile, Fabric, Link
from dplab.sim.profile import ParamTiming
from dplab.sim.sharded import (
    UnitProfile,
    links_from_ranks,
    simulate_sharded,
    unit_profile_from_ranks,
    zero3_costs,
    zero3_costs_more_at,
)
from dplab.viz import zero3_cost_figure

LINK = Link("test", alpha_s=1e-3, bandwidth_Bps=1e6)  # 1 ms per step, 1 MB/s: easy sums
MB = 1_000_000


def profile(fwd: float = 10.0) -> UnitProfile:
    return UnitProfile(
        root_bytes=MB,
        block_bytes=(2 * MB, 2 * MB),
        root_forward_ms=(1.0, 2.0),
        block_forward_ms=(fwd, fwd),
        root_backward_ms=(2.0, 4.0),
        block_backward_ms=(2 * fwd, 2 * fwd),
        optimizer_ms={"ddp": 8.0},
    )


def ar_ms(nbytes: float, n: int = 2) -> float:
    return 1e3 * ring_time(nbytes, n, LINK.alpha_s, LINK.beta_s_per_byte)


def test_serial_zero3_is_compute_plus_every_collective():
    p = profile()
    got = simulate_sharded(p, "zero3", LINK, 2, prefetch=False)
    # gathers: every unit in forward and again in backward; reduce-scatters: 3 units
    gathers = 2 * ar_ms(MB) / 2 + 2 * 2 * ar_ms(2 * MB) / 2
    scatters = ar_ms(MB) / 2 + 2 * ar_ms(2 * MB) / 2
    assert got.step_ms == pytest.approx(p.compute_ms + 8.0 / 2 + gathers + scatters)
    assert got.comm_ms == pytest.approx(gathers + scatters)
    names = [s.name for s in got.spans if s.lane == "comm"]
    assert sum("all_gather" in n for n in names) == 6
    assert sum("reduce_scatter" in n for n in names) == 3


def test_zero2_skips_backwards_gathers_and_gloo_scatters_cost_an_all_reduce():
    p = profile()
    zero2 = simulate_sharded(p, "zero2", LINK, 2, prefetch=False)
    assert not any("(backward)" in s.name for s in zero2.spans)
    gloo = simulate_sharded(p, "zero2", LINK, 2, prefetch=False, backend="gloo")
    extra = (ar_ms(MB) + 2 * ar_ms(2 * MB)) / 2  # each reduce-scatter is a whole all-reduce
    assert gloo.step_ms - zero2.step_ms == pytest.approx(extra)


def test_prefetch_hides_gathers_behind_the_neighbouring_units_compute():
    p = profile(fwd=50.0)  # on the fast link each gather (< 2 ms) is shorter than a block
    fast = Link("fast", alpha_s=1e-4, bandwidth_Bps=1e9)
    serial = simulate_sharded(p, "zero3", fast, 4, prefetch=False)
    overlapped = simulate_sharded(p, "zero3", fast, 4, prefetch=True)
    assert overlapped.step_ms < serial.step_ms
    assert overlapped.step_ms >= p.compute_ms
    # what is left exposed: the root's gathers, the first block's, the last scatter
    assert overlapped.exposed_comm_ms < 0.5 * serial.exposed_comm_ms


def test_ddp_one_bucket_and_one_rank():
    p = profile()
    ddp = simulate_sharded(p, "ddp", LINK, 2)
    assert ddp.step_ms == pytest.approx(p.compute_ms + ar_ms(p.param_bytes) + 8.0)
    small = simulate_sharded(p, "ddp", LINK, 2, bucket_cap_mb=1)  # a bucket per unit: overlap
    assert small.step_ms < ddp.step_ms
    for m in ("ddp", "zero1", "zero2", "zero3"):
        one = simulate_sharded(p, m, LINK, 1)
        assert one.step_ms == pytest.approx(p.compute_ms + 8.0) and one.comm_ms == 0


def test_zero1_adds_the_weights_all_gather_after_a_sharded_optimizer():
    p = profile()
    zero1 = simulate_sharded(p, "zero1", LINK, 2)
    ddp = simulate_sharded(p, "ddp", LINK, 2)
    assert zero1.step_ms - ddp.step_ms == pytest.approx(ar_ms(p.param_bytes) / 2 - 8.0 / 2)


def test_zero1_on_gloo_takes_its_measured_broadcasts_where_the_profile_has_them():
    p = dataclasses.replace(profile(), broadcast_ms={2: 5.0})
    ddp = simulate_sharded(p, "ddp", LINK, 2, backend="gloo")
    zero1 = simulate_sharded(p, "zero1", LINK, 2, backend="gloo")
    assert zero1.step_ms - ddp.step_ms == pytest.approx(5.0 - 8.0 / 2)
    # at another world size, or priced for NCCL, the weights' all-gather as before
    for n, backend in ((4, "gloo"), (2, "nccl")):
        got = simulate_sharded(p, "zero1", LINK, n, backend=backend)
        assert got.step_ms == pytest.approx(simulate_sharded(profile(), "zero1", LINK, n).step_ms)
    with pytest.raises(ValueError, match="broadcast_ms"):
        dataclasses.replace(profile(), broadcast_ms={2: -1.0})


def test_fsdp_on_gloo_takes_each_units_measured_gather_where_the_profile_has_them():
    p = dataclasses.replace(profile(), gather_ms={2: (1.0, 2.0, 3.0)})  # root, block0, block1
    for prefetch in (False, True):  # prefetch issues the gathers from other places
        got = simulate_sharded(p, "zero3", LINK, 2, backend="gloo", prefetch=prefetch)
        gathers = {s.name: s.end_ms - s.start_ms for s in got.spans if "all_gather" in s.name}
        assert gathers == pytest.approx({
            "all_gather root": 1.0, "all_gather block0": 2.0, "all_gather block1": 3.0,
            "all_gather root (backward)": 1.0, "all_gather block0 (backward)": 2.0,
            "all_gather block1 (backward)": 3.0,
        }), prefetch  # fmt: skip
    # at another world size, or priced for NCCL, from the bytes as before
    for n, backend in ((4, "gloo"), (2, "nccl")):
        got = simulate_sharded(p, "zero3", LINK, n, backend=backend)
        plain = simulate_sharded(profile(), "zero3", LINK, n, backend=backend)
        assert got.step_ms == pytest.approx(plain.step_ms)
    with pytest.raises(ValueError, match=r"gather_ms\[2\] needs the root's and each of the 2"):
        dataclasses.replace(profile(), gather_ms={2: (1.0, 2.0)})
    for name, value in (("gather_ms", (1.0, 2.0, 3.0)), ("broadcast_ms", 5.0)):
        for world in (1, 2.0, True):  # one rank sends nothing; a key is a whole world size
            with pytest.raises(ValueError, match=rf"{name} is keyed by .* got key {world!r}"):
                dataclasses.replace(profile(), **{name: {world: value}})


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"method": "zero4"}, "zero4"),
        ({"backend": "mpi"}, "mpi"),
        ({"world_size": 0}, "0"),
    ],
)
def test_bad_arguments_are_named(kwargs, bad):
    args = {"method": "zero3", "world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=bad):
        simulate_sharded(profile(), args.pop("method"), LINK, args.pop("world_size"), **args)


def test_profile_needs_a_time_per_block():
    with pytest.raises(ValueError, match="2 blocks, 1 forward"):
        UnitProfile(0, (1, 1), (0, 0), (1.0,), (0, 0), (1.0, 1.0), {"ddp": 1.0})


def test_zero3_costs_more_across_a_slow_network_than_inside_a_node():
    block = 400e6  # bf16 bytes of a 7B-like model's block; 4k tokens of compute per GPU
    p = UnitProfile.uniform(32, block, 2 * 200e6 * 4096 / 400e12 * 1e3, optimizer_ms=5.0)
    rows = zero3_costs(
        p, [Fabric.preset("aws-p4d", nodes=k) for k in (1, 4, 16)], bytes_per_param=2
    )
    assert rows[0].extra_fraction < 0.05 < rows[-1].extra_fraction
    assert zero3_costs_more_at(rows, 0.10) in (32, 128)
    assert rows[-1].saved_bytes == pytest.approx(16 * 32 * 200e6 * (1 - 1 / 128))
    fig = zero3_cost_figure({"aws-p4d": rows})
    assert len(fig.data) == 2 and list(fig.data[0].x) == [8, 32, 128]
    with pytest.raises(ValueError, match="no ZeRO-3 cost rows"):
        zero3_cost_figure({})


def _rank(world: int, a: float, b: float) -> dict:
    step = {
        "f0<": 1.0,
        "f0>": 3.0,
        "f1<": 3.0,
        "f1>": 5.0,
        "forward": 7.0,
        "b1<": 10.0,
        "b1>": 14.0,
        "b0<": 14.0,
        "b0>": 18.0,
        "backward": 20.0,
        "optimizer": 4.0,
    }
    colls = [
        (op, s, (1 if op == "all_reduce" else 0.5) * 1e3 * ring_time(s, world, a, b))
        for s in (4096, 1 << 20)
        for op in ("all_reduce", "all_gather")
    ]
    return {
        "rank": 0,
        "world_size": world,
        "steps": [step] * 3,
        "unit_bytes": [10, 20, 20],
        "tensor_bytes": [10, 20, 20],
        "collectives": colls,
        "optimizer_ms": {"zero1": 2.0},
        "zero1_broadcast_ms": 7.0,
        "gather_ms": [0.5, 1.0, 1.5],
        "alone_ms": {"ddp": 25.0, "zero3": 40.0},
    }


def test_calibration_is_read_back_from_rank_data():
    ranks = [_rank(4, 2e-4, 1e-9), None]
    p = unit_profile_from_ranks(ranks)
    assert p.block_forward_ms == (2.0, 2.0) and p.root_forward_ms == (1.0, 2.0)
    assert p.block_backward_ms == (4.0, 4.0) and p.root_backward_ms == (2.0, 3.0)
    assert p.optimizer_ms["zero1"] == 2.0 and p.overhead_ms["zero3"] == pytest.approx(16.0)
    assert p.broadcast_ms == {4: 7.0} and p.gather_ms == {4: (0.5, 1.0, 1.5)}
    # two ranks: each measured collective is its slowest rank's, unit by unit
    other = {**_rank(4, 2e-4, 1e-9), "zero1_broadcast_ms": 9.0, "gather_ms": [0.7, 0.2, 1.5]}
    both = unit_profile_from_ranks([ranks[0], other])
    assert both.broadcast_ms == {4: 9.0} and both.gather_ms == {4: (0.7, 1.0, 1.5)}
    ar, ag = links_from_ranks(ranks)
    for link in (ar, ag):
        assert link.alpha_s == pytest.approx(2e-4, rel=1e-6)
        assert link.beta_s_per_byte == pytest.approx(1e-9, rel=1e-6)
    with pytest.raises(ValueError, match="no rank"):
        unit_profile_from_ranks([None])


def test_unit_profile_and_timed_step_on_real_ranks():
    import dplab
    from dplab.sharding import fsdp2_available
    from dplab.sharding.step_time import timed_step
    from dplab.sharding.unit_profile import unit_profile

    if not fsdp2_available():
        pytest.skip("this torch has no FSDP2")
    with dplab.Cluster(2, backend="gloo") as cluster:
        raw = cluster.run(unit_profile, steps=2, warmup=1, repeats=2)
        times = cluster.run(timed_step, "zero3", steps=2, warmup=1)
    p = unit_profile_from_ranks(raw)
    assert len(p.block_bytes) == 2 and p.param_bytes == sum(raw[0]["tensor_bytes"])
    assert min(p.block_forward_ms + p.block_backward_ms) > 0
    assert set(p.overhead_ms) == {"ddp", "zero1", "zero2", "zero3"}
    assert all(len(t) == 2 and min(t) > 0 for t in times)
    ar, _ = links_from_ranks(raw)
    assert simulate_sharded(p, "zero3", ar, 2, backend="gloo").step_ms > p.compute_ms
    assert p.broadcast_ms[2] > 0 and len(p.gather_ms[2]) == 3 and min(p.gather_ms[2]) > 0
    with pytest.raises(ValueError, match="'zero9'"):
        timed_step("zero9")


def test_a_ddp_profile_becomes_units_by_block_from_its_ready_times():
    # backward: head (ln_f) ready at 5 ms, block 1 at 25, block 0 at 45, embeddings at 50
    params = (
        ParamTiming("tok.weight", 100, 400, "float32", 50.0),
        ParamTiming("blocks.0.fc.weight", 200, 800, "float32", 45.0),
        ParamTiming("blocks.0.fc.bias", 10, 40, "float32", 44.0),
        ParamTiming("blocks.1.fc.weight", 200, 800, "float32", 25.0),
        ParamTiming("ln_f.weight", 10, 40, "float32", 5.0),
    )
    ddp = BackwardProfile("toy", params, forward_ms=30.0, backward_ms=60.0, optimizer_ms=3.0)
    units = UnitProfile.from_backward(ddp)
    assert (units.root_bytes, units.block_bytes) == (440, (840, 800))
    # the embeddings take what is left of backward after block 0's last gradient
    assert units.root_backward_ms == (15.0, 5.0)
    assert units.block_backward_ms == (20.0, 20.0)
    # forward is half of backward here, split in the same proportions
    assert units.root_forward_ms == (7.5, 2.5) and units.block_forward_ms == (10.0, 10.0)
    assert units.compute_ms == pytest.approx(ddp.forward_ms + ddp.backward_ms)
    assert units.optimizer_ms == {"ddp": 3.0}


def test_a_profile_without_blocks_is_refused():
    params = (ParamTiming("fc.weight", 10, 40, "float32", 1.0),)
    flat = BackwardProfile("flat", params, forward_ms=1.0, backward_ms=2.0, optimizer_ms=0.0)
    with pytest.raises(ValueError, match="no parameter is in a block"):
        UnitProfile.from_backward(flat)


def test_the_simulate_verb_predicts_a_sharded_step_beside_ddp(capsys):
    argv = ["simulate", "--model", "gpt-7m", "--link", "gloo-loopback", "--world-size", "4"]
    assert main([*argv, "--sharding", "zero3"]) == 0
    out = capsys.readouterr().out
    assert "8 blocks as FSDP units" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(rows) == {"ddp", "zero3"}
    # the printed steps are the simulator's, on the units the profile gives
    from dplab.sim.link import ASSETS, get_link

    units = UnitProfile.from_backward(BackwardProfile.load(ASSETS / "profile_gpt-7m.json"))
    want = simulate_sharded(units, "zero3", get_link("gloo-loopback"), 4, backend="gloo").step_ms
    assert f"step {want:10,.2f} ms" in rows["zero3"]


def test_sharding_with_contention_or_json_is_refused(capsys):
    argv = ["simulate", "--model", "gpt-7m", "--sharding", "zero3", "--contention"]
    assert main(argv) == 2
    assert "--sharding predicts spans of its own" in capsys.readouterr().err
