"""Torch's DDP as it is, on 2 gloo ranks: every claim checked against torch's own DDP and logs.

The oracle is torch: its ``DistributedDataParallel`` on the same model and its
``_get_ddp_logging_data()`` (bucket sizes before and after the rebuild, ``bucket_cap_bytes``),
its ``.grad`` storages (views of its buckets or not), its buffer broadcast seen in its effect.
Gradients: bit for bit against torch at 2 ranks (each element is a + b, halved exactly).
No timing claims: the side-by-side communication times are only checked for being measured.
"""

from __future__ import annotations

import pytest

import dplab
from dplab.ddp import torch_as_it_is as T
from dplab.mechanics.traffic import CommCounter

LAYER = 256 * 256 * 4 + 256 * 4  # one Linear(256, 256): weight + bias, fp32


@pytest.fixture(scope="module")
def cluster():
    with dplab.Cluster(2, backend="gloo") as c:
        yield c


def test_iteration0_is_one_bucket_then_the_rebuild_is_torchs(cluster):
    run = cluster.run(T.buckets_as_torch)[0]
    step0, step2 = run.traces[0], run.traces[2]
    log = run.torch_logging[-1]
    # iteration 0: one bucket for all 12 tensors, as torch's bucket_sizes says; one all-reduce,
    # its bucket ready only once backward's last gradient is in (nothing to overlap with)
    assert run.dplab_bucket_bytes[0] == log["bucket_sizes"] == [6 * LAYER]
    assert step0.metrics.n_allreduce == 1
    (ready,) = step0.of("bucket_ready")
    (backward,) = step0.of("backward")
    assert ready.start_ms >= backward.end_ms
    # the rebuild is the default: torch rebuilt, and dplab's buckets are torch's rebuilt ones
    assert log["has_rebuilt_buckets"] == 1
    assert run.dplab_bucket_bytes[2] == log["rebuilt_bucket_sizes"] == [4 * LAYER, 2 * LAYER]
    assert step2.metrics.n_allreduce == len(log["rebuilt_bucket_sizes"])
    # after it, bucket 0 leaves while backward still computes the earlier layers
    first_ready = min(s.start_ms for s in step2.of("bucket_ready"))
    assert first_ready < step2.of("backward")[0].end_ms
    assert run.grad_diff == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("cap_mb", "expected"),
    [
        (None, [4 * LAYER, 2 * LAYER]),  # default: 1 MiB first bucket, then 25 MiB
        (25, [6 * LAYER]),  # the same 25 MiB, given explicitly: first bucket = cap
        (0.5, [2 * LAYER, 2 * LAYER, 2 * LAYER]),  # explicit: first bucket = 0.5 MiB too
    ],
)
def test_first_bucket_is_one_mib_only_with_the_default_cap(cluster, cap_mb, expected):
    run = cluster.run(T.buckets_as_torch, bucket_cap_mb=cap_mb)[0]
    assert run.torch_bucket_bytes == expected
    assert run.dplab_bucket_bytes[-1] == expected


def test_buckets_are_mib_not_mb(cluster):
    run = cluster.run(T.buckets_as_torch, bucket_cap_mb=0.5)[0]
    assert run.torch_bucket_bytes_cap == int(0.5 * 2**20) == 524_288 != int(0.5e6)
    assert run.dplab_bucket_cap_bytes == run.torch_bucket_bytes_cap
    assert run.torch_logging[-1]["bucket_cap_bytes"] == 524_288


def test_set_last_bucket_cap_moves_the_capped_bucket_last(cluster):
    """torch cuts the *reversed* ready order (first layers first) with caps [1 MiB, cap] and
    reverses the result: the 1 MiB-capped cut, the gradients computed last, is launched last,
    and the rest goes first (here the rest is smaller than 1 MiB; in a model over 2 MiB the
    small bucket is the last one)."""
    default, last = (
        cluster.run(T.buckets_as_torch, last_bucket_cap=flag)[0] for flag in (False, True)
    )
    one_mib_cut = 3 * LAYER + 256 * 256 * 4  # layers 0-2 and layer 3's weight: first >= 1 MiB
    assert default.torch_bucket_bytes == [4 * LAYER, 2 * LAYER]
    assert last.torch_bucket_bytes == [6 * LAYER - one_mib_cut, one_mib_cut]
    assert last.dplab_bucket_bytes[-1] == last.torch_bucket_bytes
    assert last.dplab_bucket_params[-1] == [5, 7]
    # the variable was set on the ranks for the run only
    assert cluster.run(_env_value, T.LAST_BUCKET_CAP) == [None, None]


def _env_value(name: str) -> str | None:
    import os

    return os.environ.get(name)


def test_gradient_as_bucket_view_memory_as_torch(cluster):
    mem = cluster.run(T.gradient_memory)[0]
    assert mem.param_bytes == 6 * LAYER
    # torch's default keeps the gradients twice: .grad tensors plus the buckets
    assert mem.dplab[False] == 2 * mem.param_bytes == mem.torch_total(False)
    # with views, torch's .grad tensors share one storage per bucket: one copy
    assert mem.dplab[True] == mem.param_bytes == mem.torch_total(True)
    assert mem.torch_grad_storage_count == {False: 12, True: len(mem.torch_bucket_bytes[True])}


def test_buffers_are_broadcast_every_step(cluster):
    runs = cluster.run(T.buffer_traffic, CommCounter)
    run = runs[0]
    grads, buffers, order = run.grad_bytes, run.buffer_bytes, run.rebuild_order_bytes
    assert buffers == 3 * (2 * 64 * 4 + 8)  # running mean, var (fp32), num_batches_tracked
    assert [s["all_reduce"] for s in run.per_step] == [grads] * 3
    assert [s["broadcast"] for s in run.per_step] == [buffers, buffers + order, buffers]
    assert all(r.torch_synced for r in runs)
    off = cluster.run(T.buffer_traffic, CommCounter, broadcast_buffers=False)[0]
    assert [s["broadcast"] for s in off.per_step] == [0, order, 0]
    assert [s["all_reduce"] for s in off.per_step] == [grads] * 3


def test_comm_times_side_by_side(cluster):
    runs = cluster.run(T.comm_time_side_by_side, steps=3, width=256, depth=6, batch=8)
    for run in runs:
        for values in (*run.torch_ms.values(), *run.dplab_ms.values()):
            assert len(values) == 3
        assert all(v > 0 for v in run.torch_ms["backward_comm"])
        assert all(v > 0 for v in run.dplab_ms["launch_to_wait"])
        medians = run.medians()
        assert set(medians) >= {"torch backward_comm", "dplab union", "dplab launch_to_wait"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="width must be an int >= 1, got 0"):
        T.linear_stack(width=0)
