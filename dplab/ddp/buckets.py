"""Which gradients share an all-reduce: torch DDP's bucket rule, written out.

Parameters are walked in *reverse* registration order, because backward produces gradients
roughly last layer first. Each (dtype, device) pair fills its own bucket: add a parameter, and
once the bucket's bytes reach the limit, close it. A parameter is never split across buckets.
The first bucket of each dtype gets its own (smaller) limit so that the last layers' gradients
start their all-reduce early instead of waiting to fill 25 MiB. Buckets are then ordered by the
smallest index they hold, so that they become ready one after the other.

This is what ``torch.distributed._compute_bucket_assignment_by_size`` does in C++; the tests check
this function against torch's own cases.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from numbers import Real
from typing import Any

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0  # torch's bucket_cap_mb default
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0  # torch's _DEFAULT_FIRST_BUCKET_BYTES, in MiB


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
) -> list[list[int]]:
    """Group tensor indices into buckets; ``limits`` are bytes (first, then the rest).

    ``nbytes[i]`` and ``keys[i]`` (dtype, device) describe tensor ``i``. A bucket closes once its
    bytes reach its limit; every key walks ``limits`` on its own, staying on the last one.
    With ``in_given_order`` (the rebuild after the first iteration, whose order is already the
    order gradients became ready) the buckets keep the order in which they closed; otherwise
    they are sorted by the smallest index they hold.
    """
    if len(nbytes) != len(keys):
        raise ValueError(f"{len(nbytes)} sizes but {len(keys)} keys")
    if not limits or any(limit <= 0 for limit in limits):
        raise ValueError(f"limits must be positive byte counts, got {list(limits)!r}")
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    limit_index: dict[Hashable, int] = {}
    closed: list[list[int]] = []
    for i, (size, key) in enumerate(zip(nbytes, keys, strict=True)):
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
    closed.extend(indices for indices, _ in open_buckets.values())
    if not in_given_order:
        closed.sort(key=min)
    return closed


def bucket_plan(
    named_sizes: Sequence[tuple[str, int, int, Hashable]],
    *,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    in_given_order: bool = False,
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
    )
