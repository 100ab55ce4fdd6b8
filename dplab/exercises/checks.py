"""Checkers for the §3 exercises: each runs the learner's function on real ranks and says why it
is right or what it most likely got wrong.

A function defined in a notebook cell reaches the ranks by value (``dplab.launch`` ships it with
cloudpickle), so the learner's code runs exactly where real DP code runs: on every rank, inside
a process group. A function that still raises ``NotImplementedError`` reports "not attempted
yet" rather than failing, so a notebook with untouched exercises still runs green.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
NOT_EVERY_RANK = (
    "a collective that not every rank called? (every rank must make the same collective calls "
    "in the same order)"
)
# Two world sizes: an answer that divides by a constant 2 instead of N is right at N = 2 only.
AVERAGE_WORLD_SIZES = (2, 4)


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


@dataclass(frozen=True)
class NotAttempted:
    """A rank's answer while the learner's code still raises ``NotImplementedError``: nothing to
    judge, so the checker says "not attempted yet" instead of failing the notebook."""


def _not_attempted(exercise: str) -> CheckResult:
    return CheckResult(
        exercise, NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code, then re-run."
    )


def _pool_for(cluster: Any, world_size: int) -> Any:
    """The warm pool of ``world_size`` ranks among ``cluster`` (one Cluster or several), or None
    (then the checker launches its own ranks for that world size)."""
    pools = cluster if isinstance(cluster, Sequence) else [cluster]
    return next((c for c in pools if c is not None and c.world_size == world_size), None)


def _avg_hint(last_line: str) -> str:
    """What to say when ``ReduceOp.AVG`` is refused: it is the backend, not the learner's idea."""
    if "AVG" not in last_line:
        return ""
    return (
        " — this torch's backend has no ReduceOp.AVG (gloo gained it in "
        "torch 2.7, as a SUM followed by a division; NCCL has it natively, ncclAvg, since NCCL "
        "2.10). Your idea is right: here, all-reduce with the default SUM and divide by "
        "dist.get_world_size()."
    )


def _run_on_ranks(
    exercise: str,
    rank_fn: Callable,
    learner_fn: Any,
    cluster: Any,
    world_size: int,
    *args: Any,
    backend: str = "auto",
) -> list[Any] | CheckResult:
    """The ranks' results, or a CheckResult when there is nothing to judge or the run failed.

    ``backend``: of the ranks launched when no pool of ``world_size`` is given."""
    if learner_fn is None:
        return _not_attempted(exercise)
    if not callable(learner_fn):
        return CheckResult(exercise, FAILED, f"expected a function, got {learner_fn!r}")
    pool = _pool_for(cluster, world_size)
    try:
        if pool is not None:
            # The checker's own time bounds the learner's code, not the pool's (300 s).
            timeout_s = min(pool.timeout_s, CHECK_TIMEOUT_S)
            results = pool.run_within(timeout_s, rank_fn, learner_fn, *args)
        else:
            results = dplab.launch(
                rank_fn,
                world_size,
                backend=backend,
                args=(learner_fn, *args),
                timeout_s=CHECK_TIMEOUT_S,
            )
    except dplab.RankError as e:
        _revive(pool)
        return CheckResult(exercise, FAILED, _rank_error_verdict(e, world_size))
    except dplab.RankTimeout as e:
        _revive(pool)
        return CheckResult(exercise, FAILED, _timeout_verdict(e))
    except TypeError as e:  # the function could not be shipped to the ranks
        return CheckResult(exercise, FAILED, str(e))
    if any(isinstance(r, NotAttempted) for r in results):
        return _not_attempted(exercise)
    return results


def probe_reduce_avg() -> dict[str, Any]:
    """Rank function: does this backend take ``ReduceOp.AVG``, and is it SUM then ÷N, bit for bit?

    The answer depends on the backend and the torch version (gloo: since torch 2.7, implemented
    as a sum followed by a division; NCCL: natively), so the notebook asks the ranks it has.
    """
    rank, n = rank_and_world()
    x = torch.arange(7, dtype=torch.float64) / 3 + rank
    avg, summed = x.clone(), x.clone()
    try:
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    except RuntimeError as e:
        error = str(e).strip().splitlines()[0]
        return {"backend": dist.get_backend(), "supported": False, "error": error}
    dist.all_reduce(summed)
    return {
        "backend": dist.get_backend(),
        "supported": True,
        "error": None,
        "equals_sum_over_n": bool(torch.equal(avg, summed / n)),
        "max_diff": max_abs_diff(avg, summed / n),
    }


