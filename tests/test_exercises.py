"""The §3 exercise checkers: each passes the reference, fails typical wrong answers with the
hint that fits, and reports an untouched exercise as "not attempted yet"."""

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


def sum_without_dividing(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def reduce_a_copy(model):
    for p in model.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        g /= dist.get_world_size()


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
def test_the_reference_passes(name, cluster2):
    check, reference = CHECKS[name]
    result = check(reference, cluster2)
    assert result.status == PASSED, result.message
    assert result.passed


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
        (check_average_gradients, sum_without_dividing, "2× the global-batch gradient"),
        (check_average_gradients, reduce_a_copy, "all-reduce a copy?"),
        (check_average_gradients, do_nothing, "still each rank's own g_i"),
        (check_accumulation_step, without_no_sync, "4 all-reduces for 1 bucket(s)"),
        (check_accumulation_step, without_scaling, "scale each loss by 1/A"),
        (check_accumulation_step, everything_in_no_sync, "outside no_sync()"),
        (check_accumulation_step, without_zero_grad, "optimizer.zero_grad()"),
        (check_accumulation_step, without_step, "call optimizer.step()"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_typical_mistakes_fail_with_the_fitting_hint(check, wrong, hint, cluster2):
    result = check(wrong, cluster2)
    assert result.status == FAILED
    assert hint in result.message, result.message


def raises_on_rank(model):
    raise ValueError("oops")


def test_a_raising_answer_fails_and_the_pool_survives(cluster2):
    result = check_average_gradients(raises_on_rank, cluster2)
    assert result.status == FAILED
    assert "ValueError: oops" in result.message
    assert check_average_gradients(solutions.average_gradients, cluster2).passed


def only_rank0_broadcasts(model):
    if dist.get_rank() == 0:
        dist.broadcast(next(model.parameters()).detach(), src=0)


def test_a_hanging_answer_times_out_and_the_pool_is_restarted():
    with dplab.Cluster(2, backend="gloo", timeout_s=5) as cluster:
        result = check_broadcast_weights(only_rank0_broadcasts, cluster)
        assert result.status == FAILED
        assert "not every rank called" in result.message
        assert cluster.alive
        assert check_broadcast_weights(solutions.broadcast_weights, cluster).passed


def test_without_a_cluster_the_checker_launches_its_own_ranks():
    assert check_average_gradients(solutions.average_gradients).passed


def test_not_a_function():
    result = check_average_gradients(42)
    assert result.status == FAILED and "expected a function" in result.message


def test_result_shows_itself():
    r = CheckResult("x", PASSED, "fine <b>")
    assert repr(r) == "[passed] x: fine <b>"
    assert "fine &lt;b&gt;" in r._repr_html_()
