"""``dplab.Tracer``: a timeline of every synchronising step, recorded by dplab.DDP's own hooks.

Pass it to ``dplab.DDP(model, tracer=tracer)`` and, for the optimizer span,
``tracer.watch(optimizer)``. ``tracer.steps`` is then one :class:`StepTrace` per synchronising
step: micro-batches run under ``no_sync()`` fold into the step that ends with the next
synchronising backward.

What is recorded (times are marks of the clock, resolved after the step):

- ``forward``: DDP.forward's start and end;
- ``backward``: from the moment the gradient reaches the module's output to the last gradient
  accumulated into a parameter;
- ``bucket_ready``: when a bucket's last gradient is in;
- ``allreduce``: from the moment a backend worker began the collective (on gloo: when the
  worker that ran it was free and had a CPU, read from the scheduler's counters; see
  :mod:`dplab.trace.clocks`) to its completion;
- ``wait``: the end of backward (the autograd engine's final callback) waiting for the
  outstanding all-reduces;
- ``optimizer``: ``optimizer.step()`` (through the optimizer's step hooks).
"""

from __future__ import annotations

import gc
import socket
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dplab._nested import tensors_in
from dplab.trace.bucket import Bucket
from dplab.trace.clocks import (
    Collective,
    Completion,
    CudaClock,
    HostClock,
    Poll,
    WorkerThreads,
    merge_polls,
    worker_spans,
)
from dplab.trace.step import Span, StepTrace

POLLS_PER_LAUNCH = 16


@dataclass
class _Comm:
    """One launched collective: its bucket, bytes, launch mark and completion record."""

    bucket: int
    nbytes: int
    launch: Any
    done: Completion
    first_poll: int | None = None  # the step's reading taken at its launch
    attach_poll: int | None = None  # the reading taken once its callback was attached


@dataclass
class _RawStep:
    """Marks of one step, kept unresolved until someone reads ``tracer.steps``."""

    start: Any
    buckets: list[Bucket]
    forwards: list[list[Any]] = field(default_factory=list)
    backwards: list[list[Any]] = field(default_factory=list)  # [start, end]
    ready: list[tuple[int, Any]] = field(default_factory=list)
    comms: list[_Comm] = field(default_factory=list)
    waits: list[list[Any]] = field(default_factory=list)
    optimizer: list[list[Any]] = field(default_factory=list)
    polls: list[tuple[Any, dict[int, Any]]] = field(default_factory=list)  # (mark, counters)
    synced: bool = False


