"""One rank of the conformance pool: runs torch's tests one after another, each in its own
process group, as torch's ``TestDistBackend._run`` runs one.

The coordinator (:mod:`tests.conformance.runner`) writes one JSON line per test on stdin:
``{"test", "init_file", "temp_dir", "out"}``. For each, this rank sets torch's environment
(``TEMP_DIR``, ``INIT_METHOD``), joins a fresh gloo process group through the test's own
``file://`` store, runs the test method as torch's ``run_test`` does, destroys the group, and
writes ``{"rank", "outcome", "detail"}`` to ``out`` (outcome: pass, fail, skip). A test that
hangs is the coordinator's to kill: it owns this process's session.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import unittest
from contextlib import nullcontext
from datetime import timedelta


def _skip_reason(code: object) -> str | None:
    from torch.testing._internal.common_distributed import TEST_SKIPS

    for skip in TEST_SKIPS.values():
        if code == skip.exit_code:
            return skip.message
    return None


def run_one(rank: int, world: int, cmd: dict) -> dict:
    """Run ``cmd["test"]`` on this rank; the outcome and its detail (a traceback's tail)."""
    import torch.distributed as dist
    from torch.testing._internal import common_utils

    from tests.conformance import shim, suite

    os.environ["TEMP_DIR"] = cmd["temp_dir"]
    os.environ["INIT_METHOD"] = "file://" + cmd["init_file"]
    suite.dt.Barrier.barrier_id = 0
    name = cmd["test"]
    timeout = suite.dt.CUSTOM_PG_TIMEOUT.get(name, suite.dt.default_pg_timeout)
    dist.init_process_group(
        "gloo",
        init_method="file://" + cmd["init_file"],
        world_size=world,
        rank=rank,
        timeout=timedelta(seconds=timeout),
    )
    test = suite.Conformance(name)
    test.rank, test.file_name = rank, cmd["init_file"]
    test._barrier()
    common_utils.set_rng_seed()
    outcome, detail = "pass", ""
    try:
        with shim.CudaToCpu() if suite.SHIM else nullcontext():
            getattr(test, name)()
    except unittest.SkipTest as e:
        outcome, detail = "skip", str(e)
    except SystemExit as e:  # torch's skip decorators exit with a TEST_SKIPS code
        reason = _skip_reason(e.code)
        outcome = "skip" if reason else "fail"
        detail = reason or f"exited with {e.code}"
    except BaseException:
        outcome, detail = "fail", traceback.format_exc()[-4000:]
    if outcome == "pass":
        test._barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"rank": rank, "outcome": outcome, "detail": detail}


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "0"  # the Python error, not pages of C++
    from tests.conformance import suite  # noqa: F401  (import once, before the first test)

    print("ready", flush=True, file=sys.stderr)
    for line in sys.stdin:
        cmd = json.loads(line)
        result = run_one(rank, world, cmd)
        tmp = cmd["out"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, cmd["out"])


if __name__ == "__main__":
    main()
