"""Issue 27: SweepRunner given a pool whose rank died restarts that pool in place.

Before: ``run()`` saw the shared pool was not alive, started a pool of its own and left the
notebook's dead (BucketExplorer had been fixed for the same fault, issue 20 row 1c).
"""

from __future__ import annotations

import os
import signal
import time

import dplab
from dplab.widgets.sweep_runner import SweepRunner
from tests.conftest import child_pids

FAULT_BOUND_S = 30.0


def test_sweep_runner_restarts_a_shared_pool_whose_rank_died():
    before = child_pids()
    with dplab.Cluster(2, backend="gloo") as shared:
        sweep = SweepRunner(
            shared, model="mlp", caps=[0.25, 1.0], repeats=1, steps=1, batch_size=2,
            simulate=False,
        )  # fmt: skip
        try:
            pids = shared.run(os.getpid)
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            while shared.alive and time.monotonic() - t0 < FAULT_BOUND_S:
                time.sleep(0.01)
            assert not shared.alive
            rows = sweep.run()
            assert rows, sweep.message
            assert time.monotonic() - t0 < FAULT_BOUND_S
            assert sweep.cluster is shared and shared.alive  # the notebook's pool, usable again
            assert sorted({r["bucket_cap_mb"] for r in rows}) == [0.25, 1.0]
            assert sorted(shared.run(os.getpid)) != sorted(pids)  # fresh processes
        finally:
            sweep.close()
    assert child_pids() <= before
