"""Which gradients share an all-reduce: torch DDP's bucket rules, written out.

The cutting rule (:func:`assign_buckets`): each (dtype, device) pair fills its own bucket; add a
parameter, and once the bucket's bytes reach the limit, close it. A parameter is never split.
The first bucket of each key gets its own limit, later ones the next. This is what
``torch.distributed._compute_bucket_assignment_by_size`` does in C++; the tests check this
function against torch's own cases and against that function.

When torch applies the rule, and to which order (:func:`torch_initial_buckets`,
:func:`rebuilt_buckets`):

- At construction, over the parameters in *registration* order. Without
  ``find_unused_parameters`` the limit is infinite (one bucket per dtype/device: torch does not
  trust registration order to be the gradient order, so iteration 0 overlaps nothing); with it,
  the caps. The list of buckets is then reversed, so the last layers' bucket comes first.
- After the first iteration (only without ``find_unused_parameters``), once, over the order in
  which rank 0's gradients became ready, with the caps ``[first, cap]``. The first cap is
  torch's 1 MiB only when ``bucket_cap_mb`` was left at its default, else the cap itself.
  ``DDP_SET_LAST_BUCKET_CAP=1`` cuts the reversed order and reverses the result, which puts the
  small bucket last.

The textbook variant the lessons use (:func:`bucket_plan`): reverse registration order from the
start, first bucket ``min(cap, 1 MiB)`` unless chosen (:func:`first_bucket_cap`).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Hashable, Sequence
from numbers import Real
from typing import Any

from dplab._units import MIB

DEFAULT_BUCKET_CAP_MB = 25.0  # torch's bucket_cap_mb default
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0  # torch's _DEFAULT_FIRST_BUCKET_BYTES, in MiB


def torch_first_bucket_cap(bucket_cap_mb: float | None) -> float:
    """torch's first-bucket cap in MiB: 1 MiB when ``bucket_cap_mb`` is left at its default
    (``None``), otherwise the cap itself (torch ``_BucketCapacityConfig``)."""
    if bucket_cap_mb is None:
        return DEFAULT_FIRST_BUCKET_CAP_MB
    return check_cap_mb("bucket_cap_mb", bucket_cap_mb)


def first_bucket_cap(bucket_cap_mb: float, first_bucket_cap_mb: float | None = None) -> float:
    """The first bucket's cap for a given cap: the one rule every caller of DDP shares.

    Unless chosen, the first bucket is torch's 1 MiB, or the cap itself when that is smaller
    (a bucket cap of 0.5 MiB should not give a first bucket twice its size).
    """
    if first_bucket_cap_mb is not None:
        return check_cap_mb("first_bucket_cap_mb", first_bucket_cap_mb)
    return min(check_cap_mb("bucket_cap_mb", bucket_cap_mb), DEFAULT_FIRST_BUCKET_CAP_MB)


def check_cap_mb(name: str, value: Any) -> float:
    """A bucket cap is a finite number of MiB above zero."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of MiB, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0 MiB, got {value!r}")
    if cap_bytes(value) < 1:
        raise ValueError(
            f"{name}={value!r} is {cap_bytes(value)} bytes: must be at least 1 byte "
            f"({1 / MIB:.3g} MiB)"
        )
    return float(value)


def cap_bytes(cap_mb: float) -> int:
    """MiB → bytes, as torch converts ``bucket_cap_mb`` (MiB, not MB)."""
    return int(cap_mb * MIB)


