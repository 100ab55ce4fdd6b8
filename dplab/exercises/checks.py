"""Checkers for the §3 exercises: each runs the learner's function on real ranks and says why it
is right or what it most likely got wrong.

A function defined in a notebook cell reaches the ranks by value (``dplab.launch`` ships it with
cloudpickle), so the learner's code runs exactly where real DP code runs: on every rank, inside
a process group. A function that still raises ``NotImplementedError`` reports "not attempted
yet" rather than failing, so a notebook with untouched exercises still runs green.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import dplab
from dplab.ddp import DDP
from dplab.mechanics._common import (
    flat_grads,
    flat_params,
    max_abs_diff,
    params_hash,
    rank_and_world,
    shard,
    tensor_hash,
)
from dplab.mechanics.gradients import gradient
from dplab.mechanics.traffic import CommCounter
from dplab.mechanics.training import step_batches
from dplab.models import make_batch, make_model

PASSED, FAILED, NOT_ATTEMPTED = "passed", "failed", "not attempted yet"
TOLERANCE = 1e-12  # float64: the only differences allowed are the order of sums (~1e-17)
CHECK_TIMEOUT_S = 120.0


@dataclass
class CheckResult:
    """The verdict on one exercise: ``status`` is passed, failed or "not attempted yet"."""

    exercise: str
    status: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def __repr__(self) -> str:
        return f"[{self.status}] {self.exercise}: {self.message}"

    def _repr_html_(self) -> str:
        color = {PASSED: "#54A24B", FAILED: "#E45756"}.get(self.status, "#BAB0AC")
        mark = {PASSED: "✔", FAILED: "✘"}.get(self.status, "…")
        return (
            f'<div style="border-left:4px solid {color};padding:4px 10px;margin:4px 0">'
            f"<b>{mark} {html.escape(self.exercise)}: {html.escape(self.status)}</b><br>"
            f"{html.escape(self.message)}</div>"
        )


def _not_attempted(exercise: str) -> CheckResult:
    return CheckResult(
        exercise, NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code, then re-run."
    )


def _run_on_ranks(
    exercise: str, rank_fn: Callable, learner_fn: Any, cluster: Any, world_size: int
) -> list[dict[str, Any]] | CheckResult:
    """The ranks' results, or a CheckResult when there is nothing to judge or the run failed."""
    if learner_fn is None:
        return _not_attempted(exercise)
    if not callable(learner_fn):
        return CheckResult(exercise, FAILED, f"expected a function, got {learner_fn!r}")
    try:
        if cluster is not None:
            results = cluster.run(rank_fn, learner_fn)
        else:
            results = dplab.launch(
                rank_fn, world_size, args=(learner_fn,), timeout_s=CHECK_TIMEOUT_S
            )
    except dplab.RankError as e:
        _revive(cluster)
        last = e.traceback.strip().splitlines()[-1] if e.traceback.strip() else str(e)
        return CheckResult(exercise, FAILED, f"your function raised on rank {e.rank}: {last}")
    except dplab.RankTimeout as e:
        _revive(cluster)
        return CheckResult(
            exercise,
            FAILED,
            f"{e} — a collective that not every rank called? (every rank must make the same "
            "collective calls in the same order)",
        )
    except TypeError as e:  # the function could not be shipped to the ranks
        return CheckResult(exercise, FAILED, str(e))
    if any(r.get("not_attempted") for r in results):
        return _not_attempted(exercise)
    return results


def _revive(cluster: Any) -> None:
    """A rank that failed mid-collective takes the pool down; bring it back for later cells."""
    if cluster is not None and not cluster.alive:
        cluster.restart()


# ---------------------------------------------------------------------------------------------
# Exercise 1: broadcast the weights (what DDP does at construction)


