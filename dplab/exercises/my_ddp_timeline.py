"""The learner's DDP on the same timeline as ``dplab.DDP``: steps observed, drawn as StepTraces.

:func:`trace_rank` (run it on every rank, e.g. ``cluster.run(trace_rank, MyDDP, ...)``) trains a
model a few steps with the learner's class under a :class:`~dplab.exercises.my_ddp_observe.Watch`
and turns what the Watch saw into :class:`dplab.StepTrace` objects, the very kind that
``dplab.Tracer`` records for ``dplab.DDP``. It then runs ``dplab.DDP`` with a ``dplab.Tracer``
on the same model and data, so both draw side by side with
``dplab.viz.timeline.timeline_figure``.

How the learner's spans are read (host clock, ms from the step's start):

- ``forward``: the call ``ddp(x, y)``; ``backward``: from ``loss.backward()`` to the last
  gradient computed (as the Tracer does);
- ``allreduce``: each collective from the moment one of gloo's worker threads could take it (its
  launch, unless both were busy with earlier ones) to its completion (a callback on its future,
  run by gloo's thread the moment it is done); ``bucket_ready``: when the last gradient it
  carried was computed (known for a per-parameter all-reduce; for a flat buffer, from the
  bucket of the same size that the cap implies);
- ``wait``: from ``loss.backward()`` returning to ``finish_gradient_synchronization()``
  returning: the time the step pays after backward; ``optimizer``: ``optimizer.step()``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dplab
from dplab._units import MIB
from dplab.exercises.my_ddp_buckets import expected_buckets
from dplab.exercises.my_ddp_models import Stack
from dplab.exercises.my_ddp_observe import StepRecord, Watch
from dplab.trace import Span, StepTrace


def _model_and_batches(
    model: str | Callable[[], nn.Module], steps: int, batch_size: int, rank: int
) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    if isinstance(model, str):
        from dplab.models import make_batch, make_model

        net = make_model(model)
        data = [make_batch(model, batch_size, seed=100 * s + rank) for s in range(steps)]
        return net, data
    net = model()
    return net, [net.batch(batch_size, seed=100 * s + rank) for s in range(steps)]


def _origin_ns() -> int:
    """One time base for all ranks of this host: rank 0's clock as it leaves a barrier."""
    dist.barrier()
    mine = time.perf_counter_ns()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone[0]


def _comm_lanes() -> int:
    """Gloo runs collectives on a pool of worker threads (2 unless configured otherwise)."""
    try:
        return int(dist.group.WORLD._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError):
        return 2


def _queued_starts(launches: list[int], ends: list[int], *, lanes: int) -> list[int]:
    """When each collective got a worker: its launch, or later if every worker was busy with
    earlier ones (that queueing is not the collective's own time, as in dplab.Tracer)."""
    free = [0] * max(1, lanes)
    starts = []
    for launch, end in zip(launches, ends, strict=True):
        lane = free.index(min(free))
        starts.append(min(max(launch, free[lane]), end))
        free[lane] = end
    return starts


def step_trace(
    rec: StepRecord,
    *,
    module: nn.Module,
    cap_bytes: float | None,
    origin_ns: int,
    step: int,
    meta: dict[str, Any],
) -> StepTrace:
    """One observed step of the learner's class as a StepTrace."""
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    nbytes = {n: p.numel() * p.element_size() for n, p in module.named_parameters()}
    t0 = rec.marks["start"][1]

    def ms(t: int) -> float:
        return (t - t0) / 1e6

    grad_t = {names[i]: t for i, _, t in rec.grads}
    finish = rec.marks["finish_end"][1]
    last_grad = max(grad_t.values(), default=rec.marks["backward_end"][1])
    spans = [
        Span("forward", "forward", 0.0, ms(rec.marks["backward_start"][1])),
        Span("backward", "backward", ms(rec.marks["backward_start"][1]), ms(last_grad)),
        Span("wait", "wait", ms(rec.marks["backward_end"][1]), ms(finish)),
        Span("optimizer", "optimizer", ms(finish), ms(rec.marks["step_end"][1])),
    ]
    plan = expected_buckets(module, cap_bytes if cap_bytes is not None else float("inf"))
    unmatched = list(plan)
    buckets = []
    ends = [c.done_ns[0] if c.done_ns[0] is not None else finish for c in rec.collectives]
    starts = _queued_starts([c.t_ns for c in rec.collectives], ends, lanes=_comm_lanes())
    for k, (c, start, done) in enumerate(zip(rec.collectives, starts, ends, strict=True)):
        if c.grad_of is not None:
            carried = [names[c.grad_of]]
        else:
            carried = next((b for b in unmatched if sum(nbytes[n] for n in b) == c.nbytes), [])
            if carried:
                unmatched.remove(carried)
        ready = max((grad_t[n] for n in carried if n in grad_t), default=c.t_ns)
        spans.append(Span(f"bucket {k} ready", "bucket_ready", ms(ready), ms(ready), k, c.nbytes))
        spans.append(Span(f"all-reduce bucket {k}", "allreduce", ms(start), ms(done), k, c.nbytes))
        buckets.append({"index": k, "param_names": carried, "nbytes": c.nbytes})
    return StepTrace(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
        device="cpu",
        clock="host",
        step=step,
        spans=sorted(spans, key=lambda s: (s.start_ms, s.end_ms)),
        buckets=buckets,
        origin_ms=(t0 - origin_ns) / 1e6,
        meta=meta,
    )


