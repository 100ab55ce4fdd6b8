"""``check_my_ddp``: the learner's own DDP class, run on real ranks, judged by what it did.

CS336's contract: ``MyDDP(module, bucket_size_mb=None)``, ``forward(*args, **kwargs)``, and
``finish_gradient_synchronization()`` called after ``loss.backward()``, before
``optimizer.step()``. On every rank the checker trains three tiny float64 models (one with a
tied weight, one with a frozen layer; see :mod:`dplab.exercises.my_ddp_models`) for a few SGD
steps twice: once wrapped in torch's own ``DistributedDataParallel`` (the oracle), once in the
learner's class, on the same per-rank data. It then checks, in this order:

1. what was all-reduced: gradients, not weights; every asynchronous all-reduce waited for
   before ``finish_gradient_synchronization()`` returned; for "overlapped" and "bucketed",
   backward never blocked in a collective while gradients were still to be computed;
2. for "overlapped", each gradient all-reduced once; for "bucketed", one collective per bucket,
   buckets cut in reverse registration order, greedily, at most ``bucket_size_mb`` MiB each
   (a tensor never split, the frozen layer never sent), and none launched before all of its
   gradients were in;
3. the numbers: every step's gradients, and the weights after training, equal torch DDP's to
   ``TOLERANCE`` (float64: only the order of the sums may differ);
4. for "overlapped" and "bucketed", overlap: in every step that has at least two collectives
   to make, one was launched while backward was still computing gradients.

Nothing is asked of the learner's code: :class:`~dplab.exercises.my_ddp_observe.Watch` wraps
``torch.distributed`` on the rank and hooks the parameters before the learner's class is built.
Each mistake learners typically make has its own named message.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab._checks import check_choice, check_gloo_cluster
from dplab._units import MIB
from dplab.exercises.checks import (
    FAILED,
    NOT_ATTEMPTED,
    PASSED,
    CheckResult,
    NotAttempted,
    _run_on_ranks,
)
from dplab.exercises.my_ddp_buckets import close_at_cap_plan, expected_buckets, greedy_plan
from dplab.exercises.my_ddp_models import MODELS, batch, build
from dplab.exercises.my_ddp_observe import StepRecord, Watch

KINDS = ("naive", "overlapped", "bucketed")
CAPS_BYTES = (500, 1800)  # two bucket sizes; bucket_size_mb = bytes / MiB
STEPS = 3
LR = 0.1
TOLERANCE = 1e-10  # max |difference| from torch DDP, float64 gradients and weights


# ---------------------------------------------------------------------------------------------
# On each rank


def _flat(tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> torch.Tensor:
    parts = [torch.zeros_like(p) if t is None else t for t, p in zip(tensors, like, strict=True)]
    return torch.cat([t.reshape(-1) for t in parts]) if parts else torch.zeros(0)


def _oracle(name: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """torch's DistributedDataParallel on the same data: each step's gradients, final weights."""
    model = build(name)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ddp(*batch(name, step, dist.get_rank())).backward()
        grads.append(_flat([p.grad for p in trainable], trainable).clone())
        opt.step()
    return grads, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _learner(cls: type, name: str, cap_bytes: int | None) -> dict[str, Any]:
    model = build(name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    watch = Watch(model).install()  # before the learner's class: our hooks run first
    grads = []
    try:
        ddp = cls(model) if cap_bytes is None else cls(model, bucket_size_mb=cap_bytes / MIB)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            watch.start_step()
            loss = ddp(*batch(name, step, dist.get_rank()))
            watch.mark("backward_start")
            loss.backward()
            watch.mark("backward_end")
            ddp.finish_gradient_synchronization()
            watch.mark("finish_end")
            grads.append(_flat([p.grad for p in trainable], trainable).clone())
            opt.step()
            watch.mark("step_end")
    finally:
        watch.uninstall()
    watch.settle()
    return {
        "grads": grads,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "steps": watch.steps,
    }


def _describe_model(name: str) -> dict[str, Any]:
    model = build(name)
    named = list(model.named_parameters())
    return {
        "names": [n for n, p in named if p.requires_grad],
        "frozen": [n for n, p in named if not p.requires_grad],
        "nbytes": {n: p.numel() * p.element_size() for n, p in named},
        "numel": {n: p.numel() for n, p in named},
    }


def _rank(cls: type, kind: str) -> list[dict[str, Any]] | NotAttempted:
    out = []
    caps: tuple[int | None, ...] = CAPS_BYTES if kind == "bucketed" else (None,)
    for name in MODELS:
        ref_grads, ref_params = _oracle(name)
        for cap in caps:
            try:
                mine = _learner(cls, name, cap)
            except NotImplementedError:
                return NotAttempted()
            gdiff = [
                (g - r).abs().max().item() for g, r in zip(mine["grads"], ref_grads, strict=True)
            ]
            ratio = [
                (g @ r / (r @ r)).item() for g, r in zip(mine["grads"], ref_grads, strict=True)
            ]
            out.append(
                {
                    "model": name,
                    "cap_bytes": cap,
                    "rank": dist.get_rank(),
                    "world_size": dist.get_world_size(),
                    "grad_diff": gdiff,
                    "grad_ratio": ratio,
                    "param_diff": (mine["params"] - ref_params).abs().max().item(),
                    "params_bits": mine["params"].numpy().tobytes(),
                    "steps": mine["steps"],
                    "info": _describe_model(name),
                }
            )
    return out


# ---------------------------------------------------------------------------------------------
# Judging what the ranks did


class Verdict(Exception):
    """A failed check, with the message for the learner."""


def _where(run: dict[str, Any], step: int | None = None) -> str:
    cap = run["cap_bytes"]
    parts = [f"model {run['model']!r}"]
    if cap is not None:
        parts.append(f"bucket_size_mb={cap}/2**20 ({cap} bytes)")
    if step is not None:
        parts.append(f"step {step}")
    parts.append(f"N={run['world_size']}")
    return ", ".join(parts)


def _check_what_was_sent(kind: str, run: dict[str, Any], step: int, rec: StepRecord) -> None:
    names = run["info"]["names"]
    where = _where(run, step)
    for c in rec.collectives:
        if c.param_of is not None:
            raise Verdict(
                f"all-reduce of parameters instead of gradients: an all-reduce carried the "
                f"weights of {names[c.param_of]!r} ({where}). DDP all-reduces p.grad; the "
                "weights stay put and change only in optimizer.step()."
            )
    if not rec.collectives:
        raise Verdict(
            f"no all-reduce seen ({where}): call torch.distributed.all_reduce on the gradients "
            "(in a hook, or in finish_gradient_synchronization())."
        )
    finish = rec.marks["finish_end"][0]
    if kind != "naive":
        grad_seqs = [seq for _, seq, _ in rec.grads]
        for b in rec.blocking:
            later = sum(1 for s in grad_seqs if s > b.seq)
            if b.in_backward and later:
                raise Verdict(
                    f"blocking all-reduce in the hook: {b.what} ran inside backward with {later} "
                    f"gradient(s) still to compute, so backward stalled until the collective was "
                    f"done ({where}). Launch with async_op=True, keep the handle, and wait for "
                    "it in finish_gradient_synchronization()."
                )
    unwaited = [c for c in rec.collectives if c.async_op and (c.waited_seq is None or
                                                              c.waited_seq > finish)]  # fmt: skip
    if unwaited:
        raise Verdict(
            f"no wait before the step: {len(unwaited)} of {len(rec.collectives)} all-reduce(s) "
            f"launched with async_op=True were not waited for when "
            f"finish_gradient_synchronization() returned ({where}), so optimizer.step() may read "
            "gradients the all-reduce is still writing. Call handle.wait() on each (the checker "
            "watches Work.wait)."
        )


def _check_per_parameter(run: dict[str, Any], step: int, rec: StepRecord) -> None:
    """One all-reduce per trainable gradient tensor: each of its size, none twice."""
    info = run["info"]
    names = info["names"]
    where = _where(run, step)
    counts = Counter(c.grad_of for c in rec.collectives if c.grad_of is not None)
    for i, k in counts.items():
        if k > 1:
            raise Verdict(
                f"the gradient of {names[i]!r} was all-reduced {k} times in one step ({where}); "
                "every trainable parameter's gradient needs exactly one (a hook registered "
                "more than once?)."
            )
    got = sorted(c.nbytes for c in rec.collectives)
    want = sorted(info["nbytes"][n] for n in names)
    if got != want:
        raise Verdict(
            f"{len(got)} all-reduce(s) of {got} bytes for {len(want)} gradient tensors of "
            f"{want} bytes ({where}): in this step every trainable gradient gets one all-reduce "
            "of its own, and a frozen parameter none."
        )


def _sizes(plan: list[list[int]], nbytes: list[int]) -> list[int]:
    return sorted(sum(nbytes[i] for i in members) for members in plan)


def _check_buckets(run: dict[str, Any], step: int, rec: StepRecord) -> None:
    info, cap = run["info"], run["cap_bytes"]
    where = _where(run, step)
    names = info["names"]
    rev = names[::-1]
    rev_bytes = [info["nbytes"][n] for n in rev]
    plan = greedy_plan(rev_bytes, cap)
    want = _sizes(plan, rev_bytes)
    got = sorted(c.nbytes for c in rec.collectives)
    if got != want:
        fwd_bytes = [info["nbytes"][n] for n in names]
        all_bytes = [info["nbytes"][n] for n in info["nbytes"]][::-1]  # frozen ones too
        hints = [
            (
                len(got) == len(names) > len(plan)
                and all(c.grad_of is not None for c in rec.collectives),
                "one collective per parameter when buckets were asked for: "
                f"{len(got)} all-reduces, one per gradient tensor, where the cap makes "
                f"{len(plan)} bucket(s). Pack the gradients of a bucket into one flat buffer "
                "and all-reduce that once.",
            ),
            (
                got == _sizes(greedy_plan(fwd_bytes, cap), fwd_bytes),
                "forward-order buckets: your buckets are cut from the first layer on. Backward "
                "produces the last layer's gradients first, so cut them from "
                "reversed(list(module.parameters())): then bucket 0 fills first and can leave "
                "while backward goes on.",
            ),
            (
                got == _sizes(greedy_plan(all_bytes, cap), all_bytes) and bool(info["frozen"]),
                "a collective for parameters without gradients: your buckets include the frozen "
                f"parameter(s) {info['frozen']} (requires_grad=False, no .grad). Leave them out: "
                "there is nothing to average.",
            ),
            (
                got == _sizes(close_at_cap_plan(rev_bytes, cap), rev_bytes),
                "your buckets close once they reach the cap (torch's own rule, which lets a "
                "bucket exceed it by one tensor); this exercise wants at most bucket_size_mb "
                "per bucket: start a new bucket when the next tensor would not fit.",
            ),
        ]
        for matches, hint in hints:
            if matches:
                raise Verdict(f"{hint} ({where})")
        raise Verdict(
            f"{len(got)} all-reduce(s) for {len(plan)} bucket(s) ({where}): the cap implies "
            f"buckets of {want} bytes (reverse registration order, greedy, a tensor never split), "
            f"yours carried {got} bytes."
        )
    # Which bucket each collective carried: the first not yet matched one of its size.
    open_buckets = [list(members) for members in plan]
    for c in rec.collectives:
        for k, members in enumerate(open_buckets):
            if sum(rev_bytes[i] for i in members) == c.nbytes:
                missing = [rev[i] for i in members if names.index(rev[i]) not in c.ready]
                if missing:
                    raise Verdict(
                        f"launching before a bucket is full: the all-reduce of the bucket "
                        f"{[rev[i] for i in members]} left before the gradient(s) of {missing} "
                        f"had been computed ({where}). Count the gradients in, and launch when "
                        "the bucket's last one arrives."
                    )
                open_buckets.pop(k)
                break


def _check_numbers(runs: list[dict[str, Any]]) -> float:
    """Every rank's gradients and weights against torch DDP's; returns the worst difference."""
    worst = 0.0
    for run in runs:
        n = run["world_size"]
        for step, (diff, ratio) in enumerate(zip(run["grad_diff"], run["grad_ratio"], strict=True)):
            if diff <= TOLERANCE:
                continue
            where = _where(run, step) + f", rank {run['rank']}"
            if math.isclose(ratio, n, rel_tol=1e-6):
                raise Verdict(
                    f"sum instead of average: the gradients are {n}× torch DDP's ({where}). "
                    "all_reduce sums over the ranks; divide by the world size."
                )
            if math.isclose(ratio, 1.0 / n, rel_tol=1e-6):
                raise Verdict(
                    f"the gradients are 1/{n} of torch DDP's ({where}): divided by the world "
                    "size twice?"
                )
            raise Verdict(
                f"the gradients differ from torch DDP's by up to {diff:.3g} ({where}; "
                f"allowed {TOLERANCE:g}). Is every gradient in the all-reduce, and copied back?"
            )
        worst = max(worst, max(run["grad_diff"], default=0.0))
        if run["param_diff"] > TOLERANCE:
            raise Verdict(
                f"after {STEPS} steps the weights differ from torch DDP's by "
                f"{run['param_diff']:.3g} ({_where(run)}, rank {run['rank']})."
            )
        worst = max(worst, run["param_diff"])
    return worst


def _overlapped_launches(run: dict[str, Any], step: int, rec: StepRecord) -> int:
    """Collectives launched while gradients were still to come; 0 fails where 2+ were due."""
    last_grad = max((seq for _, seq, _ in rec.grads), default=-1)
    early = sum(1 for c in rec.collectives if c.seq < last_grad)
    if early == 0 and len(rec.collectives) >= 2:
        raise Verdict(
            f"no overlap: all {len(rec.collectives)} all-reduces were launched after backward had "
            f"computed its last gradient ({_where(run, step)}), so none of the communication "
            "hides under backward. Launch each one from a post-accumulate-grad hook, the moment "
            "its gradient (or its bucket) is ready."
        )
    return early


def judge(kind: str, per_rank: list[list[dict[str, Any]]]) -> CheckResult:
    """The verdict on every rank's runs (the ranks' results of one check)."""
    exercise = f"my DDP ({kind})"
    rank0 = per_rank[0]
    launches = early = 0
    try:
        for run in rank0:
            for step, rec in enumerate(run["steps"]):
                _check_what_was_sent(kind, run, step, rec)
                if kind == "overlapped":
                    _check_per_parameter(run, step, rec)
                if kind == "bucketed":
                    _check_buckets(run, step, rec)
        worst = _check_numbers([run for runs in per_rank for run in runs])
        for i, run in enumerate(rank0):
            bits = {runs[i]["params_bits"] for runs in per_rank}
            if len(bits) > 1:
                raise Verdict(f"the replicas ended with different weights ({_where(run)}).")
        for run in rank0:
            for step, rec in enumerate(run["steps"]):
                launches += len(rec.collectives)
                if kind != "naive":
                    early += _overlapped_launches(run, step, rec)
    except Verdict as v:
        return CheckResult(exercise, FAILED, str(v), {"runs": per_rank})
    n = rank0[0]["world_size"]
    what = f"{len(MODELS)} models" + (f" × {len(CAPS_BYTES)} caps" if kind == "bucketed" else "")
    message = (
        f"on {n} ranks, {what} × {STEPS} steps: gradients and weights equal torch DDP's "
        f"(max |difference| {worst:.1e} ≤ {TOLERANCE:g}, float64)"
    )
    if kind != "naive":
        message += (
            f"; {early} of {launches} all-reduces left while backward was still computing, "
            "and backward never waited on one"
        )
    if kind == "bucketed":
        message += "; one all-reduce per bucket, each launched once its last gradient was in"
    return CheckResult(exercise, PASSED, message + ".", {"runs": per_rank})


def check_my_ddp(cls: Any, *, kind: str, cluster: Any = None, world_size: int = 2) -> CheckResult:
    """Run the learner's DDP class ``cls`` on real ranks and say what it got right or wrong.

    ``kind``: "naive", "overlapped" or "bucketed" (which step of the lesson it answers).
    ``cluster``: a warm gloo :class:`dplab.Cluster` to run on (else ``world_size`` fresh gloo
    ranks).
    """
    check_choice("kind", kind, KINDS)
    check_gloo_cluster("check_my_ddp", cluster)
    exercise = f"my DDP ({kind})"
    if cls is None:
        return CheckResult(exercise, NOT_ATTEMPTED, "write the class, then re-run.")
    if not isinstance(cls, type):
        return CheckResult(exercise, FAILED, f"expected a class (MyDDP), got {cls!r}")
    for method in ("forward", "finish_gradient_synchronization"):
        if not callable(getattr(cls, method, None)):
            return CheckResult(exercise, FAILED, f"{cls.__name__} has no method {method}()")
    # The class is callable, so the shared runner ships it like a learner's function; a warm
    # pool runs at its own world size.
    n = cluster.world_size if cluster is not None else world_size
    results = _run_on_ranks(exercise, _rank, cls, cluster, n, kind, backend="gloo")
    if isinstance(results, CheckResult):
        return results
    return judge(kind, results)


# The bucket rules and the result strings live in my_ddp_buckets and checks; the lesson and the
# tests import them from here, next to the checker that uses them.
__all__ = [
    "FAILED",
    "KINDS",
    "MIB",
    "NOT_ATTEMPTED",
    "PASSED",
    "check_my_ddp",
    "close_at_cap_plan",
    "expected_buckets",
    "greedy_plan",
    "judge",
]
