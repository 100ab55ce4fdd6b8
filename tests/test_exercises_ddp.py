"""The §8 exercise checker: the reference passes, typical mistakes fail with a useful hint."""

from __future__ import annotations

from dplab.exercises.checks import FAILED, NOT_ATTEMPTED, PASSED
from dplab.exercises.ddp import (
    case_from_trace,
    cases,
    check_exposed_buckets,
    reference_exposed_buckets,
)
from dplab.sim import BackwardProfile, ParamTiming, get_link, simulate


def test_the_reference_answer_passes_and_the_cases_are_not_trivial():
    result = check_exposed_buckets(reference_exposed_buckets)
    assert result.status == PASSED, result.message
    every = cases()
    for c in every:  # backward ends with its last gradient, as §4 measures it
        assert max(c.ready_ms) == c.backward_end_ms, c.label
        assert len(c.ready_ms) - 1 in c.exposed, c.label  # so the last bucket is exposed
    sets = [c.exposed for c in every]
    assert any(len(s) == 1 for s in sets)  # only the last bucket
    assert any(len(s) > 1 for s in sets)  # a queue that spills over


def test_forgetting_the_queue_fails_with_the_hint():
    def no_queue(ready, comm, end):
        return {b for b, (r, c) in enumerate(zip(ready, comm, strict=True)) if r + c > end}

    result = check_exposed_buckets(no_queue)
    assert result.status == FAILED
    assert "max(its ready time, the previous all-reduce's end)" in result.message


def test_only_the_last_bucket_is_not_always_right():
    result = check_exposed_buckets(lambda ready, comm, end: {len(ready) - 1})
    assert result.status == FAILED and "the simulator says" in result.message


def test_untouched_and_broken_answers():
    def untouched(ready, comm, end):
        raise NotImplementedError

    assert check_exposed_buckets(untouched).status == NOT_ATTEMPTED
    assert check_exposed_buckets(None).status == NOT_ATTEMPTED
    assert "raised ZeroDivisionError" in check_exposed_buckets(lambda r, c, e: 1 / 0).message
    assert "return a set" in check_exposed_buckets(lambda r, c, e: 3).message


def test_a_case_reads_the_simulated_step_back():
    profile = BackwardProfile(
        "toy",
        tuple(
            ParamTiming(f"l{i}", 250_000, 1_000_000, "float32", 10.0 * (4 - i)) for i in range(4)
        ),
        5.0,
        40.0,
        1.0,
    )
    trace = simulate(
        profile, bucket_cap_mb=0.9, first_bucket_cap_mb=0.9, world_size=8, link=get_link("25gbe")
    )
    case = case_from_trace(trace)
    assert case.ready_ms == [10.0, 20.0, 30.0, 40.0] and case.backward_end_ms == 40.0
    assert reference_exposed_buckets(case.ready_ms, case.comm_ms, 40.0) == case.exposed
    assert 3 in case.exposed  # the last bucket is ready when backward ends: always exposed
    assert check_exposed_buckets(reference_exposed_buckets, profile).status == PASSED
