"""torch's DDP knobs on 2 gloo ranks (``dplab.ddp.torch_knobs``), each checked against torch.

The oracle is torch itself: its own ``_compute_bucket_assignment_by_size`` for the registration
order cut, its logging for the buckets, its ``.grad`` storages for memory, a hookless torch DDP
for the exact average. LAYER is one Linear(256, 256)'s weight and bias in fp32.
"""

from __future__ import annotations

import pytest

import dplab
from dplab.ddp import torch_knobs as K
from dplab.mechanics.traffic import CommCounter

LAYER = 256 * 256 * 4 + 256 * 4


@pytest.fixture(scope="module")
def cluster():
    with dplab.Cluster(2, backend="gloo") as c:
        yield c


def test_first_buckets_depend_on_the_flags(cluster):
    runs = {f: cluster.run(K.first_buckets_by_flag, f)[0] for f in K.FLAG_SETS}
    default, unused, static, listed = runs.values()
    assert default.initial == static.initial == [6 * LAYER]  # iteration 0: one bucket
    assert default.rebuilt == static.rebuilt == [4 * LAYER, 2 * LAYER]
    assert (default.rebuilt_from_step, static.rebuilt_from_step) == (2, 3)
    # find_unused_parameters=True: [1 MiB, 25 MiB] over registration order, reversed, for good
    assert unused.initial == unused.registration_cut == [2 * LAYER + 1024, 4 * LAYER - 1024]
    assert (unused.has_rebuilt, unused.rebuilt, unused.rebuilt_from_step) == (0, [], None)
    # bucket_cap_mb_list: the caps from step 0 (over registration order), and for the rebuild
    assert listed.initial == unused.registration_cut and listed.rebuilt == default.rebuilt


def test_gradient_as_bucket_view_with_set_to_none(cluster):
    runs = {(v, n): cluster.run(K.grad_view_copies, v, n)[0] for v in (0, 1) for n in (0, 1)}
    one = runs[0, 0].grad_bytes
    assert one == 6 * LAYER
    assert [runs[k].after_backward for k in runs] == [2 * one, 2 * one, one, one]
    assert [runs[k].after_zero_grad for k in runs] == [2 * one, one, one, one]
    assert runs[1, 0].in_bucket == [12, 12]  # written in place: no copy
    assert runs[1, 1].in_bucket == [0, 0] == runs[0, 0].in_bucket  # a fresh .grad, copied


def test_broadcast_buffers_false_skips_the_init_sync(cluster):
    sync = cluster.run(K.buffer_sync_at_init)[0]
    assert sync.equal_after_init == {
        "broadcast_buffers=False": False,
        "forward_sync_buffers=False": True,
    }
    assert "deprecated" in sync.warned["broadcast_buffers=False"]
    assert sync.warned["forward_sync_buffers=False"] == ""


def test_comm_hooks_bytes_and_error(cluster):
    runs = {h: cluster.run(K.comm_hook_traffic, h, CommCounter)[0] for h in K.HOOKS}
    full = runs["allreduce"].grad_bytes
    assert runs["allreduce"].sent == [full] * 4 and runs["allreduce"].rel_error == [0.0] * 4
    assert runs["fp16_compress"].sent == [full // 2] * 4
    assert 0 < max(runs["fp16_compress"].rel_error) < 1e-2
    assert "NCCL" in runs["bf16_compress"].refused and runs["bf16_compress"].sent == []
    p = runs["powerSGD rank 1"]
    assert p.sent[:2] == [full, full] and p.rel_error[:2] == [0.0, 0.0]
    # rank-1 factors P (256) and Q (256) per weight, 4 weights, and the 4 biases (256 each)
    assert p.sent[2:] == [4 * (256 + 256) * 4 + 4 * 256 * 4] * 2
    assert min(p.rel_error[2:]) > 0.1


def test_the_queued_callback_runs_at_the_end_of_backward(cluster):
    for e in cluster.run(K.end_of_backward_order):
        assert e.last_grad_hook < e.callback < e.returned
        assert e.averaged_on_return


def test_bad_names():
    with pytest.raises(ValueError, match="flags must be one of"):
        K.first_buckets_by_flag("static")
    with pytest.raises(ValueError, match="hook must be one of"):
        K._make_hook("int8")
