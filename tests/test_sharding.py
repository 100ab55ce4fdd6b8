"""dplab.sharding: the formula, the wire pricing and the averaging check by themselves, then the
rank measurement on real gloo ranks (one warm pool of 4, world sizes 2 and 4 by subgroup)."""

from __future__ import annotations

import re

import pytest
import torch

import dplab
from dplab.memory import state_bytes
from dplab.sharding import (
    METHODS,
    ShardingUnavailable,
    check_averaging,
    check_method,
    expected_state,
    fsdp2_available,
    fully_shard_api,
    global_batch_step,
    total_wire_bytes,
    wire_factor,
    wire_rows,
)
from dplab.sharding.compat import _missing


def test_formula_follows_the_zero_accounting_for_fp32_adamw():
    psi, n = 1000, 4
    assert expected_state("ddp", psi, n).total == 16 * psi
    assert expected_state("zero1", psi, n).total == 8 * psi + 8 * psi // n
    assert expected_state("zero3", psi, n).total == 16 * psi // n
    # FSDP2's ZeRO-2-like point frees the gathered weights after backward: stage 3 at rest,
    # where the paper's ZeRO-2 keeps every weight (4Ψ + 12Ψ/N)
    assert expected_state("zero2", psi, n).total == 16 * psi // n
    paper_zero2 = state_bytes(psi, world_size=n, zero_stage=2, precision="fp32", optimizer="adam")
    assert paper_zero2.total == 4 * psi + 12 * psi // n