def _revive(cluster: Any) -> None:
    """A rank that failed mid-collective takes the pool down; bring it back for later cells."""
    if cluster is not None and not cluster.alive:
        cluster.restart()


def _rank_error_verdict(e: dplab.RankError, world_size: int) -> str:
    """What a RankError says about the learner's function, in one line."""
    first = (e.traceback.strip().splitlines() or [str(e)])[0]
    if "different collectives" in first:  # the launcher caught the ranks out of step
        return f"{first} — {NOT_EVERY_RANK}"
    if e.summary.startswith("the rank process"):  # it died: what it printed is not the cause
        return f"rank {e.rank}'s process ended inside your function (N = {world_size}): {e.summary}"
    return (
        f"your function raised on rank {e.rank} (N = {world_size}): {e.summary}"
        f"{_avg_hint(e.summary)}"
    )


def _timeout_verdict(e: dplab.RankTimeout) -> str:
    """A rank waiting in a collective is a partner that never came; ranks all busy in their own
    code are an endless loop, and the collective hint would send the learner the wrong way."""
    if e.in_collective:
        return f"{e} — {NOT_EVERY_RANK}"
    return (
        f"{e} — your function was still running its own code (not waiting in a collective) "
        f"after {e.timeout_s:g} s: an endless loop, or far too much work?"
    )


# ---------------------------------------------------------------------------------------------
# Exercise 2 of the notebook: broadcast the model state (what DDP does at construction)


