"""The probes lessons 08 and 08b run on the ranks (``dplab.ddp.lesson_probes``).

Each probe is checked on 2 gloo ranks for what it reports, and the trace readings on a
hand-made ``StepTrace`` whose answer is known.
"""

from __future__ import annotations

import pytest

import dplab
from dplab.ddp import lesson_probes as P
from dplab.trace import StepTrace
from dplab.trace.step import Span


@pytest.fixture(scope="module")
def cluster():
    with dplab.Cluster(2, backend="gloo") as c:
        yield c


def test_average_by_hand_on_a_multi_bucket_plan(cluster):
    for n_buckets, worst in cluster.run(P.average_by_hand, "tiny-gpt", 0.25):
        assert n_buckets > 1 and worst == 0.0  # bit for bit: a + b, halved, either way


def test_launch_delays_are_after_the_last_gradient(cluster):
    for rows in cluster.run(P.launch_delays, "tiny-gpt", 0.25, steps=2):
        assert len(rows) == 2
        for step in rows:
            assert step and all(first <= last <= launch for first, last, launch in step)


def test_the_rebuild_takes_rank_0s_order(cluster):
    two = cluster.run(P.rebuild_two_orders)
    assert two[0]["arrived"] != two[1]["arrived"]
    assert two[0]["after"] == two[1]["after"] == [["b.bias", "b.weight"], ["a.bias", "a.weight"]]


def test_a_group_of_one_is_the_ranks_own_gradient(cluster):
    assert cluster.run(P.ddp_in_a_group_of_one) == [{"dplab": 0.0, "torch": 0.0}] * 2


def test_core_share_is_a_share_and_refuses_a_bad_duration():
    assert 0.0 < P.core_share(0.05) <= 1.05  # thread and wall clocks tick apart by a little
    with pytest.raises(ValueError, match="seconds must be > 0, got 0"):
        P.core_share(0)


def test_core_share_reads_a_thread_that_held_a_core_half_the_time(monkeypatch):
    """08 §6 asserts gloo's contention only where every rank's share is high: a share read
    wrong would skip that assert unseen, so the arithmetic is checked on scripted clocks."""
    wall = [0.0]

    def perf_counter() -> float:
        wall[0] += 1e-3
        return wall[0]

    monkeypatch.setattr(P.time, "perf_counter", perf_counter)
    monkeypatch.setattr(P.time, "thread_time", lambda: 0.5 * wall[0])
    assert P.core_share(0.3) == pytest.approx(0.5, abs=0.01)


def _step() -> StepTrace:
    """Backward 0-100 ms; bucket 0 ready at 10 (all-reduce 10-30), bucket 1 at 20 (95-120)."""
    spans = [
        Span("backward", "backward", 0.0, 100.0),
        Span("ready", "bucket_ready", 10.0, 10.0, bucket=0),
        Span("b0", "allreduce", 10.0, 30.0, bucket=0),
        Span("ready", "bucket_ready", 20.0, 20.0, bucket=1),
        Span("b1", "allreduce", 95.0, 120.0, bucket=1),
    ]
    return StepTrace(0, 2, "gloo", "cpu", "host", 0, spans)


def test_trace_readings():
    step = _step()
    assert P.overlapping_ready(step) == [(0, 1, 10.0)]
    assert P.backward_slack_ms(step) == {0: 90.0, 1: 80.0}
    assert P.summed_comm_ms(step) == 45.0
    assert P.buckets_with_room(step) == [0, 1]
