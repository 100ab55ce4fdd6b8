"""The bucket rule is torch's: its own test cases, and random cases against its C++ function."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dplab.ddp.buckets import assign_buckets, bucket_plan, check_cap_mb

F, D = (torch.float32, "cpu"), (torch.float64, "cpu")


def test_torch_case_one_bucket_per_tensor():
    assert assign_buckets([400, 800, 400, 200], [F] * 4, [400]) == [[0], [1], [2], [3]]


def test_torch_case_dtypes_bucket_separately():
    assert assign_buckets([200, 200] * 3, [F, D] * 3, [400]) == [[0, 2], [1, 3], [4], [5]]


def test_torch_case_small_first_bucket():
    assert assign_buckets([40] * 4, [F] * 4, [40, 80]) == [[0], [1, 2], [3]]


def test_torch_case_first_limit_per_dtype():
    assert assign_buckets([200, 200] * 3, [F, D] * 3, [200, 400]) == [[0], [1], [2, 4], [3, 5]]


@pytest.mark.parametrize(
    ("cap_elems", "expected"), [(9050, [18050] * 5), (20000, [27075] * 3 + [9025])]
)
def test_torch_case_linear_layers_walked_in_reverse(cap_elems, expected):
    layers = nn.Sequential(*[nn.Linear(95, 95, bias=False) for _ in range(10)])
    params = list(reversed(list(layers.parameters())))
    plan = assign_buckets([p.numel() * 4 for p in params], [F] * 10, [cap_elems * 4])
    assert [sum(params[i].numel() for i in bucket) for bucket in plan] == expected


def test_matches_torchs_own_function_on_random_cases():
    rng = random.Random(0)
    dtypes = [torch.float32, torch.float64, torch.bfloat16]
    for _ in range(300):
        n = rng.randint(1, 25)
        tensors = [torch.empty(rng.randint(1, 300), dtype=rng.choice(dtypes)) for _ in range(n)]
        limits = sorted(rng.randint(1, 2000) for _ in range(rng.randint(1, 3)))
        ours = assign_buckets(
            [t.numel() * t.element_size() for t in tensors],
            [(t.dtype, "cpu") for t in tensors],
            limits,
        )
        theirs, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
        assert ours == [list(b) for b in theirs]


def test_in_given_order_matches_torchs_function_with_tensor_indices():
    """The rebuild's case: tensors already in ready order, buckets keep the order they close."""
    rng = random.Random(1)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
    for _ in range(300):
        n = rng.randint(1, 25)
        tensors = [torch.empty(rng.randint(1, 300), dtype=rng.choice(dtypes)) for _ in range(n)]
        order = list(range(n))
        rng.shuffle(order)
        limits = sorted(rng.randint(1, 2000) for _ in range(rng.randint(1, 3)))
        walked = [tensors[i] for i in order]
        ours = assign_buckets(
            [t.numel() * t.element_size() for t in walked],
            [(t.dtype, "cpu") for t in walked],
            limits,
            in_given_order=True,
        )
        theirs, _ = dist._compute_bucket_assignment_by_size(walked, limits, [False] * n, order)
        assert [[order[j] for j in b] for b in ours] == [list(b) for b in theirs]


def test_plan_uses_mib_like_torch():
    rows = [(f"p{i}", 2**18, 2**20, F) for i in range(6)]  # 1 MiB each
    assert bucket_plan(rows, bucket_cap_mb=2, first_bucket_cap_mb=1) == [[0], [1, 2], [3, 4], [5]]


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "5", None, True])
def test_bad_caps_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        check_cap_mb("bucket_cap_mb", bad)
