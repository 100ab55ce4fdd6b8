"""torch's own DDP tests on dplab.DDP, the part that fits in CI, and proof the runner can fail.

The full table (every DDP test of torch's ``distributed_test.py``, world sizes 2 and 3, torch's
DDP as the control) is ``python -m tests.conformance`` (docs/ddp-conformance.md). Here:

- a subset at world size 2, chosen so that each idea torch's tests check is covered once:
  gradients against local training (directly and under the CPU shim), comm hooks, buffers
  reassigned after wrapping, uneven inputs under ``join()``, static graph with two forwards,
  per-bucket caps, undefined gradients, skipped unused buckets, mixed precision's
  low-precision twins, the logging data; torch's DDP passes each of them too
  (the control runs in the same test, so a test torch stops passing is not counted silently);
- three planted bugs in a copy of dplab (``tests/mutation_harness.copy_package``), each turning
  at least one of torch's tests red.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.runner import run_tests
from tests.mutation_harness import Mutation, assert_anchors_once, copy_package

DIRECT = ["test_DistributedDataParallelCPU", "test_ddp_logging_data_cpu"]
SHIMMED = [
    "test_ddp_hook_parity_allreduce",
    "test_ddp_broadcast_buffer",
    "test_ddp_uneven_input_join_disable",
    "test_static_graph_multi_forward",
    "test_ddp_bucket_cap_mb_list",
    "test_undefined_grad_parity_unused_parameters",
    "test_skip_all_reduce_unused_parameters",
    "test_ddp_native_mixed_precision_ignored_params",
]

MUTATIONS = [
    (
        Mutation(
            name="no 1/N",
            path="ddp/ddp.py",
            anchor="n = self._divisor()",
            replacement="n = 1  # planted: buckets summed, not averaged",
            claim="DDP averages gradients: equal to local training on the global batch",
            caught_by="test_DistributedDataParallelCPU",
        ),
        False,
    ),
    (
        Mutation(
            name="bucket order reversed",
            path="ddp/plans.py",
            anchor="self._build_buckets(self._rebuilt_plan(order.cpu().tolist()))",
            replacement="self._build_buckets(self._rebuilt_plan(order.cpu().tolist()[::-1]))",
            claim="buckets are rebuilt in the order gradients became ready",
            caught_by="test_ddp_logging_data_cpu",
        ),
        False,
    ),
    (
        Mutation(
            name="buffers never broadcast",
            path="ddp/buffer_sync.py",
            anchor="broadcast_from(buffers, global_src, self.process_group)",
            replacement="pass  # planted: buffers never broadcast",
            claim="rank 0's buffers are broadcast before every synchronising forward",
            caught_by="test_ddp_broadcast_buffer",
        ),
        True,
    ),
]


def _outcomes(ddp: str, shim: bool, tests: list[str], pythonpath: Path | None = None) -> dict:
    kwargs = {"pythonpath": pythonpath} if pythonpath is not None else {}
    return {r.test: r for r in run_tests(tests, ddp, 2, shim, time_limit=120, **kwargs)}


@pytest.mark.slow
@pytest.mark.parametrize("shim", [False, True], ids=["direct", "shim"])
def test_torch_ddp_tests_pass_on_dplab_where_they_pass_on_torch(shim):
    tests = SHIMMED if shim else DIRECT
    torch_r = _outcomes("torch", shim, tests)
    dplab_r = _outcomes("dplab", shim, tests)
    for t in tests:
        assert torch_r[t].outcome == "pass", f"torch's own DDP no longer passes {t}: {torch_r[t]}"
        assert dplab_r[t].outcome == "pass", f"dplab.DDP fails torch's {t}: {dplab_r[t].detail}"


@pytest.mark.slow
@pytest.mark.parametrize("mutation,shim", MUTATIONS, ids=[m.name for m, _ in MUTATIONS])
def test_a_planted_bug_turns_a_torch_test_red(mutation, shim, tmp_path):
    assert_anchors_once([mutation])
    copy_package(tmp_path, mutation)
    r = _outcomes("dplab", shim, [mutation.caught_by], pythonpath=tmp_path)[mutation.caught_by]
    assert r.outcome == "fail", (
        f"planted bug {mutation.name!r} ({mutation.claim}) left torch's {mutation.caught_by} "
        f"{r.outcome}: the conformance run would not notice it"
    )
    assert "AssertionError" in r.detail, f"{mutation.caught_by} failed, but not on a check: {r}"