class BufferedMLP(nn.Module):
    """A small MLP with a BatchNorm: its running statistics are *buffers*, state that is not a
    parameter but that a replica must share too (an answer that skips buffers fails here)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def buffered_model(seed: int) -> BufferedMLP:
    """The model, with buffers that differ per ``seed``: ``seed % 7 + 1`` forwards on its data."""
    model = BufferedMLP(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(seed % 7 + 1):
            model(torch.randn(16, 8, generator=g) * (1 + seed % 3))
    return model


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _broadcast_rank(fn: Callable) -> dict[str, Any] | NotAttempted:
    rank, _ = rank_and_world()
    model = buffered_model(100 + rank)  # every rank starts different, buffers too, on purpose
    rank0 = buffered_model(100)
    before = _state(model)
    try:
        with CommCounter() as counter:
            fn(model)
    except NotImplementedError:
        return NotAttempted()
    return {
        "rank": rank,
        "params": params_hash(model),
        "buffers": tensor_hash(*model.buffers()),
        "rank0_params": params_hash(rank0),
        "rank0_buffers": tensor_hash(*rank0.buffers()),
        "buffer_names": [name for name, _ in model.named_buffers()],
        "same_tensors": all(a is b for a, b in zip(before, _state(model), strict=True)),
        "bytes": counter.nbytes(),
        "state_bytes": sum(t.numel() * t.element_size() for t in _state(model)),
    }


def _judged_run(
    exercise: str,
    rank_fn: Callable,
    judge: Callable[[str, list[dict[str, Any]]], CheckResult | None],
    learner_fn: Any,
    cluster: Any,
    world_size: int,
    *args: Any,
) -> list[dict[str, Any]] | CheckResult:
    """The ranks' results if ``judge`` finds nothing wrong in them; else what it (or the run)
    says went wrong. For checkers that repeat one run per world size or A."""
    results = _run_on_ranks(exercise, rank_fn, learner_fn, cluster, world_size, *args)
    if isinstance(results, CheckResult):
        return results
    return judge(exercise, results) or results


def check_broadcast_weights(fn: Any, cluster: Any = None, *, world_size: int = 2) -> CheckResult:
    """Ranks start with different parameters *and buffers* (a BatchNorm's running statistics);
    after ``fn(model)`` every rank must hold rank 0's, both."""
    name = "broadcast_weights"
    results = _run_on_ranks(name, _broadcast_rank, fn, cluster, world_size)
    if isinstance(results, CheckResult):
        return results
    r0 = results[0]
    hashes = [r["params"] for r in results]
    details = {"hashes": hashes, "bytes_per_rank": [r["bytes"] for r in results]}
    if not all(r["same_tensors"] for r in results):
        return CheckResult(
            name, FAILED, "change the model's tensors in place; don't replace them", details
        )
    if len(set(hashes)) > 1:
        bad = [r["rank"] for r in results if r["params"] != r0["params"]]
        return CheckResult(
            name, FAILED, f"the replicas still differ: rank(s) {bad} do not match rank 0", details
        )
    if hashes[0] != r0["rank0_params"]:
        return CheckResult(
            name,
            FAILED,
            "the replicas agree, but not on rank 0's initial weights (did you average them?). "
            "DDP copies rank 0's weights to everyone.",
            details,
        )
    if any(r["buffers"] != r0["rank0_buffers"] for r in results):
        return CheckResult(
            name,
            FAILED,
            "the parameters match rank 0's, but the buffers do not ("
            + ", ".join(r0["buffer_names"])
            + "): a replica is its parameters and its buffers; broadcast model.buffers() too "
            "(torch's DDP broadcasts both at construction, and the buffers again before every "
            "forward while forward_sync_buffers is on, its default).",
            details,
        )
    moved = r0["bytes"] / r0["state_bytes"]
    return CheckResult(
        name,
        PASSED,
        f"every rank now holds rank 0's parameters and buffers (hash {hashes[0][:12]}…); "
        f"{moved:g}× the model-state bytes went through collectives on each rank.",
        details,
    )


# ---------------------------------------------------------------------------------------------
# Exercise 1 of the notebook: average the gradients


def _average_rank(fn: Callable) -> dict[str, Any] | NotAttempted:
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
        return NotAttempted()
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


def _constant_divisor(ratio: float, n: int) -> int | None:
    """The whole number c with ``ratio ≈ n / c`` (the answer divided the sum by c), or None."""
    if ratio <= 0:
        return None
    c = n / ratio
    return round(c) if abs(c - round(c)) < 1e-6 and round(c) >= 1 else None


def _judge_average(name: str, results: list[dict[str, Any]]) -> CheckResult | None:
    """The failure at this world size, or None when every rank holds the average."""
    n = results[0]["world_size"]
    worst = max(r["max_diff"] for r in results)
    details = {"world_size": n, "max_diff": worst, "ratios": [r["ratio"] for r in results]}
    if all(r["unchanged"] for r in results):
        return CheckResult(
            name,
            FAILED,
            "the gradients are still each rank's own g_i: nothing reached .grad (did you "
            "all-reduce a copy?)",
            details,
        )
    if worst <= TOLERANCE and len({r["hash"] for r in results}) == 1:
        return None
    ratio = results[0]["ratio"]
    c = _constant_divisor(ratio, n)
    if c == 1:
        msg = (
            f"the gradients are {n}× the global-batch gradient: all_reduce sums; divide by the "
            "world size to average."
        )
    elif c is not None and len({r["hash"] for r in results}) == 1:
        msg = (
            f"at N = {n} the gradients are {ratio:g}× the global-batch gradient: you divided "
            f"the sum by {c}, a constant; divide by dist.get_world_size() (right at N = {c} "
            "only)."
        )
    else:
        msg = f"at N = {n} the gradients differ from the global-batch gradient by up to {worst:.3g}"
    return CheckResult(name, FAILED, msg, details)


def check_average_gradients(
    fn: Any, cluster: Any = None, *, world_sizes: Sequence[int] = AVERAGE_WORLD_SIZES
) -> CheckResult:
    """Each rank backpropagates its shard; after ``fn(model)`` every ``.grad`` must be the
    global-batch gradient (float64, to 1e-12) and identical on every rank, at every world size
    in ``world_sizes`` (``cluster``: a warm pool or several, used where the size matches)."""
    name = "average_gradients"
    worst = 0.0
    for n in world_sizes:
        results = _judged_run(name, _average_rank, _judge_average, fn, cluster, n)
        if isinstance(results, CheckResult):
            return results
        worst = max(worst, *(r["max_diff"] for r in results))
    sizes = " and ".join(f"N = {n}" for n in world_sizes)
    return CheckResult(
        name,
        PASSED,
        f"at {sizes}, every rank's .grad equals the global-batch gradient (max |difference| "
        f"{worst:.1e}), bit-identical across ranks.",
        {"max_diff": worst, "world_sizes": list(world_sizes)},
    )


# ---------------------------------------------------------------------------------------------
# Exercise 3: gradient accumulation with no_sync

# Two values of A, one differing from each N the notebook runs: `loss / 4` is right at A = 4 only,
# `loss / world_size` at A = N only.
ACCUMS = (4, 2)
GLOBAL_BATCH = 32
LR = 0.1


def _accumulation_rank(fn: Callable, accum: int) -> dict[str, Any] | NotAttempted:
    rank, _ = rank_and_world()
    dt = torch.float64
    model = make_model("mlp", seed=0, dtype=dt)
    initial = flat_params(model)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    micro = step_batches(0, global_batch=GLOBAL_BATCH, accum=accum, seed=0, dtype=dt)
    try:
        with CommCounter() as counter:
            fn(ddp, opt, micro)
    except NotImplementedError:
        return NotAttempted()
    # The reference: one SGD step on the gradient of the whole global batch, in this process.
    reference = make_model("mlp", seed=0, dtype=dt)
    x, y = make_batch("mlp", GLOBAL_BATCH, seed=1, dtype=dt)
    expected = initial - LR * gradient(reference, x, y)
    after = flat_params(model)
    moved, wanted = after - initial, expected - initial
    return {
        "rank": rank,
        "accum": accum,
        "max_diff": max_abs_diff(after, expected),
        "moved": bool(moved.abs().max() > 0),
        "step_ratio": (moved @ wanted / (wanted @ wanted)).item(),
        "hash": tensor_hash(after),
        "all_reduce_calls": counter.calls("all_reduce"),
        "n_buckets": len(ddp.buckets),
        "grads_left": max((p.grad.abs().max().item() for p in model.parameters()
                           if p.grad is not None), default=0.0),
    }  # fmt: skip


def _judge_accumulation(name: str, results: list[dict[str, Any]]) -> CheckResult | None:
    """The failure at this A, or None when the step is right."""
    r0 = results[0]
    a = r0["accum"]
    worst = max(r["max_diff"] for r in results)
    calls, buckets = r0["all_reduce_calls"], r0["n_buckets"]
    details = {"accum": a, "max_diff": worst, "all_reduce_calls": calls, "buckets": buckets}
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
        c = _constant_divisor(r0["step_ratio"], a)
        if c == 1:
            msg = (
                f"the step was {a}× too large: the gradients of {a} micro-batch means "
                f"were summed; scale each loss by 1/A (A={a})"
            )
        elif c is not None:
            msg = (
                f"at A = {a} the step was {r0['step_ratio']:g}× one big-batch step: you divided "
                f"each loss by {c}, a constant; divide by A = len(micro_batches) (right at "
                f"A = {c} only)"
            )
        else:
            msg = f"at A = {a} the weights differ from one big-batch step by up to {worst:.3g}"
        return CheckResult(name, FAILED, msg, details)
    if calls != buckets:
        return CheckResult(
            name,
            FAILED,
            f"right weights, but {calls} all-reduces for {buckets} bucket(s): without no_sync() "
            f"every micro-batch all-reduces ({a}× the traffic)",
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
    return None


def check_accumulation_step(
    fn: Any, cluster: Any = None, *, world_size: int = 2, accums: Sequence[int] = ACCUMS
) -> CheckResult:
    """``fn(ddp, optimizer, micro_batches)`` with A micro-batches per rank, for each A in
    ``accums``, must leave the weights of one SGD step on the global batch, with one all-reduce
    per bucket, and zeroed gradients."""
    name = "accumulation_step"
    worst, calls = 0.0, []
    for a in accums:
        results = _judged_run(
            name, _accumulation_rank, _judge_accumulation, fn, cluster, world_size, a
        )
        if isinstance(results, CheckResult):
            return results
        worst = max(worst, *(r["max_diff"] for r in results))
        calls.append((a, results[0]["all_reduce_calls"], results[0]["n_buckets"]))
    per_a = "; ".join(f"A = {a}: {c} all-reduce(s) for {b} bucket(s)" for a, c, b in calls)
    return CheckResult(
        name,
        PASSED,
        f"one big-batch step each time (max |difference| {worst:.1e}); {per_a}.",
        {"max_diff": worst, "calls": calls},
    )
