"""The widgets under bad input and dead pools (docs/reliability.md): MemoryWall refuses what its
slider would clamp, a cap below every slider stop is still measured, and BucketExplorer restarts a
pool whose rank died, in place.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from dplab.ddp.buckets import bucket_plan
from dplab.models import make_model
from tests.conftest import child_pids

FAULT_BOUND_S = 30.0  # the bound from the fault to the error


@pytest.mark.parametrize(("n_params", "clamped"), [(1e13, "1e+12"), (5e6, "1e+08")])
def test_memory_wall_refuses_a_parameter_count_its_slider_would_clamp(n_params, clamped):
    """Before: ``MemoryWall(model="custom", n_params=1e13)`` drew a 1e12-parameter model."""
    from dplab.widgets.memory import MemoryWall

    with pytest.raises(ValueError) as e:
        MemoryWall(model="custom", n_params=n_params)
    text = str(e.value)
    assert f"n_params={n_params:g}" in text and "1e+08..1e+12" in text and clamped in text
    wall = MemoryWall(model="custom", n_params=2e11)  # inside the range: drawn as asked
    assert wall.fit.n_params == 2 * 10**11


def _expected_buckets(model: str, cap: float) -> int:
    rows = [
        (n, p.numel(), p.numel() * 4, "f32")
        for n, p in reversed(list(make_model(model).named_parameters()))
    ]
    return len(bucket_plan(rows, bucket_cap_mb=cap, first_bucket_cap_mb=min(cap, 1.0)))


def test_a_cap_below_every_slider_stop_is_measured(cluster2):
    """Before: ``set_bucket_cap(0.005)`` showed "0.005 MiB" and never re-measured: the new
    option became the slider's first, the value was already 0.005, and no change event came."""
    from dplab.widgets.bucket_explorer import BucketExplorer

    ex = BucketExplorer(cluster2, model="mlp", bucket_cap_mb=1.0, batch_size=2)
    try:
        assert _expected_buckets("mlp", 0.005) != _expected_buckets("mlp", 1.0)
        before = ex.traces
        ex.set_bucket_cap(0.005)
        assert ex.message == "" and ex.bucket_cap_mb == 0.005
        assert ex.traces is not before and ex.traces[0].meta["bucket_cap_mb"] == 0.005
        assert ex.n_buckets == _expected_buckets("mlp", 0.005)
        kept = ex.traces
        ex.set_bucket_cap(1e-12)
        assert all(s in ex.message for s in ("bucket cap", "1e-12", "0 bytes", "at least 1 byte"))
        assert "kept 0.005 MiB" in ex.message and ex.traces is kept
    finally:
        ex.close()


def test_bucket_explorer_restarts_a_pool_whose_rank_died(capsys):
    """Before: the widget said "a stopped pool is restarted" but never restarted the pool it
    was given (first: a bare BrokenPipeError from the dead pool; with ``alive`` truthful: a
    different, new pool, while the notebook's own stayed dead)."""
    import dplab
    from dplab.widgets.bucket_explorer import BucketExplorer

    before = child_pids()
    with dplab.Cluster(2, backend="gloo") as shared:
        ex = BucketExplorer(shared, model="mlp", bucket_cap_mb=1.0, batch_size=2)
        try:
            pids = shared.run(os.getpid)
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            while shared.alive and time.monotonic() - t0 < FAULT_BOUND_S:
                time.sleep(0.01)
            assert not shared.alive
            old = ex.traces
            ex.set_bucket_cap(0.25)
            assert ex.message == "", ex.message
            assert time.monotonic() - t0 < FAULT_BOUND_S
            assert ex.cluster is shared and shared.alive  # restarted in place, usable again
            assert ex.traces is not old and ex.n_buckets == _expected_buckets("mlp", 0.25)
            assert sorted(shared.run(os.getpid)) != sorted(pids)  # fresh processes
        finally:
            ex.close()
    assert child_pids() <= before