def assign_buckets(
    nbytes: Sequence[int],
    keys: Sequence[Hashable],
    limits: Sequence[int],
    *,
    in_given_order: bool = False,
    alone: Sequence[bool] | None = None,
) -> list[list[int]]:
    """Group tensor indices into buckets; ``limits`` are bytes (first, then the rest).

    ``nbytes[i]`` and ``keys[i]`` (dtype, device) describe tensor ``i``. A bucket closes once its
    bytes reach its limit; every key walks ``limits`` on its own, staying on the last one.
    A tensor marked in ``alone`` (a sparse gradient: it cannot be flattened with others) gets
    a bucket of its own where it is met, touching no limit.
    With ``in_given_order`` (the rebuild after the first iteration, whose order is already the
    order gradients became ready) the buckets keep the order in which they closed, and the
    buckets still open at the end follow, the most recently seen key first: that is how torch's
    C++ walks its hash map of open buckets (checked against torch's own function in the tests).
    Otherwise they are sorted by the smallest index they hold.
    """
    if len(nbytes) != len(keys):
        raise ValueError(f"{len(nbytes)} sizes but {len(keys)} keys")
    if not limits or any(limit <= 0 for limit in limits):
        raise ValueError(f"limits must be positive byte counts, got {list(limits)!r}")
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    limit_index: dict[Hashable, int] = {}
    closed: list[list[int]] = []
    for i, (size, key) in enumerate(zip(nbytes, keys, strict=True)):
        if alone is not None and alone[i]:
            closed.append([i])
            continue
        indices, total = open_buckets.get(key, ([], 0))
        indices.append(i)
        total += size
        level = limit_index.get(key, 0)
        if total >= limits[level]:
            closed.append(indices)
            open_buckets.pop(key, None)
            limit_index[key] = min(level + 1, len(limits) - 1)
        else:
            open_buckets[key] = (indices, total)
    first_seen = list(dict.fromkeys(keys))
    leftovers = [open_buckets[k][0] for k in reversed(first_seen) if k in open_buckets]
    closed.extend(leftovers)
    if not in_given_order:
        closed.sort(key=min)
    return closed


def bucket_plan(
    named_sizes: Sequence[tuple[str, int, int, Hashable]],
    *,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    in_given_order: bool = False,
    alone: Sequence[bool] | None = None,
) -> list[list[int]]:
    """Buckets over ``(name, numel, nbytes, key)`` rows already in bucketing order.

    DDP passes its trainable parameters in reverse registration order; the simulator passes a
    measured profile in the same order, so both draw the very same buckets.
    """
    limits = [
        cap_bytes(check_cap_mb("first_bucket_cap_mb", first_bucket_cap_mb)),
        cap_bytes(check_cap_mb("bucket_cap_mb", bucket_cap_mb)),
    ]
    return assign_buckets(
        [row[2] for row in named_sizes],
        [row[3] for row in named_sizes],
        limits,
        in_given_order=in_given_order,
        alone=alone,
    )


def torch_initial_buckets(
    nbytes: Sequence[int],
    keys: Sequence[Hashable],
    *,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    find_unused_parameters: bool,
    alone: Sequence[bool] | None = None,
) -> list[list[int]]:
    """torch's buckets at construction over tensors in *registration* order (see the module doc).

    Returns the buckets in reduction order; each bucket lists its tensor indices in the order
    they sit in its flat buffer.
    """
    if not find_unused_parameters:
        limits = [sys.maxsize]  # one bucket per dtype/device until the rebuild
    elif first_bucket_cap_mb < bucket_cap_mb:
        limits = [cap_bytes(first_bucket_cap_mb), cap_bytes(bucket_cap_mb)]
    else:
        limits = [cap_bytes(bucket_cap_mb)]
    return list(reversed(assign_buckets(nbytes, keys, limits, alone=alone)))


def set_last_bucket_cap() -> bool:
    """torch's ``DDP_SET_LAST_BUCKET_CAP=1``: the rebuild puts the small bucket last."""
    return os.environ.get("DDP_SET_LAST_BUCKET_CAP", "N/A") == "1"


def rebuilt_buckets(
    order: Sequence[int],
    nbytes: Sequence[int],
    keys: Sequence[Hashable],
    *,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    small_last: bool | None = None,
    alone: Sequence[bool] | None = None,
) -> list[list[int]]:
    """Buckets over ``order`` (the order gradients became ready): torch's rebuild.

    ``nbytes``/``keys`` are indexed by tensor index; the result holds tensor indices, buckets in
    reduction order. ``small_last`` defaults to :func:`set_last_bucket_cap`.
    """
    if small_last is None:
        small_last = set_last_bucket_cap()
    walk = list(reversed(order)) if small_last else list(order)
    limits = [cap_bytes(first_bucket_cap_mb), cap_bytes(bucket_cap_mb)]
    plan = assign_buckets(
        [nbytes[i] for i in walk],
        [keys[i] for i in walk],
        limits,
        in_given_order=True,
        alone=None if alone is None else [alone[i] for i in walk],
    )
    buckets = [[walk[j] for j in bucket] for bucket in plan]
    return list(reversed(buckets)) if small_last else buckets
