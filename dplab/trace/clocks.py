"""Two ways to tell time in a DDP step, behind one small interface.

- :class:`HostClock` (CPU, gloo): ``perf_counter_ns`` at launch, and at completion a callback on
  the collective's future, which gloo's own worker thread runs when the all-reduce is done
  (timed as it returns: gloo closes the collective after its callbacks). The overlap on CPU is
  real: gloo reduces on its threads while autograd computes.
- :class:`CudaClock` (GPU, NCCL): ``torch.cuda.Event(enable_timing=True)`` recorded on the
  streams that do the work. The host only *enqueues* kernels, so host clocks would time the
  enqueueing, not the work. A bucket's ``ready`` event goes on the compute stream just before its
  all-reduce is enqueued (NCCL's stream waits on it); its ``end`` event goes on an otherwise idle
  observer stream made to wait for the NCCL work. Events are resolved after the step, so the
  step itself never synchronises.

A mark is whatever ``now()`` returns; ``ms(mark, origin)`` turns it into milliseconds.

When does a gloo all-reduce *start*? ProcessGroupGloo puts each collective on one FIFO queue
served by a pool of worker threads (2 by default). A worker that finishes one collective takes
the next queued one at once; an idle worker sleeps on a condition variable and is woken by the
launch. torch.profiler's ``gloo:all_reduce`` range starts when a worker begins running it. On a
busy machine (two ranks computing on two cores) the woken worker can wait milliseconds for a
core, and nothing in Python sees that moment. The Linux scheduler counts it, though: each
thread's ``/proc/self/task/<tid>/schedstat`` holds the time it spent runnable but waiting for a
CPU, added when it next gets one. :class:`WorkerThreads` reads those counters, and
:func:`worker_spans` turns them into spans. Without them (not Linux, or the threads not found)
the start falls back to :func:`queue_starts`: the launch, or the moment a worker became free.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

GLOO_WORKER_NAME = "pt_gloo_runloop"  # ProcessGroupGloo::runLoop names its threads so


def future_of(work: Any) -> Any:
    """The future that completes with the collective: a c10d ``Work``'s, or a comm hook's own."""
    get_future = getattr(work, "get_future", None)
    return get_future() if get_future is not None else work


class Sched(NamedTuple):
    """One reading of a thread's scheduler counters (nanoseconds, and times it got a CPU)."""

    cpu_ns: int
    wait_ns: int
    slices: int


class WorkerThreads:
    """A backend's worker threads in this process, read through Linux's ``schedstat``.

    A reading costs one ``pread`` per thread (about a microsecond): cheap enough to take at every
    launch and at a few hooks after it.
    """

    def __init__(self, fds: dict[int, int]):
        self._fds = fds

    @classmethod
    def find(cls, name: str = GLOO_WORKER_NAME) -> WorkerThreads | None:
        """This process's threads called ``name``, or None where their counters can't be read."""
        fds: dict[int, int] = {}
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return None
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() != name:
                        continue
                fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                continue
            fds[int(tid)] = fd
        found = cls(fds)
        if not fds or any(found.read(t) is None for t in fds):
            found.close()
            return None
        return found

    @property
    def tids(self) -> tuple[int, ...]:
        return tuple(self._fds)

    def read(self, tid: int) -> Sched | None:
        fd = self._fds.get(tid)
        if fd is None:
            return None
        try:
            fields = os.pread(fd, 128, 0).split()
            return Sched(int(fields[0]), int(fields[1]), int(fields[2]))
        except (OSError, ValueError, IndexError):
            return None

    def snapshot(self) -> dict[int, Sched | None]:
        return {tid: self.read(tid) for tid in self._fds}

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        self.close()


@dataclass(slots=True)
class Completion:
    """When a collective finished, as its completion callback saw it (filled by that callback).

    ``end`` stays None until the callback has run. On GPU only ``end`` is set (a CUDA event).
    """

    end: Any = None  # the clock's mark, taken as the callback returns
    thread: int | None = None  # native id of the thread that ran the callback
    sched: Sched | None = None  # that thread's scheduler counters, read in the callback
    attached_by: int | None = None  # native id of the thread that attached the callback
    reading: tuple[int, dict[int, Sched | None]] | None = None  # (time, every worker's counters)

    @property
    def inline(self) -> bool:
        """The callback ran on the thread that attached it: the collective was already done,
        so ``end`` is only an upper bound of its end."""
        return self.thread is not None and self.thread == self.attached_by

    def __iter__(self) -> Iterator[Any]:
        """The fields in order (end, thread, sched, attached_by, reading), to unpack."""
        return iter((self.end, self.thread, self.sched, self.attached_by, self.reading))


