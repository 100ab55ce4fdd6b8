"""The CUDA-event path of the tracer, run on CPU with stand-ins for events and streams.

No GPU is lent to every session, so the plumbing of :class:`CudaClock` (ready event before the
launch, an end event on the observer stream after ``work.wait()`` there, resolution after the
step with one synchronize) is exercised here with fakes; tests/gpu/ checks it on a real GPU.
"""

from __future__ import annotations

import contextlib
import time

import torch

import dplab
from dplab.models import make_batch, make_model


class FakeEvent:
    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.t: int | None = None
        self.stream = None

    def record(self, stream=None):
        self.t = time.perf_counter_ns()
        self.stream = stream

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None, "an event was resolved before recording"
        return (end.t - self.t) / 1e6


class FakeStream:
    def __init__(self, device=None):
        self.device = device


def _traced_with_fake_cuda() -> dict:
    from dplab.trace import clocks, tracer

    log = {"synchronize": 0, "observer_records": 0}
    current = {"stream": None}

    @contextlib.contextmanager
    def stream(s):
        previous, current["stream"] = current["stream"], s
        try:
            yield
        finally:
            current["stream"] = previous

    class Recording(FakeEvent):
        def record(self, stream=None):
            super().record(stream)
            if stream is not None and stream is current["stream"]:
                log["observer_records"] += 1

    def synchronize(device=None):
        log["synchronize"] += 1

    clocks.torch.cuda.Event = Recording
    clocks.torch.cuda.Stream = FakeStream
    clocks.torch.cuda.stream = stream
    clocks.torch.cuda.synchronize = synchronize
    tracer.pick_clock = lambda backend, device: clocks.CudaClock(torch.device("cpu"))
    tr = dplab.Tracer()
    ddp = dplab.DDP(make_model("tiny-gpt"), bucket_cap_mb=0.5, first_bucket_cap_mb=0.5, tracer=tr)
    for step in range(2):
        x, y = make_batch("tiny-gpt", 4, seed=step)
        ddp(x, y).backward()
    syncs_before = log["synchronize"]
    steps = tr.steps
    return {
        "clock": steps[-1].clock,
        "n_buckets": len(ddp.buckets),
        "spans": [s.to_dict() for s in steps[-1].spans],
        "observer_records": log["observer_records"],
        "syncs_at_resolve": log["synchronize"] - syncs_before,
    }


def test_cuda_clock_plumbing_with_fake_events():
    (r,) = dplab.launch(_traced_with_fake_cuda, 1)
    assert r["clock"] == "cuda_event"
    assert r["observer_records"] == 2 * r["n_buckets"]  # one end event per bucket per step
    assert r["syncs_at_resolve"] == 1  # resolved after the step, with one synchronize
    ready = {s["bucket"]: s["start_ms"] for s in r["spans"] if s["kind"] == "bucket_ready"}
    comms = [s for s in r["spans"] if s["kind"] == "allreduce"]
    assert len(comms) == r["n_buckets"]
    for s in comms:
        assert ready[s["bucket"]] <= s["start_ms"] <= s["end_ms"]
