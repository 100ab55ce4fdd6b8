"""Two ways to tell time in a DDP step, behind one small interface.

- :class:`HostClock` (CPU, gloo): ``perf_counter_ns`` at launch, and at completion a callback on
  the collective's future, which gloo's own worker thread runs the moment the all-reduce is
  done. The overlap on CPU is real: gloo reduces on its threads while autograd computes.
- :class:`CudaClock` (GPU, NCCL): ``torch.cuda.Event(enable_timing=True)`` recorded on the
  streams that do the work. The host only *enqueues* kernels, so host clocks would time the
  enqueueing, not the work. A bucket's ``ready`` event goes on the compute stream just before its
  all-reduce is enqueued (NCCL's stream waits on it); its ``end`` event goes on an otherwise idle
  observer stream made to wait for the NCCL work. Events are resolved after the step, so the
  step itself never synchronises.

A mark is whatever ``now()`` returns; ``ms(mark, origin)`` turns it into milliseconds.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class HostClock:
    kind = "host"

    def now(self) -> int:
        return time.perf_counter_ns()

    def ms(self, mark: Any, origin: Any) -> float:
        return (mark - origin) / 1e6

    def completion(self, work: Any) -> list[Any]:
        """A one-slot box that gloo's thread fills with the completion time."""
        box: list[Any] = [None]

        def done(_: Any) -> None:
            box[0] = time.perf_counter_ns()

        work.get_future().then(done)
        return box

    def settle(self, boxes: list[list[Any]], timeout_s: float = 1.0) -> None:
        """Completion callbacks may run just after ``wait()`` returns: give them a moment."""
        deadline = time.monotonic() + timeout_s
        while any(b[0] is None for b in boxes) and time.monotonic() < deadline:
            time.sleep(0.0005)


class CudaClock:
    kind = "cuda_event"

    def __init__(self, device: torch.device):
        self.device = device
        self.observer = torch.cuda.Stream(device=device)

    def now(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, mark: Any, origin: Any) -> float:
        return origin.elapsed_time(mark)

    def completion(self, work: Any) -> list[Any]:
        """An event on the observer stream that fires when the NCCL work is done."""
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.observer):
            work.wait()  # for NCCL: the *current* (observer) stream waits; the host does not
            end.record(self.observer)
        return [end]

    def settle(self, boxes: list[list[Any]], timeout_s: float = 1.0) -> None:
        torch.cuda.synchronize(self.device)


def queue_starts(launches: list[float], ends: list[float], lanes: int) -> list[float]:
    """When each collective really started, given when it was launched and when it ended.

    A backend runs collectives on ``lanes`` workers in launch order (NCCL: one stream; gloo: two
    threads by default). A collective starts when it is launched *and* a worker is free, so the
    time it spent queued behind earlier buckets is not counted as its own.
    """
    free = [float("-inf")] * max(1, lanes)
    starts = []
    for launch, end in zip(launches, ends, strict=True):
        worker = min(range(len(free)), key=free.__getitem__)
        start = min(max(launch, free[worker]), end)
        free[worker] = end
        starts.append(start)
    return starts