class HostClock:
    kind = "host"

    def __init__(self, threads: WorkerThreads | None = None):
        self.threads = threads

    def now(self) -> int:
        return time.perf_counter_ns()

    def ms(self, mark: Any, origin: Any) -> float:
        return (mark - origin) / 1e6

    def completion(self, work: Any) -> Completion:
        """A :class:`Completion` that the completing thread fills: the time, its native id, its
        counters, the native id of the thread that attached the callback, and (time, every
        worker's counters).

        The time is taken last, as the callback returns: gloo ends a collective (and
        torch.profiler's range) only after its future's callbacks have run, and a worker that
        loses its CPU inside one is still busy with that collective. The workers' counters read
        here are one more reading for :func:`worker_spans`, taken where the launching thread
        takes none (while it waits).

        A collective that finished before the callback was attached fills it at once, on the
        attaching thread: its time is then only an upper bound of the end.
        """
        box = Completion(attached_by=threading.get_native_id())
        threads = self.threads

        def done(_: Any) -> None:
            tid = threading.get_native_id()
            box.thread = tid
            if threads is not None:
                read_at = time.perf_counter_ns()
                sched = threads.snapshot()
                box.sched = sched.get(tid)
                box.reading = (read_at, sched)
            box.end = time.perf_counter_ns()

        future_of(work).then(done)
        return box

    def settle(self, boxes: list[Completion], timeout_s: float = 1.0) -> None:
        """Completion callbacks may run just after ``wait()`` returns: give them a moment."""
        deadline = time.monotonic() + timeout_s
        while any(b.end is None for b in boxes) and time.monotonic() < deadline:
            time.sleep(0.0005)


class CudaClock:
    kind = "cuda_event"

    def __init__(self, device: torch.device):
        self.device = device
        self.observer = torch.cuda.Stream(device=device)
        self.threads = None

    def now(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, mark: Any, origin: Any) -> float:
        return origin.elapsed_time(mark)

    def completion(self, work: Any) -> Completion:
        """An event on the observer stream that fires when the NCCL work is done.

        ``wait()`` of a c10d Work and of a comm hook's CUDA future both make the *current*
        (observer) stream wait for the work's stream; neither blocks the host on the kernels.
        """
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.observer):
            work.wait()
            end.record(self.observer)
        return Completion(end=end)

    def settle(self, boxes: list[Completion], timeout_s: float = 1.0) -> None:
        torch.cuda.synchronize(self.device)


def queue_starts(launches: list[float], ends: list[float], lanes: int) -> list[float]:
    """When each collective started if ``lanes`` workers take them in launch order at once.

    A collective starts when it is launched *and* a worker is free, so the time it spent queued
    behind earlier buckets is not counted as its own. This is the fallback of
    :func:`worker_spans`: it cannot see a woken worker waiting for a CPU.
    """
    free = [float("-inf")] * max(1, lanes)
    starts = []
    for launch, end in zip(launches, ends, strict=True):
        worker = min(range(len(free)), key=free.__getitem__)
        start = min(max(launch, free[worker]), end)
        free[worker] = end
        starts.append(start)
    return starts


@dataclass(frozen=True)
class Poll:
    """The workers' counters at one moment (ms on the step's time base)."""

    t_ms: float
    sched: dict[int, Sched | None]


@dataclass(frozen=True)
class Collective:
    """One collective as the host saw it.

    Launched at ``launch_ms`` (``polls[first_poll]`` was read just before the launch and
    ``polls[attach_poll]`` just after its completion callback was attached); its callback ran at
    ``end_ms`` on worker ``thread`` whose counters were then ``end_sched``. ``inline``: it had
    already finished when the callback was attached (the launching thread lost its CPU to the
    worker, which ran the whole collective), so ``end_ms`` is only an upper bound and ``thread``
    is unknown.
    """

    launch_ms: float
    end_ms: float
    thread: int | None = None
    end_sched: Sched | None = None
    first_poll: int | None = None
    attach_poll: int | None = None
    inline: bool = False