def _broadcast_rank(fn: Callable) -> dict[str, Any]:
    rank, _ = rank_and_world()
    model = make_model("mlp", seed=100 + rank)  # every rank starts different, on purpose
    rank0 = params_hash(make_model("mlp", seed=100))
    params_before = [p for p in model.parameters()]
    try:
        with CommCounter() as counter:
            fn(model)
    except NotImplementedError:
        return {"not_attempted": True}
    return {
        "rank": rank,
        "after": params_hash(model),
        "rank0_initial": rank0,
        "same_tensors": all(a is b for a, b in zip(params_before, model.parameters(), strict=True)),
        "bytes": counter.nbytes(),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def check_broadcast_weights(fn: Any, cluster: Any = None, *, world_size: int = 2) -> CheckResult:
    """Ranks start with different weights; after ``fn(model)`` all must hold rank 0's."""
    name = "broadcast_weights"
    results = _run_on_ranks(name, _broadcast_rank, fn, cluster, world_size)
    if isinstance(results, CheckResult):
        return results
    hashes = [r["after"] for r in results]
    details = {"hashes": hashes, "bytes_per_rank": [r["bytes"] for r in results]}
    if not all(r["same_tensors"] for r in results):
        return CheckResult(
            name, FAILED, "change the model's parameters in place; don't replace them", details
        )
    if len(set(hashes)) > 1:
        bad = [r["rank"] for r in results if r["after"] != results[0]["after"]]
        return CheckResult(
            name, FAILED, f"the replicas still differ: rank(s) {bad} do not match rank 0", details
        )
    if hashes[0] != results[0]["rank0_initial"]:
        return CheckResult(
            name,
            FAILED,
            "the replicas agree, but not on rank 0's initial weights (did you average them?). "
            "DDP copies rank 0's weights to everyone.",
            details,
        )
    moved = results[0]["bytes"] / results[0]["param_bytes"]
    return CheckResult(
        name,
        PASSED,
        f"every rank now holds rank 0's weights (hash {hashes[0][:12]}…); "
        f"{moved:g}× the weight bytes went through collectives on each rank.",
        details,
    )


# ---------------------------------------------------------------------------------------------
# Exercise 2: average the gradients


def _average_rank(fn: Callable) -> dict[str, Any]:
    rank, n = rank_and_world()
    dt = torch.float64
    model = make_model("mlp", seed=0, dtype=dt)
    x, y = make_batch("mlp", 32, seed=1, dtype=dt)
    g_global = gradient(model, x, y)
    model.zero_grad(set_to_none=True)
    model(shard(x, rank, n), shard(y, rank, n)).backward()
    g_local = flat_grads(model)
    try:
        with CommCounter() as counter:
            fn(model)
    except NotImplementedError:
        return {"not_attempted": True}
    g = flat_grads(model)
    return {
        "rank": rank,
        "world_size": n,
        "max_diff": max_abs_diff(g, g_global),
        "unchanged": bool(torch.equal(g, g_local)),
        "ratio": (g @ g_global / (g_global @ g_global)).item(),
        "hash": tensor_hash(g),
        "all_reduce_calls": counter.calls("all_reduce"),
    }


def check_average_gradients(fn: Any, cluster: Any = None, *, world_size: int = 2) -> CheckResult:
    """Each rank backpropagates its shard; after ``fn(model)`` every ``.grad`` must be the
    global-batch gradient (float64, to 1e-12) and identical on every rank."""
    name = "average_gradients"
    results = _run_on_ranks(name, _average_rank, fn, cluster, world_size)
    if isinstance(results, CheckResult):
        return results
    n = results[0]["world_size"]
    worst = max(r["max_diff"] for r in results)
    details = {"max_diff": worst, "ratios": [r["ratio"] for r in results]}
    if all(r["unchanged"] for r in results):
        return CheckResult(
            name,
            FAILED,
            "the gradients are still each rank's own g_i: nothing reached .grad (did you "
            "all-reduce a copy?)",
            details,
        )
    if worst <= TOLERANCE and len({r["hash"] for r in results}) == 1:
        return CheckResult(
            name,
            PASSED,
            f"every rank's .grad equals the global-batch gradient (max |difference| "
            f"{worst:.1e}), bit-identical across ranks.",
            details,
        )
    ratio = results[0]["ratio"]
    if math.isclose(ratio, n, rel_tol=1e-6):
        return CheckResult(
            name,
            FAILED,
            f"the gradients are {n}× the global-batch gradient: all_reduce sums; divide by the "
            "world size to average.",
            details,
        )
    return CheckResult(
        name,
        FAILED,
        f"the gradients differ from the global-batch gradient by up to {worst:.3g}",
        details,
    )


# ---------------------------------------------------------------------------------------------
# Exercise 3: gradient accumulation with no_sync

ACCUM = 4
GLOBAL_BATCH = 32
LR = 0.1


def _accumulation_rank(fn: Callable) -> dict[str, Any]:
    rank, _ = rank_and_world()
    dt = torch.float64
    model = make_model("mlp", seed=0, dtype=dt)
    initial = flat_params(model)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    micro = step_batches(0, global_batch=GLOBAL_BATCH, accum=ACCUM, seed=0, dtype=dt)
    try:
        with CommCounter() as counter:
            fn(ddp, opt, micro)
    except NotImplementedError:
        return {"not_attempted": True}
    # The reference: one SGD step on the gradient of the whole global batch, in this process.
    reference = make_model("mlp", seed=0, dtype=dt)
    x, y = make_batch("mlp", GLOBAL_BATCH, seed=1, dtype=dt)
    expected = initial - LR * gradient(reference, x, y)
    after = flat_params(model)
    moved, wanted = after - initial, expected - initial
    return {
        "rank": rank,
        "max_diff": max_abs_diff(after, expected),
        "moved": bool(moved.abs().max() > 0),
        "step_ratio": (moved @ wanted / (wanted @ wanted)).item(),
        "hash": tensor_hash(after),
        "all_reduce_calls": counter.calls("all_reduce"),
        "n_buckets": len(ddp.buckets),
        "grads_left": max((p.grad.abs().max().item() for p in model.parameters()
                           if p.grad is not None), default=0.0),
    }  # fmt: skip


def check_accumulation_step(fn: Any, cluster: Any = None, *, world_size: int = 2) -> CheckResult:
    """``fn(ddp, optimizer, micro_batches)`` with A=4 micro-batches per rank must leave the
    weights of one SGD step on the global batch, with one all-reduce per bucket, and zeroed
    gradients."""
    name = "accumulation_step"
    results = _run_on_ranks(name, _accumulation_rank, fn, cluster, world_size)
    if isinstance(results, CheckResult):
        return results
    r0 = results[0]
    worst = max(r["max_diff"] for r in results)
    calls, buckets = r0["all_reduce_calls"], r0["n_buckets"]
    details = {"max_diff": worst, "all_reduce_calls": calls, "buckets": buckets}
    if not r0["moved"]:
        return CheckResult(
            name, FAILED, "the weights did not move: call optimizer.step() at the end", details
        )
    if calls == 0 or len({r["hash"] for r in results}) > 1:
        return CheckResult(
            name,
            FAILED,
            "the replicas ended different: the last micro-batch's backward must run outside "
            "no_sync(), so that DDP all-reduces the accumulated gradients",
            details,
        )
    if worst > TOLERANCE:
        if math.isclose(r0["step_ratio"], ACCUM, rel_tol=1e-3):
            msg = (
                f"the step was {ACCUM}× too large: the gradients of {ACCUM} micro-batch means "
                f"were summed; scale each loss by 1/A (A={ACCUM})"
            )
        else:
            msg = f"the weights differ from one big-batch step by up to {worst:.3g}"
        return CheckResult(name, FAILED, msg, details)
    if calls != buckets:
        return CheckResult(
            name,
            FAILED,
            f"right weights, but {calls} all-reduces for {buckets} bucket(s): without no_sync() "
            f"every micro-batch all-reduces ({ACCUM}× the traffic)",
            details,
        )
    if max(r["grads_left"] for r in results) > 0:
        return CheckResult(
            name,
            FAILED,
            "right step, but the gradients are still there: call optimizer.zero_grad() so "
            "the next step does not add to them",
            details,
        )
    return CheckResult(
        name,
        PASSED,
        f"one big-batch step (max |difference| {worst:.1e}) with {calls} all-reduce "
        f"for {buckets} bucket(s) over {ACCUM} micro-batches.",
        details,
    )
