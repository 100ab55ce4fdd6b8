"""``from_profiler``: a torch.profiler (Kineto) trace of a torch DDP job as dplab ``StepTrace``s.

The course measures steps inside dplab; a learner's own job runs torch's
``DistributedDataParallel`` and can only be watched from outside. ``torch.profiler`` records
enough to rebuild the same timeline, without touching the job:

- steps: the ``ProfilerStep#N`` ranges that ``prof.step()`` opens (only with a ``schedule=``);
- ``forward``: each ``DistributedDataParallel.forward`` annotation in the step;
- ``backward``: from the first autograd op after a forward (``autograd::engine::
  evaluate_function: …``) to the end of the last gradient accumulation
  (``torch::autograd::AccumulateGrad``), as :class:`dplab.Tracer` ends backward with the last
  gradient; DDP's hooks run just after it, inside the engine's evaluate_function, so launching
  the last bucket belongs to the wait;
- gradients: the reducer's op on each gradient, in its hook right after the gradient's
  accumulation (whose end is the moment the gradient was ready): ``torch::distributed::reducer::
  mul_out`` copying and dividing it into its bucket; ``torch::distributed::reducer::copy_`` when
  a comm hook divides instead; ``aten::div_`` when the gradient already is a view of its bucket
  (``gradient_as_bucket_view=True`` with gradients kept between steps): reducer.cpp's
  ``mark_variable_ready_dense``. Its recorded input (``record_shapes=True``) is the gradient's
  shape; buckets are matched to gradients by element count, so a hook that sends fewer bytes
  (bf16 compression) still finds its gradients;
- ``allreduce``: on CPU the ``gloo:all_reduce`` range on a gloo worker thread (from when a worker
  started it: the start the Tracer draws), matched in order to the ``c10d::allreduce_`` launch
  on the training thread, and ending where the range ends unless the training thread proves it
  done earlier (see :func:`_completions`); on GPU the NCCL all-reduce kernel;
- ``wait``: from the end of backward until the reducer has copied the last reduced bucket back
  (``copy_bucket_to_grad``) or the last all-reduce ended;
- ``optimizer``: ``Optimizer.step#…``.

On GPU every compute range is moved to the kernels it launched (joined by Kineto's
``correlation`` ids), so that compute and NCCL kernels share the GPU's clock.

Bucket sizes come from the launches' recorded input sizes (``record_shapes=True``), otherwise
from ``ddp._get_ddp_logging_data()`` when it is passed. Times are ms from the step's first
forward; ``origin_ms`` places that on one time base for all ranks (Kineto's timestamps are
wall-clock microseconds, shared by the ranks of one host).

The GPU path has not been checked against a recorded GPU trace yet (no GPU was lent when it
was written): it follows Kineto's event schema, and its steps say ``meta["verified"] = False``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dplab.trace.bucket import Bucket
from dplab.trace.kineto import (
    NCCL_ALLREDUCE,
    trace_files,  # noqa: F401  (re-exported: the CLI's reader)
)
from dplab.trace.kineto import Event as _Event
from dplab.trace.kineto import GpuTimes as _GpuTimes
from dplab.trace.kineto import documents as _documents
from dplab.trace.kineto import element_bytes as _element_bytes
from dplab.trace.kineto import events_of as _events
from dplab.trace.kineto import launch_numel as _launch_numel
from dplab.trace.kineto import logged_bucket_sizes as _logged_bucket_sizes
from dplab.trace.kineto import numel as _numel
from dplab.trace.reducer_ops import ACCUMULATED, reducer_ops
from dplab.trace.step import Span, StepTrace

STEP_PREFIX = "ProfilerStep#"
FORWARD = "DistributedDataParallel.forward"
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "
COPY_BACK = "torch.distributed.ddp.reducer::copy_bucket_to_grad"
OPTIMIZER_PREFIX = "Optimizer.step#"
ALLREDUCE_LAUNCH = "c10d::allreduce_"
GLOO_ALLREDUCE = "gloo:all_reduce"

# -- one rank ----------------------------------------------------------------------------------


def _accumulations(events: Sequence[_Event], launches: Sequence[_Event]) -> list[_Event]:
    """Each gradient accumulation, ending where its gradient was ready.

    A hook registered on the tensor (``register_post_accumulate_grad_hook``, as dplab.DDP does)
    runs inside the accumulation's range, and a collective launched from it is no part of
    computing the gradient: such a range ends where the first launch inside it begins. (torch
    DDP's reducer hooks the autograd node instead, outside the range.)
    """
    starts = [e.start for e in launches]
    out = []
    for e in events:
        if e.name != ACCUMULATED:
            continue
        k = bisect.bisect_left(starts, e.start)
        end = starts[k] if k < len(starts) and starts[k] < e.end else e.end
        out.append(_Event(e.name, e.tid, e.start, end, e.args, e.cat))
    return out


def _within(events: Sequence[_Event], start: float, end: float) -> list[_Event]:
    return [e for e in events if start <= e.start < end]


def _match_runs(launches: list[_Event], runs: list[_Event]) -> dict[int, _Event]:
    """Which gloo run belongs to which launch (index into ``launches``).

    Gloo queues collectives and its worker threads take them first in, first out, so the k-th
    run of a size started after the k-th launch of that size. Runs are matched greedily in start
    order to the earliest unmatched launch of the same size that came before them.
    """
    out: dict[int, _Event] = {}
    used = [False] * len(launches)
    first = 0  # every launch before this one is matched
    for run in sorted(runs, key=lambda e: e.start):
        size = _numel(run.args.get("Input Dims", [None])[0]) if run.args.get("Input Dims") else None
        while first < len(launches) and used[first]:
            first += 1
        for i in range(first, len(launches)):
            launch = launches[i]
            if launch.start > run.start:
                break
            if used[i]:
                continue
            if size is not None and _launch_numel(launch) not in (None, size):
                continue
            used[i] = True
            out[i] = run
            break
    return out


@dataclass(frozen=True)
class _RankEvents:
    """One rank's events, sorted into what the steps are read from (one pass over the file)."""

    label: str
    forwards: list[_Event]
    launches: list[_Event]  # c10d::allreduce_ on the training thread, in start order
    gloo_runs: dict[int, _Event]  # index into launches -> its gloo:all_reduce range
    nccl: list[_Event]  # NCCL kernels, in start order
    gpu: _GpuTimes | None  # set on a GPU (NCCL) trace
    autograd: list[_Event]
    accumulations: list[_Event]
    grads: list[_Event]
    copies: list[_Event]
    optimizers: list[_Event]


@dataclass(frozen=True)
class _RawStep:
    """One profiled step of one rank as read from its events, in the file's µs.

    Produced by :func:`_raw_step` (CPU times), moved to the GPU's clock by
    :func:`_on_gpu_clock`, and turned into a :class:`StepTrace` by :func:`_to_step`.
    """

    window: tuple[float, float]  # the ProfilerStep#N range
    forwards: list[tuple[float, float]]
    backwards: list[tuple[float, float]]  # one per micro-batch, the accumulations' end
    ops_end: float  # the last autograd op's end (DDP's hooks included)
    comms: list[tuple[int, _Event | None, _Event]]  # (bucket, launch, gloo range / NCCL kernel)
    copies: list[_Event]  # copy_bucket_to_grad (bounds the all-reduces' ends on CPU)
    copy_end: float | None
    optimizer: list[tuple[float, float]]
    grads: list[_Event]  # reducer::mul_out, one per gradient, in ready order
    ready: list[float]  # when each gradient was ready
    gpu: bool


def _rank_events(label: str, events: list[_Event], forward_name: str) -> _RankEvents:
    """Sort one rank's events, or say which kind the trace lacks."""
    forwards = [e for e in events if e.name == forward_name]
    if not forwards:
        raise ValueError(
            f"{label} has no {forward_name!r} range: it is not a trace of a torch "
            "DistributedDataParallel job (pass forward_name= for a module whose forward is "
            "annotated otherwise)"
        )
    nccl = sorted((e for e in events if e.name.startswith(NCCL_ALLREDUCE)), key=lambda e: e.start)
    gloo = [e for e in events if e.name == GLOO_ALLREDUCE]
    launches = sorted((e for e in events if e.name == ALLREDUCE_LAUNCH), key=lambda e: e.start)
    if not nccl and not gloo:
        raise ValueError(
            f"{label} has no all-reduce: neither {GLOO_ALLREDUCE!r} ranges (gloo, CPU) nor "
            f"{' / '.join(n + '*' for n in NCCL_ALLREDUCE)} kernels (NCCL, GPU); was the "
            "profiled job synchronising gradients (not under no_sync(), world size > 1)?"
        )
    gpu = bool(nccl)
    return _RankEvents(
        label=label,
        forwards=forwards,
        launches=launches,
        gloo_runs={} if gpu else _match_runs(launches, gloo),
        nccl=nccl,
        gpu=_GpuTimes(events) if gpu else None,
        autograd=[e for e in events if e.name.startswith(AUTOGRAD_PREFIX)],
        accumulations=_accumulations(events, launches),
        grads=reducer_ops(events),
        copies=[e for e in events if e.name == COPY_BACK],
        optimizers=[e for e in events if e.name.startswith(OPTIMIZER_PREFIX)],
    )


def _rank_steps(
    meta: dict[str, Any],
    events: list[_Event],
    *,
    forward_name: str,
) -> list[tuple[int, float, _RawStep]]:
    """(step number, its first forward's start in the file's µs, raw step) for every profiled
    step of one rank."""
    label = meta["source"]
    steps = sorted((e for e in events if e.name.startswith(STEP_PREFIX)), key=lambda e: e.start)
    if not steps:
        raise ValueError(
            f"{label} has no {STEP_PREFIX}N ranges, so its steps cannot be found: profile with "
            "schedule=torch.profiler.schedule(...) and call prof.step() once per step"
        )
    rank = _rank_events(label, events, forward_name)
    out = []
    for step in steps:
        suffix = step.name[len(STEP_PREFIX) :]
        number = int(suffix) if suffix.isdigit() else len(out)
        raw = _raw_step(rank, step, number)
        if raw is not None:
            out.append((number, raw.forwards[0][0], raw))
    if not out:
        raise ValueError(
            f"{label}: none of its {len(steps)} {STEP_PREFIX}N ranges holds a {forward_name!r}"
        )
    return out


def _backwards(
    rank: _RankEvents, fwd: list[_Event], step: _Event, number: int
) -> tuple[list[tuple[float, float]], float]:
    """Each micro-batch's backward (first autograd op to the last accumulation after its
    forward) and the end of the last autograd op."""
    bounds = [f.start for f in fwd[1:]] + [step.end]
    backwards, ops_end = [], 0.0
    for f, until in zip(fwd, bounds, strict=True):
        ops = _within(rank.autograd, f.end, until)
        if not ops:
            continue
        # the accumulation itself, without the post hooks (DDP's) that run inside the
        # engine's evaluate_function around it
        acc = _within(rank.accumulations, f.end, until) or ops
        backwards.append((min(e.start for e in ops), max(e.end for e in acc)))
        ops_end = max(e.end for e in ops)
    if not backwards:
        raise ValueError(
            f"{rank.label}, step {number}: no backward ops ({AUTOGRAD_PREFIX}…) after the "
            "forward; was backward() called inside the profiled step?"
        )
    return backwards, ops_end


def _comms(
    rank: _RankEvents, step: _Event, last_fwd_end: float, number: int
) -> list[tuple[int, _Event | None, _Event]]:
    """(bucket, launch, the all-reduce's range) for each all-reduce launched after the last
    forward: on CPU the gloo range matched to its launch, on GPU the NCCL kernel."""
    idx = [i for i, e in enumerate(rank.launches) if last_fwd_end <= e.start < step.end]
    comms: list[tuple[int, _Event | None, _Event]] = []
    if rank.gpu is not None:
        # NCCL kernels launched from this step's backward (by correlation), else those
        # that ran in its range
        kernels = [k for t, k in rank.gpu.nccl if last_fwd_end <= t < step.end] or [
            k for k in rank.nccl if step.start <= k.start < step.end
        ]
        for b, k in enumerate(sorted(kernels, key=lambda k: k.start)):
            comms.append((b, rank.launches[idx[b]] if b < len(idx) else None, k))
    else:
        for b, i in enumerate(idx):
            if i in rank.gloo_runs:
                comms.append((b, rank.launches[i], rank.gloo_runs[i]))
    if not comms:
        raise ValueError(
            f"{rank.label}, step {number}: no all-reduce was launched after the forward "
            "(was this step under no_sync()?)"
        )
    return comms


def _raw_step(rank: _RankEvents, step: _Event, number: int) -> _RawStep | None:
    """One ProfilerStep's ranges, or None when it holds no forward."""
    fwd = sorted(_within(rank.forwards, step.start, step.end), key=lambda e: e.start)
    if not fwd:
        return None
    backwards, ops_end = _backwards(rank, fwd, step, number)
    last_fwd_end = fwd[-1].end
    comms = _comms(rank, step, last_fwd_end, number)
    opt = sorted(_within(rank.optimizers, last_fwd_end, step.end), key=lambda e: e.start)
    step_grads = sorted(_within(rank.grads, backwards[-1][0], step.end), key=lambda e: e.end)
    done = sorted(e.end for e in _within(rank.accumulations, backwards[-1][0], step.end))
    step_copies = _within(rank.copies, backwards[-1][0], step.end)
    raw = _RawStep(
        window=(step.start, step.end),
        forwards=[(f.start, f.end) for f in fwd],
        backwards=backwards,
        ops_end=ops_end,
        comms=comms,
        copies=step_copies,
        copy_end=max((c.end for c in step_copies), default=None),
        optimizer=[(o.start, o.end) for o in opt[:1]],
        grads=step_grads,
        ready=[_ready_cpu(done, g) for g in step_grads],
        gpu=rank.gpu is not None,
    )
    return raw if rank.gpu is None else _on_gpu_clock(raw, rank.gpu)


def _ready_cpu(done: Sequence[float], grad: _Event) -> float:
    """A gradient is ready when the accumulation just before the reducer's hook ended."""
    k = bisect.bisect_right(done, grad.start)
    return done[k - 1] if k else grad.start


def _on_gpu_clock(raw: _RawStep, times: _GpuTimes) -> _RawStep:
    """On GPU the CPU only launches: move every compute range to the kernels it launched."""
    backwards = [times.on_gpu(a, b) for a, b in raw.backwards]
    ends = [w[1] for c in raw.copies if (w := times.window(c.start, c.end))]
    return replace(
        raw,
        forwards=[times.on_gpu(a, b) for a, b in raw.forwards],
        backwards=backwards,
        ops_end=max(backwards[-1][1], times.on_gpu(raw.ops_end, raw.ops_end)[1]),
        optimizer=[times.on_gpu(a, b) for a, b in raw.optimizer],
        # the reducer's copy of a gradient into its bucket is a kernel: its end is when it is in
        ready=[
            (times.window(g.start, g.end) or (0.0, r))[1]
            for g, r in zip(raw.grads, raw.ready, strict=True)
        ],
        copy_end=max(ends, default=None),
        copies=[],  # no clamping: an NCCL kernel's end is the GPU's own
    )


def _bucket_numels(raw: _RawStep) -> list[int | None]:
    """Each all-reduce's element count, from its launch's (or its gloo range's) input."""
    numels: list[int | None] = []
    for _, launch, run in raw.comms:
        numel = _launch_numel(launch) if launch is not None else None
        if numel is None and run is not None and run.args.get("Input Dims"):
            numel = _numel(run.args["Input Dims"][0])
        numels.append(numel)
    return numels


def _bucket_sizes(raw: _RawStep, logged: list[int] | None) -> tuple[list[int], str]:
    sizes: list[int | None] = []
    for (_, launch, run), numel in zip(raw.comms, _bucket_numels(raw), strict=True):
        width = _element_bytes(run) or _element_bytes(launch)
        sizes.append(numel * width if numel is not None and width else None)
    if all(s is not None for s in sizes):
        return [int(x) for x in sizes if x is not None], "record_shapes"
    if logged is not None and len(logged) == len(raw.comms):
        return list(logged), "ddp_logging_data"
    if logged is not None:
        raise ValueError(
            f"the step has {len(raw.comms)} all-reduces but ddp_logging_data lists "
            f"{len(logged)} buckets: is it the same job, after its buckets were rebuilt?"
        )
    raise ValueError(
        "the all-reduces' sizes were not recorded: profile with record_shapes=True, or pass "
        "ddp_logging_data=ddp._get_ddp_logging_data()"
    )


def _grad_rows(raw: _RawStep, backward_start: float) -> list[dict[str, Any]]:
    """Each gradient torch's reducer took (one ``mul_out`` each, in its post-accumulate hook),
    with its ready time (:func:`_ready_cpu`, or on GPU its bucket copy's kernel end)."""
    rows = []
    for g, ready in zip(raw.grads, raw.ready, strict=True):
        dims = g.args.get("Input Dims")
        numel = _numel(dims[0]) if dims else None
        width = _element_bytes(g)
        types = g.args.get("Input type") or [None]
        rows.append(
            {
                "numel": numel,
                "nbytes": numel * width if numel is not None and width else None,
                "dtype": types[0],
                "ready_ms": (ready - backward_start) / 1e3,
            }
        )
    return rows


def _assign_params(
    grads: list[dict[str, Any]], sizes: Sequence[int | None], key: str = "nbytes"
) -> list[list[int]] | None:
    """Gradients (in ready order) per bucket: torch's rebuilt buckets are runs of that order, so
    the cumulative ``key`` (``"numel"``, or ``"nbytes"`` when only the buckets' bytes are known)
    must meet each bucket's exactly; otherwise None (not inferable)."""
    if not grads or any(g[key] is None for g in grads) or any(s is None for s in sizes):
        return None
    out, k = [], 0
    for size in sizes:
        members, total = [], 0
        while k < len(grads) and total < size:
            members.append(k)
            total += grads[k][key]
            k += 1
        if total != size:
            return None
        out.append(members)
    return out if k == len(grads) else None


def _completions(raw: _RawStep, members: list[list[int]] | None) -> list[float]:
    """When each all-reduce was done: the end of its gloo range, unless the trace proves it
    done earlier.

    Gloo closes its range in a callback on the work's future, after the result is already
    visible; on a busy machine the worker can be descheduled in between and the range can even
    end after the optimizer has stepped. The training thread bounds it: torch's reducer copies
    bucket b back (``copy_bucket_to_grad``, one per gradient, bucket by bucket) only once b is
    done, and nothing steps the optimizer before every bucket is.
    """
    ends = [run.end for _, _, run in raw.comms]
    copies = sorted(raw.copies, key=lambda e: e.start)
    if members and len(copies) == sum(len(m) for m in members):
        k = 0
        for b, m in enumerate(members):
            if m:
                ends[b] = min(ends[b], copies[k].start)
            k += len(m)
    if raw.optimizer:
        ends = [min(e, raw.optimizer[0][0]) for e in ends]
    starts = [run.start for _, _, run in raw.comms]
    return [max(e, a) for e, a in zip(ends, starts, strict=True)]


def _compute_spans(raw: _RawStep, ms: Callable[[float], float], ends: list[float]) -> list[Span]:
    """Forward and backward (one per micro-batch), the end-of-backward wait and the optimizer.

    The wait runs from backward's end until the last bucket is reduced and copied back, but
    never past the optimizer's start (it cannot step before every bucket is in).
    """
    spans: list[Span] = []
    for kind, pairs in (("forward", raw.forwards), ("backward", raw.backwards)):
        for n, (a, b) in enumerate(pairs):
            spans.append(Span(kind if len(pairs) == 1 else f"{kind} {n}", kind, ms(a), ms(b)))
    backward_end = raw.backwards[-1][1]
    copy_end = backward_end if raw.copy_end is None else raw.copy_end
    wait_end = max(max(ends), copy_end, backward_end)
    if raw.optimizer:
        wait_end = min(wait_end, max(raw.optimizer[0][0], backward_end))
    spans.append(Span("wait", "wait", ms(backward_end), ms(wait_end)))
    for a, b in raw.optimizer:
        spans.append(Span("optimizer", "optimizer", ms(a), ms(b)))
    return spans


def _bucket_spans(
    raw: _RawStep,
    ms: Callable[[float], float],
    sizes: list[int],
    grads: list[dict[str, Any]],
    members: list[list[int]] | None,
    ends: list[float],
) -> list[Span]:
    """Each bucket's ready mark and its all-reduce."""
    spans: list[Span] = []
    backward_start = ms(raw.backwards[-1][0])
    for b, (_, launch, run) in enumerate(raw.comms):
        # ready when its last gradient is in (if the gradients are known), else at its launch
        ready = (
            backward_start + max(grads[k]["ready_ms"] for k in members[b])
            if members
            else ms(launch.start)
            if launch is not None
            else None
        )
        if ready is not None:
            spans.append(Span(f"bucket {b} ready", "bucket_ready", ready, ready, b, sizes[b]))
        spans.append(
            Span(f"all-reduce bucket {b}", "allreduce", ms(run.start), ms(ends[b]), b, sizes[b])
        )
    return spans


def _to_step(
    meta: dict[str, Any],
    number: int,
    zero: float,
    raw: _RawStep,
    origin: float,
    shift_us: float,
    logged: list[int] | None,
    param_names: Sequence[str] | None,
) -> StepTrace:
    def ms(t: float) -> float:
        return (t - zero) / 1e3

    try:
        sizes, size_source = _bucket_sizes(raw, logged)
    except ValueError as e:
        raise ValueError(f"{meta['source']}, step {number}: {e}") from None
    grads = _grad_rows(raw, raw.backwards[-1][0])
    numels = _bucket_numels(raw)
    # by element count: a comm hook may send the bucket in fewer bytes (bf16) than it holds
    members = (
        _assign_params(grads, numels, "numel")
        if size_source == "record_shapes"
        else _assign_params(grads, sizes)
    )
    ends = _completions(raw, members)
    spans = _compute_spans(raw, ms, ends) + _bucket_spans(raw, ms, sizes, grads, members, ends)
    # torch DDP's reducer sees parameters in registration order; the ready order is roughly
    # its reverse, but only the caller can say which gradient is which
    names = (
        [str(p) for p in param_names]
        if param_names is not None and len(param_names) == len(grads)
        else [f"grad {k}" for k in range(len(grads))]
    )
    buckets = [
        Bucket(
            index=b,
            param_names=tuple(names[k] for k in members[b]) if members else (),
            nbytes=sizes[b],
        )
        for b in range(len(raw.comms))
    ]
    lanes = len({run.tid for _, _, run in raw.comms})
    return StepTrace(
        rank=meta["rank"],
        world_size=meta["world_size"],
        backend=meta["backend"],
        device="cuda" if raw.gpu else "cpu",
        clock="cuda_event" if raw.gpu else "host",
        step=number,
        spans=sorted(spans, key=lambda s: (s.start_ms, s.end_ms)),
        buckets=buckets,
        origin_ms=(zero + shift_us - origin) / 1e3,
        meta={
            "source": "torch.profiler",
            "model": "torch DDP job (torch.profiler)",
            "file": meta["source"],
            "start_unix_us": meta["base_ns"] / 1e3 + zero,
            "start_ts_us": zero,  # in the file's own timestamps (µs after baseTimeNanoseconds)
            "host": meta["host"],
            "profiler_step_ms": [ms(raw.window[0]), ms(raw.window[1])],
            "bucket_sizes_from": size_source,
            "comm_lanes": max(lanes, 1),
            "grads": grads,
            # the gradients' own bytes per bucket (more than it sent, when a hook compresses)
            "bucket_grad_bytes": (
                [sum(grads[k]["nbytes"] for k in m) for m in members] if members else None
            ),
            "backward_ops_end_ms": ms(raw.ops_end),
            "launch_ms": [ms(launch.start) if launch else None for _, launch, _ in raw.comms],
            "verified": not raw.gpu,
        },
    )


def from_profiler(
    source: Any,
    *,
    ddp_logging_data: Mapping[str, Any] | None = None,
    param_names: Sequence[str] | None = None,
    forward_name: str = FORWARD,
) -> list[list[StepTrace]]:
    """Per rank (ordered by rank), the profiled steps of a torch DDP job as ``StepTrace``s.

    ``source``: a trace file (``prof.export_chrome_trace(path)``, ``.json`` or ``.json.gz``), a
    folder of them (one per rank), a list of files, a parsed trace dict, or a live
    ``torch.profiler.profile``. ``ddp_logging_data``: ``ddp._get_ddp_logging_data()``, the bucket
    sizes when the trace was recorded without ``record_shapes=True``. ``param_names``: names for
    the gradients in the order they became ready (else ``grad 0``, ``grad 1``, …).
    Unusable input is a ``ValueError`` that says what is missing.
    """
    logged = _logged_bucket_sizes(ddp_logging_data)
    ranks: dict[int, list[tuple[int, float, _RawStep, dict[str, Any]]]] = {}
    for label, doc in _documents(source):
        meta, events = _events(label, doc)
        if meta["rank"] in ranks:
            raise ValueError(
                f"two traces of rank {meta['rank']} ({ranks[meta['rank']][0][3]['source']} and "
                f"{label}): keep one file per rank"
            )
        found = _rank_steps(meta, events, forward_name=forward_name)
        ranks[meta["rank"]] = [(n, zero, raw, meta) for n, zero, raw in found]
    base = min(steps[0][3]["base_ns"] for steps in ranks.values())

    def shift_us(meta: dict[str, Any]) -> float:
        return (meta["base_ns"] - base) / 1e3

    origin = min(zero + shift_us(meta) for steps in ranks.values() for _, zero, _, meta in steps)
    return [
        [
            _to_step(meta, n, zero, raw, origin, shift_us(meta), logged, param_names)
            for n, zero, raw, meta in ranks[r]
        ]
        for r in sorted(ranks)
    ]