def run_learner(
    cls: type,
    model: str | Callable[[], nn.Module],
    *,
    bucket_size_mb: float | None = None,
    steps: int = 3,
    batch_size: int = 4,
    lr: float = 0.01,
) -> list[StepTrace]:
    """On a rank: ``steps`` training steps with the learner's class, observed, as StepTraces."""
    rank = dist.get_rank()
    net, data = _model_and_batches(model, steps, batch_size, rank)
    origin = _origin_ns()
    watch = Watch(net).install()
    try:
        ddp = cls(net) if bucket_size_mb is None else cls(net, bucket_size_mb=bucket_size_mb)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            watch.start_step()
            loss = ddp(x, y)
            watch.mark("backward_start")
            loss.backward()
            watch.mark("backward_end")
            ddp.finish_gradient_synchronization()
            watch.mark("finish_end")
            opt.step()
            watch.mark("step_end")
    finally:
        watch.uninstall()
    watch.settle()
    cap = None if bucket_size_mb is None else bucket_size_mb * MIB
    label = model if isinstance(model, str) else type(net).__name__
    meta = {"variant": f"your {cls.__name__}", "model": label, "bucket_size_mb": bucket_size_mb}
    return [
        step_trace(rec, module=net, cap_bytes=cap, origin_ns=origin, step=s, meta=dict(meta))
        for s, rec in enumerate(watch.steps)
    ]


def run_reference(
    model: str | Callable[[], nn.Module],
    *,
    bucket_size_mb: float | None = None,
    steps: int = 3,
    batch_size: int = 4,
    lr: float = 0.01,
) -> list[StepTrace]:
    """On a rank: the same steps with ``dplab.DDP`` (one cap for every bucket), traced."""
    net, data = _model_and_batches(model, steps, batch_size, dist.get_rank())
    cap = 25.0 if bucket_size_mb is None else bucket_size_mb
    tracer = dplab.Tracer()
    ddp = dplab.DDP(net, bucket_cap_mb=cap, first_bucket_cap_mb=cap, tracer=tracer)
    opt = tracer.watch(torch.optim.SGD(net.parameters(), lr=lr))
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        ddp(x, y).backward()
        opt.step()
    return tracer.steps


def trace_rank(
    cls: type,
    model: str | Callable[[], nn.Module] = "tiny-gpt",
    *,
    bucket_size_mb: float | None = None,
    steps: int = 3,
    batch_size: int = 4,
) -> dict[str, list[StepTrace]]:
    """Run on every rank: the learner's steps and dplab.DDP's, each a list of StepTraces."""
    kwargs = {"bucket_size_mb": bucket_size_mb, "steps": steps, "batch_size": batch_size}
    return {
        "yours": run_learner(cls, model, **kwargs),
        "dplab.DDP": run_reference(model, **kwargs),
    }


def sweep_rank(
    cls: type,
    caps_mb: list[float],
    *,
    layers: int = 16,
    width: int = 256,
    rounds: int = 3,
    steps: int = 3,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Run on every rank: the learner's bucketed class at each cap, interleaved over ``rounds``.

    Returns per cap the wait after backward (ms, every step of every round but each round's
    first) and the buckets' count, plus the backward time of a step without communication
    (the compute rate the derivation calls c).
    """

    def stack() -> nn.Module:
        return Stack(layers, width)

    waits: dict[float, list[float]] = {cap: [] for cap in caps_mb}
    collectives: dict[float, int] = {}
    for r in range(rounds):
        for cap in caps_mb if r % 2 == 0 else caps_mb[::-1]:
            traces = run_learner(cls, stack, bucket_size_mb=cap, steps=steps, batch_size=batch_size)
            waits[cap] += [t.of("wait")[0].duration_ms for t in traces[1:]]
            collectives[cap] = len(traces[-1].of("allreduce"))
    quiet = []
    net = stack()
    for s in range(steps + 1):
        x, y = net.batch(batch_size, seed=s)
        loss = net(x, y)
        t = time.perf_counter_ns()
        loss.backward()
        quiet.append((time.perf_counter_ns() - t) / 1e6)
    return {
        "wait_ms": {cap: statistics.median(v) for cap, v in waits.items()},
        "collectives": collectives,
        "backward_ms": statistics.median(quiet[1:]),
        "grad_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
    }
