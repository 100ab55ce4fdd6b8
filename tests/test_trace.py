"""dplab.Tracer on real ranks, the metrics' interval arithmetic, and the trace files."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import dplab
from dplab.ddp import measure_ddp
from dplab.models import make_batch, make_model
from dplab.trace import Span, StepTrace, chrome_trace, load_rank, load_run, save_run
from dplab.trace.clocks import queue_starts
from dplab.trace.metrics import attribute, step_metrics, subtract, union

# -- interval arithmetic ----------------------------------------------------------------------


def test_union_subtract_and_attribute_on_a_known_case():
    assert union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    share = attribute([(4, 10)], [(0, (0, 6)), (1, (3, 9)), (2, (8, 10))])
    assert share == {0: 2.0, 1: 3.0, 2: 1.0}  # lowest active bucket owns each instant


def test_metrics_invariants_on_random_steps():
    rng = random.Random(1)
    for _ in range(200):
        spans = [Span("forward", "forward", 0, 10), Span("backward", "backward", 10, 40)]
        t = 12.0
        for b in range(rng.randint(1, 8)):
            start = t + rng.uniform(0, 10)
            end = start + rng.uniform(0.1, 15)
            spans.append(Span(f"all-reduce bucket {b}", "allreduce", start, end, b, 100))
            t = start
        m = step_metrics(spans)
        assert 0 <= m.exposed_comm_ms <= m.t_comm_ms + 1e-9
        assert 0 <= m.overlap_fraction <= 1
        assert abs(sum(m.exposed_ms.values()) - m.exposed_comm_ms) < 1e-9
        assert m.t_step_ms >= m.predicted_step_ms - 1e-9  # the bound can't be beaten


def test_queue_starts_counts_only_the_collectives_own_time():
    # three launched at once on one worker: each waits for the previous
    assert queue_starts([0, 0, 0], [5, 9, 12], lanes=1) == [0, 5, 9]
    # two workers: the third waits for the first free one
    assert queue_starts([0, 0, 0], [5, 9, 12], lanes=2) == [0, 0, 5]
    # launched after the previous finished: starts at its launch
    assert queue_starts([0, 10], [5, 12], lanes=1) == [0, 10]


# -- real ranks -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(cluster2) -> list[list[StepTrace]]:
    return cluster2.run(measure_ddp, "tiny-gpt", bucket_cap_mb=0.25, steps=3, warmup=1)


def test_one_allreduce_per_bucket_per_step_never_before_ready(measured):
    for rank_steps in measured:
        assert len(rank_steps) == 3
        for step in rank_steps:
            ready = {s.bucket: s.start_ms for s in step.of("bucket_ready")}
            comms = step.of("allreduce")
            assert (
                sorted(s.bucket for s in comms) == list(range(len(step.buckets))) == sorted(ready)
            )
            for s in comms:
                assert s.start_ms >= ready[s.bucket] - 1e-6
                assert s.end_ms >= s.start_ms
                assert s.nbytes == step.buckets[s.bucket].nbytes


def test_measured_metrics_are_consistent(measured):
    for rank_steps in measured:
        for step in rank_steps:
            m = step.metrics
            assert 0 <= m.exposed_comm_ms <= m.t_comm_ms
            assert 0 <= m.overlap_fraction <= 1
            assert m.n_allreduce == len(step.buckets)
            assert m.t_step_ms >= m.predicted_step_ms
            kinds = {s.kind for s in step.spans}
            assert {
                "forward",
                "backward",
                "bucket_ready",
                "allreduce",
                "wait",
                "optimizer",
            } <= kinds


def test_rank_lanes_share_one_time_base(measured):
    # every rank leaves the last all-reduce together, so their ends line up on the common base
    for a, b in zip(measured[0], measured[1], strict=True):
        end_a = a.origin_ms + max(s.end_ms for s in a.of("allreduce"))
        end_b = b.origin_ms + max(s.end_ms for s in b.of("allreduce"))
        assert abs(end_a - end_b) < 20.0


def test_round_trip_through_dict_json_and_files(measured, tmp_path):
    step = measured[0][-1]
    again = StepTrace.from_dict(json.loads(json.dumps(step.to_dict())))
    assert again.to_dict() == step.to_dict()
    paths = save_run(measured, tmp_path, {"command": "test"})
    assert load_run(tmp_path)[1][2].to_dict() == measured[1][2].to_dict()
    chrome = json.loads(paths["chrome"].read_text())
    assert chrome["distributedInfo"]["world_size"] == 2
    assert {e["pid"] for e in chrome["traceEvents"]} == {0, 1}
    comm = [e for e in chrome["traceEvents"] if e.get("cat") == "allreduce"]
    assert comm and all(e["ph"] == "X" and e["tid"] == 1 and e["dur"] >= 0 for e in comm)
    assert all({"bucket", "bytes", "params"} <= set(e["args"]) for e in comm)
    assert all(e["tid"] == 0 for e in chrome["traceEvents"] if e.get("cat") == "backward")


def test_truncated_and_foreign_files_are_clear_errors(measured, tmp_path):
    path = save_run(measured, tmp_path)["rank0"]
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="cut short"):
        load_rank(path)
    path.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not a dplab trace file"):
        load_rank(path)
    with pytest.raises(ValueError, match="not a dplab step trace"):
        StepTrace.from_dict({"format": "something else"})
    with pytest.raises(ValueError, match="no steps"):
        chrome_trace([])


def test_atomic_write_leaves_the_old_file_when_interrupted(tmp_path, monkeypatch):
    from dplab.trace import files

    target = tmp_path / "rank0.json"
    target.write_text("previous")

    def boom(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        files.write_atomic(target, "new")
    assert target.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.json"]


def _micro_batches() -> list:
    return measure_ddp("tiny-gpt", bucket_cap_mb=0.25, steps=2, warmup=0, micro_batches=3)


def test_no_sync_micro_batches_fold_into_one_step(cluster2):
    for rank_steps in cluster2.run(_micro_batches):
        assert len(rank_steps) == 2
        for step in rank_steps:
            assert len(step.of("forward")) == 3 and len(step.of("backward")) == 3
            assert step.metrics.n_allreduce == len(step.buckets)  # one per bucket, not per micro


class _SlowWork:
    """A collective that completes ``delay_s`` after the real one: a planted slow link."""

    def __init__(self, work, delay_s: float):
        self._future = torch.futures.Future()

        def finish():
            work.wait()
            time.sleep(delay_s)
            self._future.set_result(None)

        threading.Thread(target=finish, daemon=True).start()

    def wait(self):
        self._future.wait()
        return True

    def get_future(self):
        return self._future


def _exposed_with_delay(delay_s: float) -> float:
    tracer = dplab.Tracer()
    ddp = dplab.DDP(
        make_model("tiny-gpt"), bucket_cap_mb=0.25, first_bucket_cap_mb=0.25, tracer=tracer
    )
    last = len(ddp.buckets) - 1
    real = dist.all_reduce

    def slow_last_bucket(tensor, *a, **k):
        work = real(tensor, *a, **k)
        is_last = tensor.data_ptr() == ddp.bucket_buffers[last].data_ptr()
        return _SlowWork(work, delay_s) if is_last else work

    dist.all_reduce = slow_last_bucket
    try:
        for step in range(4):
            x, y = make_batch("tiny-gpt", 4, seed=step)
            ddp(x, y).backward()
    finally:
        dist.all_reduce = real
    exposed = sorted(s.metrics.exposed_comm_ms for s in tracer.steps[1:])
    return exposed[1]  # median of 3


def test_a_planted_delay_in_the_comm_path_shows_up_as_exposed_time(cluster2):
    base = max(cluster2.run(_exposed_with_delay, 0.0))
    slow = max(cluster2.run(_exposed_with_delay, 0.1))
    assert 70 < slow - base < 150  # 100 ms planted on the last bucket, all of it exposed


def _collections_between_launch_and_attach() -> dict:
    import gc

    tracer = dplab.Tracer()
    ddp = dplab.DDP(make_model("tiny-gpt"), bucket_cap_mb=0.25, tracer=tracer)
    state = {"inside": False, "collections": 0}
    real = dist.all_reduce

    def launch_then_make_garbage(tensor, *a, **k):
        work = real(tensor, *a, **k)
        state["inside"] = True
        for _ in range(5000):  # enough cycles for several automatic collections
            cycle: list = []
            cycle.append(cycle)
        return work

    def seen(phase, info):
        if phase == "start" and state["inside"]:
            state["collections"] += 1

    original = tracer.allreduce_launched

    def launched(*a, **k):
        state["inside"] = False
        original(*a, **k)

    tracer.allreduce_launched = launched
    gc.callbacks.append(seen)
    dist.all_reduce = launch_then_make_garbage
    try:
        x, y = make_batch("tiny-gpt", 4, seed=0)
        ddp(x, y).backward()
    finally:
        dist.all_reduce = real
        gc.callbacks.remove(seen)
    return {"collections": state["collections"], "gc_enabled": gc.isenabled()}


def test_no_garbage_collection_falls_between_a_launch_and_its_callback():
    (r,) = dplab.launch(_collections_between_launch_and_attach, 1)
    assert r == {"collections": 0, "gc_enabled": True}


def _comm_hook_raises_under_a_tracer() -> dict:
    import gc

    ddp = dplab.DDP(make_model("tiny-gpt"), bucket_cap_mb=0.25, tracer=dplab.Tracer())

    def broken(state, bucket):
        raise ValueError("a broken comm hook")

    ddp.register_comm_hook(None, broken)
    x, y = make_batch("tiny-gpt", 4, seed=0)
    try:
        ddp(x, y).backward()
    except Exception as e:  # the engine may wrap it
        return {"error": str(e), "gc_enabled": gc.isenabled()}
    return {"error": None, "gc_enabled": gc.isenabled()}


def test_a_failed_launch_leaves_garbage_collection_on():
    (r,) = dplab.launch(_comm_hook_raises_under_a_tracer, 1)
    assert "a broken comm hook" in r["error"]
    assert r["gc_enabled"]


# -- the trace command line -----------------------------------------------------------------------


def _trace_cli_files_are_complete(out) -> None:
    """What `python -m dplab trace` must leave: every rank, a Chrome trace, an offline page."""
    steps = load_run(out)
    assert [s[0].rank for s in steps] == [0, 1]
    assert all(len(s) == 2 for s in steps)
    recorded = json.loads((out / "rank0.json").read_text())["meta"]["recorded"]
    assert recorded["command"].startswith("python -m dplab trace")
    assert recorded["machine"]["torch"] == torch.__version__
    chrome = json.loads((out / "trace.json").read_text())
    assert {e["pid"] for e in chrome["traceEvents"] if e.get("ph") == "X"} == {0, 1}
    html = (out / "timeline.html").read_text()
    assert '<script src="http' not in html  # plotly.js is inside, not fetched from a CDN
    assert "Plotly.newPlot" in html and len(html) > 1_000_000


def test_trace_cli_writes_rank_files_chrome_trace_and_an_offline_page(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dplab", "trace", "--world-size", "2", "--bucket-cap-mb", "0.5"]
    cmd += ["--steps", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 steps on 2 ranks (gloo)" in done.stdout
    _trace_cli_files_are_complete(out)


def test_trace_cli_runs_under_torchrun(tmp_path):
    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd += ["-m", "dplab", "trace", "--steps", "2", "--out", str(out)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    _trace_cli_files_are_complete(out)
