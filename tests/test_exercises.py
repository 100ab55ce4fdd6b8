"""The §3 exercise checkers: each passes the reference, fails typical wrong answers with the
hint that fits, and reports an untouched exercise as "not attempted yet".

Each wrong answer below is one a learner writes and that a weaker checker let through: a
constant instead of the world size (right at N = 2 only), a constant instead of A (right at
A = 4 only), a broadcast of the parameters that forgets the buffers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import dplab
from dplab.exercises import (
    FAILED,
    NOT_ATTEMPTED,
    PASSED,
    CheckResult,
    check_accumulation_step,
    check_average_gradients,
    check_broadcast_weights,
    solutions,
)
from dplab.exercises.checks import AVERAGE_WORLD_SIZES, probe_reduce_avg


@pytest.fixture(scope="module")
def cluster4():
    """The second pool the average checker needs (N = 4), started once for this module."""
    with dplab.Cluster(4, backend="gloo") as c:
        yield c


@pytest.fixture
def pools(cluster2, cluster4):
    return (cluster2, cluster4)


def untouched(*args):
    raise NotImplementedError


# -- wrong answers learners write ------------------------------------------------------------------


def average_the_weights(model):
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p)
            p /= dist.get_world_size()


def do_nothing(model):
    pass


def parameters_only(model):
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)


def sum_without_dividing(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def divide_by_two(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2


def reduce_a_copy(model):
    for p in model.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        g /= dist.get_world_size()


def average_with_reduce_op(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def refused_avg(model):
    """What gloo before torch 2.7 raised for ReduceOp.AVG (torch 2.13's gloo takes it)."""
    raise RuntimeError("Cannot use ReduceOp.AVG with Gloo")


def _accumulate(scale):
    def step(ddp, optimizer, micro_batches):
        for i, (x, y) in enumerate(micro_batches):
            with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                (ddp(x, y) / scale(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


loss_over_4 = _accumulate(lambda mb: 4)
loss_over_world_size = _accumulate(lambda mb: dist.get_world_size())


def without_no_sync(ddp, optimizer, micro_batches):
    for x, y in micro_batches:
        (ddp(x, y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def without_scaling(ddp, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            ddp(x, y).backward()
    optimizer.step()
    optimizer.zero_grad()


def everything_in_no_sync(ddp, optimizer, micro_batches):
    with ddp.no_sync():
        for x, y in micro_batches:
            (ddp(x, y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def without_zero_grad(ddp, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (ddp(x, y) / len(micro_batches)).backward()
    optimizer.step()


def without_step(ddp, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (ddp(x, y) / len(micro_batches)).backward()


# -- the checks ------------------------------------------------------------------------------------

CHECKS = {
    "broadcast": (check_broadcast_weights, solutions.broadcast_weights),
    "average": (check_average_gradients, solutions.average_gradients),
    "accumulation": (check_accumulation_step, solutions.accumulation_step),
}


@pytest.mark.parametrize("name", CHECKS)
def test_the_reference_passes(name, pools):
    check, reference = CHECKS[name]
    result = check(reference, pools)
    assert result.status == PASSED, result.message
    assert result.passed


def test_the_average_is_checked_at_two_world_sizes(pools):
    assert AVERAGE_WORLD_SIZES == (2, 4)
    result = check_average_gradients(solutions.average_gradients, pools)
    assert result.details["world_sizes"] == [2, 4]
    assert "N = 2 and N = 4" in result.message


def test_the_accumulation_is_checked_at_two_values_of_a(pools):
    result = check_accumulation_step(solutions.accumulation_step, pools)
    assert [a for a, _, _ in result.details["calls"]] == [4, 2]
    assert all(calls == buckets for _, calls, buckets in result.details["calls"])


@pytest.mark.parametrize("name", CHECKS)
def test_untouched_is_not_attempted_not_failed(name, cluster2):
    check, _ = CHECKS[name]
    for fn in (untouched, None):
        result = check(fn, cluster2)
        assert result.status == NOT_ATTEMPTED
        assert "not attempted yet" in result._repr_html_()
    assert cluster2.alive


@pytest.mark.parametrize(
    "check, wrong, hint",
    [
        (check_broadcast_weights, average_the_weights, "did you average them?"),
        (check_broadcast_weights, do_nothing, "the replicas still differ: rank(s) [1]"),
        (check_broadcast_weights, parameters_only, "broadcast model.buffers() too"),
        (check_average_gradients, sum_without_dividing, "2× the global-batch gradient"),
        (
            check_average_gradients,
            divide_by_two,
            "at N = 4 the gradients are 2× the global-batch gradient: you divided the sum by 2",
        ),
        (check_average_gradients, reduce_a_copy, "all-reduce a copy?"),
        (check_average_gradients, do_nothing, "still each rank's own g_i"),
        (check_average_gradients, refused_avg, "gloo gained it in torch 2.7"),
        (check_accumulation_step, without_no_sync, "4 all-reduces for 1 bucket(s)"),
        (check_accumulation_step, without_scaling, "scale each loss by 1/A"),
        (
            check_accumulation_step,
            loss_over_4,
            "at A = 2 the step was 0.5× one big-batch step: you divided each loss by 4",
        ),
        (
            check_accumulation_step,
            loss_over_world_size,
            "at A = 4 the step was 2× one big-batch step: you divided each loss by 2",
        ),
        (check_accumulation_step, everything_in_no_sync, "outside no_sync()"),
        (check_accumulation_step, without_zero_grad, "optimizer.zero_grad()"),
        (check_accumulation_step, without_step, "call optimizer.step()"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_typical_mistakes_fail_with_the_fitting_hint(check, wrong, hint, pools):
    result = check(wrong, pools)
    assert result.status == FAILED
    assert hint in result.message, result.message


def test_divide_by_two_is_right_at_n_2_only(pools):
    """The N = 4 run is what catches `grad /= 2`: at N = 2 alone it passes."""
    assert check_average_gradients(divide_by_two, pools, world_sizes=(2,)).passed
    assert not check_average_gradients(divide_by_two, pools).passed


def test_loss_over_4_is_right_at_a_4_only(pools):
    assert check_accumulation_step(loss_over_4, pools, accums=(4,)).passed
    assert not check_accumulation_step(loss_over_4, pools).passed


def test_reduce_op_avg_on_gloo_is_the_sum_divided_by_n(pools):
    """torch 2.13's gloo takes ReduceOp.AVG: a SUM followed by a division (torch PR #149781), so
    an answer that uses it passes, bit for bit the same as sum-then-divide."""
    for pool in pools:
        probes = pool.run(probe_reduce_avg)
        assert all(p["backend"] == "gloo" for p in probes)
        if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 7):
            assert all(p["supported"] and p["equals_sum_over_n"] for p in probes), probes
    if all(p["supported"] for p in probes):
        assert check_average_gradients(average_with_reduce_op, pools).passed


def test_a_raising_answer_fails_and_the_pool_survives(cluster2):
    result = check_average_gradients(raises_on_rank, cluster2, world_sizes=(2,))
    assert result.status == FAILED
    assert "ValueError: oops" in result.message
    assert check_average_gradients(solutions.average_gradients, cluster2, world_sizes=(2,)).passed


def raises_on_rank(model):
    raise ValueError("oops")


def only_rank0_broadcasts(model):
    if dist.get_rank() == 0:
        dist.broadcast(next(model.parameters()).detach(), src=0)


def test_a_hanging_answer_fails_and_the_pool_is_restarted():
    with dplab.Cluster(2, backend="gloo", timeout_s=5) as cluster:
        result = check_broadcast_weights(only_rank0_broadcasts, cluster)
        assert result.status == FAILED
        assert "not every rank called" in result.message
        assert cluster.alive
        assert check_broadcast_weights(solutions.broadcast_weights, cluster).passed


def test_without_a_cluster_the_checker_launches_its_own_ranks():
    assert check_average_gradients(solutions.average_gradients, world_sizes=(2,)).passed


def test_not_a_function():
    result = check_average_gradients(42)
    assert result.status == FAILED and "expected a function" in result.message


def test_result_shows_itself():
    r = CheckResult("x", PASSED, "fine <b>")
    assert repr(r) == "[passed] x: fine <b>"
    assert "fine &lt;b&gt;" in r._repr_html_()
