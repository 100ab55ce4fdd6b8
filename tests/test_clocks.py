"""The CUDA-event path of the tracer, run on CPU with stand-ins for events and streams.

No GPU is lent to every session, so the plumbing of :class:`CudaClock` (ready event before the
launch, an end event on the observer stream after ``work.wait()`` there, resolution after the
step with one synchronize) is exercised here with fakes; tests/gpu/ checks it on a real GPU.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import dplab
from dplab.models import make_batch, make_model
from dplab.trace import clocks
from dplab.trace.clocks import Collective, Poll, Sched, queue_starts, worker_spans


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


# -- when a gloo worker really began a collective (clocks.worker_spans) ------------------------

A, B = 101, 102  # two worker threads


def _s(cpu: int, wait_ms: float, slices: int) -> Sched:
    return Sched(cpu, int(wait_ms * 1e6), slices)


def test_queued_collective_starts_when_its_worker_finished_the_previous_one():
    polls = [
        Poll(0.0, {A: _s(0, 0, 5), B: _s(0, 0, 7)}),
        Poll(1.0, {A: _s(0, 0, 6), B: _s(0, 0, 7)}),
    ]
    comms = [
        Collective(0.0, 4.0, thread=A, end_sched=_s(1, 0.0, 6), first_poll=0),
        Collective(1.0, 6.0, thread=A, end_sched=_s(2, 0.0, 6), first_poll=1),
    ]
    assert worker_spans(comms, polls, lanes=2) == [(0.0, 4.0), (4.0, 6.0)]


def test_idle_worker_starts_after_its_wait_for_a_cpu():
    # launched at 1.0; B had no run at 1.3, one run by 2.5 (having waited 0.8 ms for a CPU)
    polls = [
        Poll(1.0, {A: _s(0, 0, 5), B: _s(0, 3.0, 7)}),
        Poll(1.3, {A: _s(0, 0, 5), B: _s(0, 3.0, 7)}),
        Poll(2.5, {A: _s(0, 0, 5), B: _s(0, 3.8, 8)}),
    ]
    comm = Collective(1.0, 4.0, thread=B, end_sched=_s(9, 4.5, 11), first_poll=0)
    assert worker_spans([comm], polls, lanes=2) == [(pytest.approx(1.8), 4.0)]
    # seen only at the end, after several runs: its waits include later ones, so the start
    # lies between the last reading without a run (1.3) and launch + all waits (2.5): halfway
    late = Collective(1.0, 4.0, thread=B, end_sched=_s(9, 4.5, 11), first_poll=0)
    assert worker_spans([late], polls[:2], lanes=2) == [(pytest.approx(1.9), 4.0)]
    quiet = Collective(1.0, 4.0, thread=B, end_sched=_s(9, 3.1, 11), first_poll=0)
    assert worker_spans([quiet], polls[:2], lanes=2) == [(pytest.approx(1.3), 4.0)]


def test_a_wait_for_a_cpu_is_kept_between_the_readings():
    # B was runnable before the launch: by 1.2 it had run once, its wait up by 2 ms (mostly
    # before the launch), so it began no later than that reading
    polls = [Poll(1.0, {B: _s(0, 3.0, 7)}), Poll(1.2, {B: _s(0, 5.0, 8)})]
    early = Collective(1.0, 4.0, thread=B, first_poll=0)
    assert worker_spans([early], polls, lanes=2) == [(pytest.approx(1.2), 4.0)]
    # B was woken by something else, later: no run yet at 2.0, one run without a wait by 2.4
    polls = [Poll(1.0, {B: _s(0, 3.0, 7)}), Poll(2.0, {B: _s(0, 3.0, 7)})]
    polls.append(Poll(2.4, {B: _s(0, 3.0, 8)}))
    woken_later = Collective(1.0, 4.0, thread=B, first_poll=0)
    assert worker_spans([woken_later], polls, lanes=2) == [(pytest.approx(2.0), 4.0)]


def test_completion_readings_join_the_launching_threads_in_time_order():
    ours = [Poll(0.0, {}), Poll(2.0, {}), Poll(5.0, {})]
    theirs = [Poll(1.0, {A: None}), Poll(2.0, {A: None}), Poll(7.0, {A: None})]
    merged, where = clocks.merge_polls(ours, theirs)
    assert [p.t_ms for p in merged] == [0.0, 1.0, 2.0, 2.0, 5.0, 7.0]
    assert [merged[i] for i in where] == ours


def test_collective_done_before_its_callback_was_attached():
    # B ran it (one run after waiting 0.5 ms); A ran too, but was busy until 3.0 with another
    polls = [
        Poll(0.0, {A: _s(0, 0, 5), B: _s(0, 0, 7)}),
        Poll(1.0, {A: _s(0, 0, 5), B: _s(0, 0, 7)}),
        Poll(2.0, {A: _s(0, 0, 6), B: _s(0, 0.5, 8)}),
    ]
    comms = [
        Collective(0.0, 3.0, thread=A, end_sched=_s(1, 0, 6), first_poll=0),
        Collective(1.0, 1.99, first_poll=1, attach_poll=2, inline=True),
    ]
    # (A itself had not run by 1.0, so its own collective began there)
    assert worker_spans(comms, polls, lanes=2) == [(1.0, 3.0), (pytest.approx(1.5), 1.99)]


def test_unknown_worker_falls_back_to_the_queue_rule():
    comms = [Collective(0.0, 5.0), Collective(0.0, 9.0), Collective(0.0, 12.0)]
    starts = [s for s, _ in worker_spans(comms, [], lanes=2)]
    assert starts == queue_starts([0, 0, 0], [5, 9, 12], lanes=2) == [0, 0, 5]


def _gloo_workers_seen() -> dict:
    threads = clocks.WorkerThreads.find()
    # 16 MB: long enough that the callback is nearly always attached before the end (a CI run
    # once saw 4 KB finish first, when the attaching thread, not a worker, fills the box)
    box = clocks.HostClock(threads).completion(
        torch.distributed.all_reduce(torch.ones(4_000_000), async_op=True).get_future()
    )
    clocks.HostClock().settle([box])
    return {"tids": list(threads.tids) if threads else None, "box": box}


def test_gloo_workers_are_found_and_a_future_reports_its_thread():
    for r in dplab.launch(_gloo_workers_seen, 2):
        assert r["tids"] is not None and len(r["tids"]) == 2  # gloo's default pool of threads
        end, tid, sched, attacher, (read_at, every) = r["box"]
        assert end is not None
        if tid in r["tids"]:  # a worker ran the callback: its own counters came with it
            assert isinstance(sched, Sched)
        else:  # done before the attach: the attaching thread, which is no worker, filled it
            assert tid == attacher and sched is None
        assert read_at <= end and sorted(every) == sorted(r["tids"])  # all, read before the end