class Tracer:
    """Records a :class:`StepTrace` per synchronising step of the DDP it is attached to."""

    def __init__(self) -> None:
        self._done: list[StepTrace] = []
        self._pending: list[_RawStep] = []
        self._current: _RawStep | None = None
        self._clock: Any = None
        self._now: Any = None  # self._clock.now, once attached
        self._origin: Any = None
        self._origin_ms = 0.0
        self._lanes = 1
        self._info: dict[str, Any] = {}
        self._buckets: list[Bucket] = []
        self._step = 0
        self._backward_open = False
        self._last_grad: Any = None
        self._launch_mark: Any = None
        self._launch_poll: int | None = None
        self._threads: WorkerThreads | None = None
        self._unseen: dict[int, Any] = {}  # workers not yet seen running since the last launch
        self._polls_left = 0
        self._gc_deferred = False
        self.meta: dict[str, Any] = {}
        self._watched: weakref.ref | None = None

    # -- public --------------------------------------------------------------------------------

    @property
    def steps(self) -> list[StepTrace]:
        """Every finished step so far, resolved (on GPU this synchronises, after the fact)."""
        if self._current is not None and self._current.synced:
            self._close()
        if self._pending:
            self._clock.settle([c.done for raw in self._pending for c in raw.comms])
            self._done.extend(self._resolve(raw) for raw in self._pending)
            self._pending = []
        return list(self._done)

    def clear(self) -> None:
        """Forget recorded steps (e.g. warm-up ones)."""
        _ = self.steps
        self._done = []

    def watch(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Time ``optimizer.step()`` as the step's ``optimizer`` span; returns the optimizer."""
        optimizer.register_step_pre_hook(lambda *_: self._optimizer_start())
        optimizer.register_step_post_hook(lambda *_: self._optimizer_end())
        return optimizer

    # -- the StepObserver calls, made by dplab.DDP ---------------------------------------------

    def attach(self, ddp: Any) -> None:
        watched = self._watched() if self._watched is not None else None
        if watched is not None and watched is not ddp and not watched.detached:
            raise ValueError(
                "this Tracer already records another dplab.DDP (a Tracer keeps one timeline, "
                "of one DDP): give each DDP its own Tracer"
            )
        self._watched = weakref.ref(ddp)
        group = ddp.process_group
        backend = dist.get_backend(group)
        device = ddp.bucket_buffers[0].device
        self._clock = pick_clock(backend, device)
        self._now = self._clock.now
        self._lanes = _gloo_threads(group) if backend == "gloo" else 1
        self._threads = self._clock.threads
        self._info = {
            "rank": ddp.rank,
            "world_size": ddp.world_size,
            "backend": backend,
            "device": str(device),
            "clock": self._clock.kind,
        }
        self.meta["start_from"] = "scheduler" if self._threads is not None else "queue"
        self.buckets_changed(ddp)
        self._align(group)

    def _align(self, group: Any) -> None:
        """One time base for all ranks: rank lanes then line up in one figure.

        Ranks on one host share the monotonic clock, so rank 0's reading is exact for all.
        Across hosts, every rank takes its own reading as it leaves a barrier.
        """
        dist.barrier(group=group)
        if self._clock.kind == "cuda_event":
            torch.cuda.synchronize(self._clock.device)
        self._origin = self._clock.now()
        if self._clock.kind == "host":
            readings: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(readings, (socket.gethostname(), self._origin), group=group)
            if len({host for host, _ in readings}) == 1:
                self._origin = readings[0][1]

    def buckets_changed(self, ddp: Any) -> None:
        self._buckets = list(ddp.buckets)

    def forward_start(self) -> None:
        if self._current is not None and self._current.synced:
            self._close()
        mark = self._clock.now()
        if self._current is None:
            self._current = _RawStep(start=mark, buckets=self._buckets)
        self._current.forwards.append([mark, None])

    def forward_end(self, out: Any) -> None:
        self._current.forwards[-1][1] = self._clock.now()
        self._backward_open = False
        hooked = _first_grad_tensor(out)
        if hooked is not None:
            hooked.register_hook(self._output_grad)

    def _output_grad(self, grad: torch.Tensor) -> None:
        self._open_backward()

    def _open_backward(self, mark: Any = None) -> None:
        if not self._backward_open:
            self._backward_open = True
            self._last_grad = None
            self._current.backwards.append([self._clock.now() if mark is None else mark, None])

    def grad_ready(self, index: int) -> None:
        mark = self._now()  # called once per gradient: the clock's now(), looked up at attach
        if not self._backward_open:
            self._open_backward(mark)
        self._last_grad = mark
        if self._unseen and self._polls_left > 0:
            self._poll(mark)

    def bucket_ready(self, bucket: int) -> None:
        self._current.ready.append((bucket, self._clock.now()))

    def allreduce_start(self, bucket: int) -> None:
        # A garbage collection between the launch and the attach of the completion callback
        # (hundreds of ms on a large heap) would let the collective finish unseen, dated only
        # by the attach; the collection is put off to just after the attach instead.
        self._gc_deferred = gc.isenabled()
        gc.disable()
        self._launch_mark = self._clock.now()
        self._launch_poll = self._poll(self._launch_mark, launch=True)

    def allreduce_failed(self, bucket: int) -> None:
        self._resume_gc()

    def _resume_gc(self) -> None:
        if self._gc_deferred:
            self._gc_deferred = False
            gc.enable()

    def allreduce_launched(self, bucket: int, work: Any, nbytes: int) -> None:
        try:
            end = self._clock.completion(work)
        finally:
            self._resume_gc()
        comm = _Comm(bucket, nbytes, self._launch_mark, end, first_poll=self._launch_poll)
        if self._threads is not None:
            # A collective that a worker ran to its end before the callback was attached has
            # only these readings to date its end by.
            comm.attach_poll = self._poll(self._clock.now())
        self._current.comms.append(comm)

    def _poll(self, mark: Any, *, launch: bool = False) -> int | None:
        """Read the gloo workers' counters; returns the reading's index in the step.

        After a launch, readings continue at the next hooks (at most ``POLLS_PER_LAUNCH``, so a
        model of many tiny gradients pays little) until every worker has run once since: the
        first run of the worker that takes the collective is its start.
        """
        if self._threads is None:
            return None
        sched = self._threads.snapshot()
        polls = self._current.polls
        polls.append((mark, sched))
        if launch:
            self._unseen = dict(sched)
            self._polls_left = POLLS_PER_LAUNCH
        else:
            self._polls_left -= 1
            self._unseen = {
                tid: base
                for tid, base in self._unseen.items()
                if base is not None and sched[tid] is not None and sched[tid].slices == base.slices
            }
        return len(polls) - 1

    def backward_end(self, *, synced: bool) -> None:
        mark = self._clock.now()
        if self._unseen and self._polls_left > 0:
            self._poll(mark)
        if self._current.backwards:
            # Backward ends with its last gradient; the engine's callback may run a little later
            # (on a busy machine, much later), and that time belongs to the wait. A backward
            # that reached no parameter (torch.autograd.grad of the input) ends at the callback.
            last = self._last_grad
            self._current.backwards[-1][1] = last if last is not None else mark
        self._backward_open = False
        if synced:
            self._current.waits.append([mark, None])

    def wait_end(self) -> None:
        self._current.waits[-1][1] = self._clock.now()
        self._current.synced = True

    def _optimizer_start(self) -> None:
        if self._current is not None:
            self._current.optimizer.append([self._clock.now(), None])

    def _optimizer_end(self) -> None:
        if self._current is not None and self._current.optimizer:
            self._current.optimizer[-1][1] = self._clock.now()
            if self._current.synced:
                self._close()

    # -- resolving -----------------------------------------------------------------------------

    def _close(self) -> None:
        self._pending.append(self._current)
        self._current = None
        self._unseen = {}

    def _resolve(self, raw: _RawStep) -> StepTrace:
        clock, origin = self._clock, self._origin
        step0 = clock.ms(raw.start, origin)

        def ms(mark: Any) -> float:
            return clock.ms(mark, origin) - step0

        spans: list[Span] = []
        pairs = [
            ("forward", raw.forwards),
            ("backward", raw.backwards),
            ("wait", raw.waits),
            ("optimizer", raw.optimizer),
        ]
        for kind, marks in pairs:
            for n, (start, end) in enumerate(marks):
                if end is not None:
                    label = kind if len(marks) == 1 else f"{kind} {n}"
                    spans.append(Span(label, kind, ms(start), ms(end)))
        for bucket, mark in raw.ready:
            t = ms(mark)
            spans.append(
                Span(
                    f"bucket {bucket} ready",
                    "bucket_ready",
                    t,
                    t,
                    bucket,
                    self._nbytes_of(raw, bucket),
                )
            )
        # A completion callback that never ran (it always does within settle()) would end the
        # collective at the end of the wait, the latest it can have finished.
        latest = max((s.end_ms for s in spans if s.kind == "wait"), default=0.0)
        ends = [ms(c.done.end) if c.done.end is not None else latest for c in raw.comms]
        workers = set(self._threads.tids) if self._threads is not None else set()
        # the workers' counters read in each completion callback (host clock only)
        readings = [c.done.reading for c in raw.comms if c.done.reading is not None]
        polls, where = merge_polls(
            [Poll(ms(mark), sched) for mark, sched in raw.polls],
            [Poll(ms(read_at), sched) for read_at, sched in readings],
        )
        seen = [
            Collective(
                launch_ms=ms(c.launch),
                end_ms=end,
                thread=c.done.thread if c.done.thread in workers else None,
                end_sched=c.done.sched,
                first_poll=None if c.first_poll is None else where[c.first_poll],
                attach_poll=None if c.attach_poll is None else where[c.attach_poll],
                inline=c.done.inline,  # already done when its callback was attached
            )
            for c, end in zip(raw.comms, ends, strict=True)
        ]
        for comm, (start, end) in zip(
            raw.comms,
            worker_spans(seen, polls, self._lanes),
            strict=True,
        ):
            spans.append(
                Span(
                    f"all-reduce bucket {comm.bucket}",
                    "allreduce",
                    start,
                    end,
                    comm.bucket,
                    comm.nbytes,
                )
            )
        trace = StepTrace(
            spans=sorted(spans, key=lambda s: (s.start_ms, s.end_ms)),
            buckets=raw.buckets,
            step=self._step,
            origin_ms=step0,
            meta=dict(self.meta, comm_lanes=self._lanes),
            **self._info,
        )
        self._step += 1
        return trace

    @staticmethod
    def _nbytes_of(raw: _RawStep, bucket: int) -> int | None:
        for b in raw.buckets:
            if b.index == bucket:
                return b.nbytes
        return None


def pick_clock(backend: str, device: torch.device) -> HostClock | CudaClock:
    """CUDA events where NCCL works on GPU streams; host clocks where gloo works on threads.

    Gloo with CUDA tensors copies to the host and reduces on its threads, so its completion is a
    host event too (its compute spans are then kernel launches, not kernel times).
    """
    if backend == "nccl" and device.type == "cuda":
        return CudaClock(device)
    return HostClock(WorkerThreads.find() if backend == "gloo" else None)


def _gloo_threads(group: Any) -> int:
    """Gloo runs collectives on a pool of threads (2 by default): two buckets can overlap."""
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError):
        return 2


def _first_grad_tensor(out: Any) -> torch.Tensor | None:
    for t in tensors_in(out):
        if t.requires_grad:
            return t
    return None