def worker_spans(
    comms: list[Collective], polls: list[Poll], lanes: int
) -> list[tuple[float, float]]:
    """(start, end) of each collective as a worker ran it: what torch.profiler's range shows.

    In launch order, per collective on worker T:

    - start, T still running an earlier collective at the launch: the moment it finished that
      one (it takes the next queued collective at once; measured within tens of µs);
    - start, T idle: when it first got a CPU after the launch. Its counters, read just before
      the launch, at the hooks after it and in completion callbacks, show that moment: the
      first reading in which T has had one more time slice adds its wait for it, so the start
      is the launch plus that wait, kept between the last reading that showed no run and that
      reading (T may have been runnable already, or woken later, by something else). If T had
      run more than once by then (it started, slept waiting for the peer, ran again) that wait
      holds later waits too; the start lies between the last reading without a run and the
      launch plus the whole wait, and is placed halfway;
    - end: the completion callback, run by T when the collective is done, as it returns.

    A collective already done when its callback was attached (``inline``) ran while the
    launching thread had no CPU: its worker is the thread that ran since the launch and could
    have reached the queue first; its end is only bounded by the attach time. (On two quiet cores
    the launcher gets its CPU back as the worker finishes, tens of µs later; on an oversubscribed
    machine other processes may take it first, and the span comes out long.)

    Collectives whose worker or counters are unknown fall back to :func:`queue_starts`.
    """
    fallback = queue_starts([c.launch_ms for c in comms], [c.end_ms for c in comms], lanes)
    last_end: dict[int, float] = {}  # worker -> end of the last collective it ran
    spans = []
    for comm, guess in zip(comms, fallback, strict=True):
        tid = _inline_worker(comm, polls, last_end) if comm.inline else comm.thread
        start, end = guess, comm.end_ms
        if tid is not None:
            previous = last_end.get(tid)
            queued = previous is not None and previous > comm.launch_ms
            start = previous if queued else _first_run(comm, tid, polls)
            last_end[tid] = end
        start = min(max(start, comm.launch_ms), comm.end_ms)
        spans.append((start, min(max(end, start), comm.end_ms)))
    return spans


def _at(polls: list[Poll], index: int | None, tid: int) -> Sched | None:
    return None if index is None else polls[index].sched.get(tid)


def _inline_worker(comm: Collective, polls: list[Poll], last_end: dict[int, float]) -> int | None:
    """Which worker ran a collective that was done before its callback was attached.

    Of the threads that ran between the launch and the attach and were not still busy with an
    earlier collective, the one that reached the queue first (FIFO): a worker that finished an
    earlier collective in between reached it then, an idle one when it first got a CPU.
    """
    if comm.first_poll is None or comm.attach_poll is None:
        return None
    before, after = polls[comm.first_poll], polls[comm.attach_poll]
    reached: dict[int, float] = {}
    for tid, now in after.sched.items():
        then = before.sched.get(tid)
        if now is None or then is None or now.slices == then.slices:
            continue
        previous = last_end.get(tid, float("-inf"))
        if previous > after.t_ms:
            continue
        waited = (now.wait_ns - then.wait_ns) / 1e6
        reached[tid] = previous if previous > comm.launch_ms else comm.launch_ms + waited
    return min(reached, key=reached.__getitem__) if reached else None


def _first_run(comm: Collective, tid: int, polls: list[Poll]) -> float:
    """When idle worker ``tid`` first ran after ``comm``'s launch (see :func:`worker_spans`)."""
    base = _at(polls, comm.first_poll, tid)
    if base is None:
        return comm.launch_ms
    if comm.inline and comm.attach_poll is not None:  # done by the attach: read up to it
        later = polls[comm.first_poll + 1 : comm.attach_poll + 1]
    else:
        later = [p for p in polls[comm.first_poll + 1 :] if p.t_ms <= comm.end_ms]
    readings = [(p.t_ms, p.sched.get(tid)) for p in later]
    readings = [(t, s) for t, s in readings if s is not None]
    if comm.end_sched is not None:
        readings.append((comm.end_ms, comm.end_sched))
    still = comm.launch_ms  # the latest reading at which the worker had not yet run
    for t, s in readings:
        ran = s.slices - base.slices
        if ran <= 0:
            still = t
            continue
        latest = max(still, min(t, comm.launch_ms + (s.wait_ns - base.wait_ns) / 1e6))
        if ran == 1:
            return latest
        return (still + latest) / 2
    return comm.launch_ms


def merge_polls(polls: list[Poll], more: list[Poll]) -> tuple[list[Poll], list[int]]:
    """``polls`` and ``more`` in one time order, and where each of ``polls`` went.

    The launching thread's readings are indexed by the collectives (``first_poll``,
    ``attach_poll``); the completion callbacks' readings join them in between.
    """
    tagged = [(p.t_ms, 0, n, p) for n, p in enumerate(polls)]
    tagged += [(p.t_ms, 1, n, p) for n, p in enumerate(more)]
    tagged.sort(key=lambda x: x[:3])
    where = [0] * len(polls)
    for i, (_, theirs, n, _) in enumerate(tagged):
        if not theirs:
            where[n] = i
    return [p for *_, p in tagged], where