@pytest.mark.parametrize("bad", ["zero4", "", None, 3])
def test_bad_method_is_named(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        check_method(bad)


def test_wire_pricing_ring_and_gloo():
    n = 4
    records = [
        {"op": "all_gather_single", "nbytes": 100, "phase": "forward", "dtype": "float32"},
        {"op": "reduce_scatter_single", "nbytes": 400, "phase": "backward", "dtype": "float32"},
        {"op": "all_reduce", "nbytes": 400, "phase": "backward", "dtype": "float32"},
        {"op": "barrier", "nbytes": 0, "phase": "backward", "dtype": ""},
    ]
    rows = {(r.phase, r.op): r for r in wire_rows(records, n)}
    assert rows[("forward", "all_gather")].tensor_bytes == 400  # one shard handed over, ×N
    assert rows[("backward", "reduce_scatter")].nccl_bytes == pytest.approx(300)
    assert rows[("backward", "reduce_scatter")].gloo_bytes == pytest.approx(600)  # all-reduce
    assert rows[("backward", "all_reduce")].nccl_bytes == pytest.approx(600)
    assert len(rows) == 3
    assert total_wire_bytes(list(rows.values()), "gloo") == pytest.approx(300 + 600 + 600)
    with pytest.raises(ValueError, match="'mpi'"):
        total_wire_bytes([], "mpi")
    with pytest.raises(ValueError, match="'send'"):
        wire_factor("send", 2)


def test_averaging_check_tells_mean_from_sum():
    ref = torch.randn(50, dtype=torch.float64)
    assert check_averaging(ref.clone(), ref, 4).averaged
    summed = check_averaging(4 * ref, ref, 4)
    assert summed.summed and not summed.averaged
    assert "162338" in summed.message and "set_gradient_divide_factor" in summed.message
    other = check_averaging(ref + 1e-3, ref, 4)
    assert not other.averaged and not other.summed
    with pytest.raises(ValueError, match="50"):
        check_averaging(ref[:10], ref, 2)


def test_missing_fsdp2_is_said_in_words():
    text = _missing("FSDP2 (fully_shard)", ImportError("no module"))
    assert torch.__version__ in text and "2.4" in text and "ZeRO-1" in text
    assert issubclass(ShardingUnavailable, RuntimeError)


def _torch_without_new_fsdp(monkeypatch, old_fully_shard=None):
    """This torch seen as 2.4/2.5: ``torch.distributed.fsdp`` without ``fully_shard``, and the
    old home ``torch.distributed._composable.fsdp`` holding ``old_fully_shard`` (or missing)."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", types.ModuleType("fsdp"))
    old = types.ModuleType("fsdp")
    if old_fully_shard is not None:
        old.fully_shard = old_fully_shard
    monkeypatch.setitem(sys.modules, "torch.distributed._composable.fsdp", old)


def test_before_torch_2_6_fully_shard_is_found_in_its_old_home(monkeypatch):
    def old_fully_shard(module, **kwargs):
        return module

    _torch_without_new_fsdp(monkeypatch, old_fully_shard)
    fully_shard, _ = fully_shard_api()
    assert fully_shard is old_fully_shard
    assert fsdp2_available()


def test_a_torch_with_fsdp2_nowhere_says_so_and_what_still_runs(monkeypatch):
    _torch_without_new_fsdp(monkeypatch)
    with pytest.raises(ShardingUnavailable, match=r"FSDP2 \(fully_shard\) is not in the installed"):
        fully_shard_api()
    assert not fsdp2_available()


@pytest.fixture(scope="module")
def pool():
    with dplab.Cluster(4, backend="gloo") as cluster:
        yield cluster


def _run(pool, method, n, **kwargs):
    return [r for r in pool.run(dplab.sharding.sharded_step, method, group_size=n, **kwargs) if r]


@pytest.mark.skipif(not fsdp2_available(), reason="this torch has no FSDP2")
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_state_at_rest_within_2_percent_of_the_formula(pool, method, n):
    ranks = _run(pool, method, n)
    assert len(ranks) == n
    for r in ranks:
        expected = expected_state(method, r.n_params, n).total
        assert abs(r.state_bytes / expected - 1) <= 0.02, (method, n, r.parts, expected)


@pytest.mark.skipif(not fsdp2_available(), reason="this torch has no FSDP2")
@pytest.mark.parametrize("method", METHODS)
def test_first_step_equals_one_process_on_the_global_batch(pool, method):
    grads, weights = global_batch_step(2)
    for r in _run(pool, method, 2, optimizer="sgd", dtype="float64", steps=1):
        assert check_averaging(r.grads, grads, 2).averaged
        assert float((r.weights - weights).abs().max()) <= 1e-9


@pytest.mark.skipif(not fsdp2_available(), reason="this torch has no FSDP2")
def test_collectives_per_method(pool):
    """ZeRO-3 gathers in forward and again in backward; the ZeRO-2-like point only in forward;
    each reduce-scatter runs on gloo as an all-reduce (what the profiler shows)."""
    n = 2
    z3 = _run(pool, "zero3", n, profile=True)[0]
    z2 = _run(pool, "zero2", n)[0]
    rows3 = {(r.phase, r.op): r for r in wire_rows(z3.records, n)}
    rows2 = {(r.phase, r.op): r for r in wire_rows(z2.records, n)}
    assert ("backward", "all_gather") in rows3 and ("backward", "all_gather") not in rows2
    weights_bytes = 4 * z3.n_params
    assert rows3[("forward", "all_gather")].tensor_bytes == weights_bytes
    assert rows3[("backward", "reduce_scatter")].tensor_bytes == weights_bytes
    scatters = rows3[("backward", "reduce_scatter")].calls
    assert z3.backend_events.get("gloo:all_reduce") == scatters
    assert not any("reduce_scatter" in name for name in z3.backend_events)


def test_measured_points_beside_the_curves():
    from dplab.viz.memory import memory_vs_world_size

    fig = memory_vs_world_size(
        1000,
        world_sizes=(1, 2, 4),
        precision="fp32",
        optimizer="adam",
        measured_by_stage={3: {1: 16_000, 2: 8_000, 4: 4_000}},
        unit="MB",
    )
    crosses = [t for t in fig.data if t.name == "measured, ZeRO-3"]
    assert len(crosses) == 1 and list(crosses[0].y) == [0.016, 0.008, 0.004]
    with pytest.raises(ValueError, match="5"):
        memory_vs_world_size(1000, measured_by_stage={5: {1: 1}})


def _zero1_partitions(n: int) -> tuple[list[list[int]], list[list[int]]] | None:
    """On a rank: torch's ZeroRedundancyOptimizer's partition of the GPT and
    ``zero1_partition``'s, as parameter indices per rank in order."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from dplab.sharding.ranks import sharded_model
    from dplab.sharding.unit_profile import zero1_partition

    group = dist.new_group(list(range(n)))  # every rank takes part in creating it
    if dist.get_rank() >= n:
        return None
    params = list(sharded_model().parameters())
    index = {id(p): i for i, p in enumerate(params)}
    opt = ZeroRedundancyOptimizer(params, torch.optim.AdamW, process_group=group)
    theirs = [[index[id(p)] for p in groups[0]["params"]] for groups in opt._partition_parameters()]
    ours = [[index[id(p)] for p in owned] for owned in zero1_partition(params, n)]
    return theirs, ours


@pytest.mark.parametrize("n", [2, 3, 4])
def test_zero1_partition_is_torchs_owners_and_order(pool, n):
    """The unit profile times ZeRO-1's broadcasts owner by owner in this order: torch's own."""
    theirs, ours = next(r for r in pool.run(_zero1_partitions, n) if r)
    assert ours == theirs
