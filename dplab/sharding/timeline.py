"""The sharded step on the course's timeline, from what ``torch.profiler`` saw on each rank.

:func:`traced_sharded_step` runs on every rank: the same model, wrapped the same way as
:func:`~dplab.sharding.ranks.sharded_step` (DDP, ZeRO-1, FSDP2 twice), a warm-up step, then
``steps`` steps under ``torch.profiler`` with the phases marked (``dplab::forward``,
``dplab::backward``, ``dplab::optimizer``, one ``dplab::step#k`` around each step).
:func:`steps_from_events` turns the profiler's events into :class:`~dplab.trace.StepTrace`\\ s,
so the step draws with :func:`dplab.viz.timeline_figure` and its exposed communication comes from
the same :func:`~dplab.trace.metrics.step_metrics` as DDP's:

- **collectives**: each ``gloo:*`` range on a gloo worker thread, from when a worker started it.
  Its kind is the launch it belongs to on the training thread (``c10d::_allgather_base_`` is an
  all-gather, ``c10d::_reduce_scatter_base_`` a reduce-scatter, ...): gloo runs a reduce-scatter
  as an all-reduce (``gloo:all_reduce``), so the backend's name alone would call it one. The
  launches and the worker ranges of one backend op are matched in order. A worker's range can
  end after the training thread has its result (on a busy machine the worker is descheduled
  before it closes the range); such a tail counts as hidden where forward or backward compute
  follows it and as exposed under the optimizer, and the time the rank paid shows as the wait
  before it;
- **compute**: the training thread's ``aten::`` ops inside each phase, merged where less than
  ``GAP_MS`` apart (the interpreter between two ops); FSDP2's own copies into and out of the
  all-gather buffers (``fsdp::`` ops) are compute too. On gloo FSDP2 blocks the training thread
  while an all-gather it needs is in flight: no op runs then, so that time is not compute. It is
  drawn as ``wait``, and a collective in flight then is exposed. (FSDP2's hooks between ops,
  when longer than ``GAP_MS``, are drawn as waits as well: no op is running.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dplab.memory.ranks import sub_group
from dplab.sharding.ranks import OPTIMIZERS, PHASES, _check_args, _wrap, rank_batch, sharded_model
from dplab.trace.kineto import documents, element_bytes, events_of, numel
from dplab.trace.metrics import union
from dplab.trace.step import Span, StepTrace

STEP_MARK = "dplab::step#"
PHASE_MARK = "dplab::"
GAP_MS = 0.2  # shorter gaps between the training thread's ops are the interpreter, not a wait
BACKEND_OPS = {  # the backend's range on a worker thread → the launches that run as it
    "gloo:all_gather": ("c10d::_allgather_base_", "c10d::allgather_"),
    "gloo:all_reduce": ("c10d::allreduce_", "c10d::_reduce_scatter_base_"),
    "gloo:broadcast": ("c10d::broadcast_",),
    "gloo:reduce_scatter": ("c10d::reduce_scatter_",),
}
KIND_OF_LAUNCH = {
    "c10d::_allgather_base_": "allgather",
    "c10d::allgather_": "allgather",
    "c10d::allreduce_": "allreduce",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::broadcast_": "broadcast",
}
LABELS = {"allgather": "AG", "reduce_scatter": "RS", "allreduce": "AR", "broadcast": "BC"}


@dataclass(frozen=True)
class ProfiledEvent:
    """One profiler range: what ran, on which thread, from when to when (µs), and the bytes of
    its largest argument (from ``record_shapes=True``: a launch's full tensor)."""

    name: str
    thread: Any
    start_us: float
    end_us: float
    nbytes: int | None = None


def _merged(intervals: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in union(intervals):
        if out and a - out[-1][1] < gap:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _collectives(
    events: Sequence[ProfiledEvent], main: int, start_us: float, end_us: float
) -> list[tuple[str, ProfiledEvent, int | None]]:
    """(kind, worker range, bytes) for every backend range that starts inside the window,
    matched in order to the launches inside it (a barrier between steps is outside)."""

    def inside(e: ProfiledEvent) -> bool:
        return start_us <= e.start_us <= end_us

    out = []
    for backend, launch_names in BACKEND_OPS.items():
        ranges = sorted((e for e in events if e.name == backend and e.thread != main
                         and inside(e)), key=lambda e: e.start_us)  # fmt: skip
        launches = sorted((e for e in events if e.name in launch_names and e.thread == main
                           and inside(e)), key=lambda e: e.start_us)  # fmt: skip
        if len(launches) != len(ranges):
            raise ValueError(
                f"{len(ranges)} {backend} ranges but {len(launches)} launches of "
                f"{' or '.join(launch_names)} in one step: they cannot be matched"
            )
        for launch, ran in zip(launches, ranges, strict=True):
            out.append((KIND_OF_LAUNCH[launch.name], ran, launch.nbytes))
    return sorted(out, key=lambda c: c[1].start_us)


def _compute_spans(
    ops: list[tuple[float, float]], window: ProfiledEvent, phase: str, ms: Callable[[float], float]
) -> list[Span]:
    """The phase's ops merged into compute spans, and the gaps between them as waits."""
    inside = [(max(a, window.start_us), min(b, window.end_us)) for a, b in ops
              if b > window.start_us and a < window.end_us]  # fmt: skip
    busy = _merged(inside, GAP_MS * 1e3)
    spans = [Span(phase, phase, ms(a), ms(b)) for a, b in busy]
    cursor = window.start_us
    for a, b in [*busy, (window.end_us, window.end_us)]:
        if a - cursor >= GAP_MS * 1e3:
            spans.append(Span(f"no op running in {phase}", "wait", ms(cursor), ms(a)))
        cursor = max(cursor, b)
    return spans


def steps_from_events(
    events: Sequence[ProfiledEvent], *, rank: int, world_size: int, method: str
) -> list[StepTrace]:
    """One :class:`StepTrace` per ``dplab::step#k`` range; times in ms from the step's start."""
    marks = sorted((e for e in events if e.name.startswith(STEP_MARK)), key=lambda e: e.start_us)
    if not marks:
        raise ValueError(f"no {STEP_MARK}k range in the profile: mark each step")
    main = marks[0].thread
    ops = [(e.start_us, e.end_us) for e in events
           if e.thread == main and e.name.startswith(("aten::", "fsdp::"))]  # fmt: skip
    steps = []
    for k, mark in enumerate(marks):

        def ms(us: float, t0: float = mark.start_us) -> float:
            return (us - t0) / 1e3

        spans: list[Span] = []
        for phase in PHASES:
            window = next((e for e in events if e.thread == main and e.name == PHASE_MARK + phase
                           and mark.start_us <= e.start_us <= mark.end_us), None)  # fmt: skip
            if window is None:
                raise ValueError(f"step {k} has no {PHASE_MARK}{phase} range")
            spans += _compute_spans(ops, window, phase, ms)
        counts = dict.fromkeys(LABELS, 0)
        for kind, ran, nbytes in _collectives(events, main, mark.start_us, mark.end_us):
            counts[kind] += 1
            label = f"{LABELS[kind]}{counts[kind]}"
            spans.append(Span(label, kind, ms(ran.start_us), ms(ran.end_us), None, nbytes))
        steps.append(
            StepTrace(
                rank=rank,
                world_size=world_size,
                backend="gloo",
                device="cpu",
                clock="host",
                step=k,
                spans=spans,
                origin_ms=mark.start_us / 1e3,
                meta={"variant": method, "source": "torch.profiler"},
            )
        )
    return steps


def _tensor_numel(dims: Any) -> int:
    """numel of one recorded argument: a tensor's dims, or a tensor list's (summed)."""
    if isinstance(dims, list) and dims and all(isinstance(d, list) for d in dims):
        return sum(numel(d) or 0 for d in dims)
    return numel(dims) or 0


def _events(profiler: Any, default_element_bytes: int) -> list[ProfiledEvent]:
    """The profile's ranges, through its Chrome export (which, unlike ``profiler.events()``,
    keeps the dims of tensor-list arguments: DDP's and ZeRO's launches take lists)."""
    ((label, doc),) = documents(profiler)
    _, events = events_of(label, doc)
    out = []
    for e in events:
        sizes = [_tensor_numel(d) for d in e.args.get("Input Dims") or []]
        largest = max(sizes, default=0)
        width = element_bytes(e) or default_element_bytes
        out.append(ProfiledEvent(e.name, e.tid, e.start, e.end, largest * width or None))
    return out


def traced_sharded_step(
    method: str,
    *,
    steps: int = 2,
    per_block: bool = True,
    optimizer: str = "adamw",
    group_size: int | None = None,
) -> list[StepTrace] | None:
    """Run on every rank: a warm-up step, then ``steps`` profiled steps of ``method``; this
    rank's steps as :class:`StepTrace`\\ s. ``group_size=n`` runs on the first ``n`` ranks only
    (the others return ``None``), as :func:`~dplab.sharding.ranks.sharded_step` does."""
    from torch.profiler import ProfilerActivity, profile, record_function

    method = _check_args(method, optimizer, "float32", steps)
    rank = dist.get_rank()
    group, world = sub_group(group_size)
    if rank >= world:
        return None
    wrapped, opt = _wrap(method, sharded_model(), OPTIMIZERS[optimizer], group, per_block)
    x, y = rank_batch(rank)

    def one_step() -> None:
        opt.zero_grad(set_to_none=True)
        with record_function(PHASE_MARK + "forward"):
            loss = wrapped(x, y)
        with record_function(PHASE_MARK + "backward"):
            loss.backward()
        with record_function(PHASE_MARK + "optimizer"):
            opt.step()

    one_step()  # warm-up: buffers, FSDP's lazy init, gloo's connections
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for k in range(steps):
            dist.barrier(group=group)
            with record_function(f"{STEP_MARK}{k}"):
                one_step()
    return steps_from_events(_events(prof, 4), rank=rank, world_size=world, method=method)
