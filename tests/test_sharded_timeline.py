"""§9b's sharded step on the timeline: built from torch.profiler, checked against the counter.

The oracle for what ran is :class:`~dplab.sharding.wire.ShardedCommCounter` (torch.distributed's
door, on the training thread), which knows nothing of the profiler: the timeline's collectives,
read from the gloo worker threads' ranges, must be the same ones, kind by kind and byte by byte.
The pure part (events to spans) is checked on made-up events whose answer is known.
"""

from __future__ import annotations

from collections import Counter

import pytest

from dplab.sharding import SHARDED_GPT, fsdp2_available, sharded_step
from dplab.sharding.timeline import ProfiledEvent, steps_from_events, traced_sharded_step
from dplab.sharding.wire import wire_rows
from dplab.sim import Link
from dplab.sim.sharded import UnitProfile, simulate_sharded
from dplab.viz import timeline_figure

MAIN, WORKER = 1, 2


def _events(*extra: ProfiledEvent) -> list[ProfiledEvent]:
    """One 10 ms step: forward 0-4 ms (ops 0-1 and 3-4: a 2 ms gap), backward 4-8, optimizer
    8-10; a reduce-scatter launched at 5 ms runs on a worker 5-9 ms."""
    return [
        ProfiledEvent("dplab::step#0", MAIN, 0, 10_000),
        ProfiledEvent("dplab::forward", MAIN, 0, 4_000),
        ProfiledEvent("aten::mm", MAIN, 0, 1_000),
        ProfiledEvent("aten::mm", MAIN, 1_050, 1_100),  # 50 µs later: the same compute span
        ProfiledEvent("aten::mm", MAIN, 3_000, 4_000),
        ProfiledEvent("dplab::backward", MAIN, 4_000, 8_000),
        ProfiledEvent("aten::mm", MAIN, 4_000, 8_000),
        ProfiledEvent("dplab::optimizer", MAIN, 8_000, 10_000),
        ProfiledEvent("aten::add_", MAIN, 8_000, 10_000),
        ProfiledEvent("c10d::_reduce_scatter_base_", MAIN, 5_000, 5_100, 4096),
        ProfiledEvent("gloo:all_reduce", WORKER, 5_000, 9_000),
        ProfiledEvent("gloo:all_reduce", WORKER, 12_000, 13_000),  # a barrier after the step
        *extra,
    ]


def test_events_become_spans_kinds_and_exposure():
    events = _events(
        ProfiledEvent("c10d::_allgather_base_", MAIN, 1_200, 1_300, 2048),
        ProfiledEvent("gloo:all_gather", WORKER, 1_300, 3_000),  # during the forward gap
    )
    (step,) = steps_from_events(events, rank=0, world_size=2, method="zero3")
    kinds = Counter(s.kind for s in step.spans)
    assert kinds == {"forward": 2, "backward": 1, "optimizer": 1, "wait": 1,
                     "allgather": 1, "reduce_scatter": 1}  # fmt: skip
    (wait,) = step.of("wait")
    assert (wait.start_ms, wait.end_ms) == (1.1, 3.0)
    (gather,) = step.of("allgather")
    (scatter,) = step.of("reduce_scatter")
    assert (gather.nbytes, scatter.nbytes) == (2048, 4096)
    m = step.metrics
    # the all-gather ran while forward waited (1.3-3.0 ms: exposed); the reduce-scatter hid
    # under backward until 8 ms, then 1 ms under the optimizer, exposed: the same metrics as DDP
    assert m.t_comm_ms == pytest.approx(1.7 + 4.0)
    assert m.exposed_comm_ms == pytest.approx(1.7 + 1.0)
    assert m.n_allreduce == 0
    assert "1 all-gathers, 1 reduce-scatters" in timeline_figure([step]).layout.annotations[0].text


def test_a_launch_without_its_backend_range_is_refused_by_name():
    events = _events(ProfiledEvent("c10d::_allgather_base_", MAIN, 1_200, 1_300, 2048))
    with pytest.raises(ValueError, match="0 gloo:all_gather ranges but 1 launches"):
        steps_from_events(events, rank=0, world_size=2, method="zero3")


def test_unmarked_profiles_are_refused():
    with pytest.raises(ValueError, match="no dplab::step#k range"):
        steps_from_events(_events()[1:], rank=0, world_size=2, method="zero3")


METHODS = ["ddp", "zero1", "zero2", "zero3"]


@pytest.mark.parametrize("method", METHODS)
def test_the_timeline_has_the_collectives_the_counter_saw(method, cluster2):
    if method in ("zero2", "zero3") and not fsdp2_available():
        pytest.skip("this torch has no FSDP2")
    counted = cluster2.run(sharded_step, method, steps=1)
    traced = cluster2.run(traced_sharded_step, method, steps=2)
    op_of = {"allreduce": "all_reduce", "allgather": "all_gather",
             "reduce_scatter": "reduce_scatter", "broadcast": "broadcast"}  # fmt: skip
    # the simulator lays out the same collectives (counts only: a described model of the
    # same shape, one unit per block and the root)
    units = UnitProfile.uniform(SHARDED_GPT.n_layers, 4096, 1.0, root_bytes=4096)
    simulated = Counter(
        s.name.split()[0]  # "all_gather block1 (backward)": the counter's name for the kind
        for s in simulate_sharded(units, method, Link("any", 1e-5, 1e9), 2).spans
        if s.lane == "comm"
    )
    for result, steps in zip(counted, traced, strict=True):
        rows = wire_rows(result.records, result.world_size)
        want = Counter()
        want_bytes = Counter()
        for r in rows:
            want[r.op] += r.calls
            want_bytes[r.op] += r.tensor_bytes
        for step in steps:
            # torch's DDP (under ddp and zero1) broadcasts the model's buffers at each forward
            # from C++, a door the counter does not watch; the profiler sees them, in forward
            backward_start = min(s.start_ms for s in step.of("backward"))
            buffers = [s for s in step.of("broadcast") if s.start_ms < backward_start]
            assert not buffers or method in ("ddp", "zero1"), (method, buffers)
            spans = [s for s in step.spans if s.kind in op_of and s not in buffers]
            got = Counter(op_of[s.kind] for s in spans)
            assert got == want, (method, step.rank, step.step, got, want)
            if method != "zero1":  # the simulator prices ZeRO-1's broadcasts as one gather
                assert simulated == want, (method, simulated, want)
            got_bytes = Counter()
            for s in spans:
                got_bytes[op_of[s.kind]] += s.nbytes
            assert got_bytes == want_bytes, (method, got_bytes, want_bytes)
            m = step.metrics
            assert 0 < m.exposed_comm_ms <= m.t_comm_ms
            assert all(s.start_ms >= 0 for s in spans), method  # inside its step
