"""Argument checks, one per kind of value: a bad value names its argument and itself.

Every public entry point checks its arguments with these, so the error a student sees says
which argument was wrong and what it was, instead of a shape error three calls deeper.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Integral, Real
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "check_choice",
    "check_count",
    "check_gloo_cluster",
    "check_int_in",
    "check_nonneg",
    "check_nonneg_each",
    "check_positive",
    "check_positive_int",
    "check_world_size",
]


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, Integral)


def check_world_size(
    world_size: Any,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    name: str = "world_size",
    why: str = "",
) -> int:
    """A world size is an int in ``minimum..maximum`` (bools and floats are refused).

    ``why`` is appended to the message (e.g. why there is a maximum).
    """
    ok = _is_int(world_size) and world_size >= minimum
    ok = ok and (maximum is None or world_size <= maximum)
    if ok:
        return int(world_size)
    note = f" ({why})" if why else ""
    if maximum is not None:
        return check_int_in(name, world_size, minimum, maximum, why=why)
    if minimum == 1:
        # Callers quote the rule in either form ("a positive int", "an int >= 1"): say both.
        got = f"got {world_size!r}"
        raise ValueError(
            f"{name} must be a positive int, {got} ({name} must be an int >= 1, {got})"
        )
    raise ValueError(f"{name} must be an int >= {minimum}{note}, got {world_size!r}")


def check_int_in(name: str, value: Any, lo: int, hi: int, *, why: str = "") -> int:
    """An int in ``lo..hi`` (a slider's range, a world size on one machine)."""
    if not _is_int(value) or not lo <= value <= hi:
        note = f" ({why})" if why else ""
        raise ValueError(f"{name} must be a whole number in {lo}..{hi:,}{note}, got {value!r}")
    return int(value)


def check_positive_int(name: str, value: Any) -> int:
    """A count of things that cannot be zero (steps, micro-batches, layers): an int >= 1."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_count(name: str, value: Any) -> int:
    """A count that may be zero (warm-up steps, elements): an int >= 0."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def check_nonneg(name: str, value: Any) -> float:
    """A finite number >= 0 (a latency, a time)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def check_positive(name: str, value: Any) -> float:
    """A finite number > 0 (a bandwidth, a cap, a speed-up)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def check_choice(name: str, value: T, choices: Iterable[T]) -> T:
    """One of a fixed set of names (a model, a precision, a link)."""
    options = list(choices)
    if isinstance(value, bool) or value not in options:
        listed = ", ".join(str(o) for o in options)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value


def check_gloo_cluster(who: str, cluster: Any) -> Any:
    """A warm pool for work on CPU tensors runs gloo (NCCL takes GPU tensors only); None is
    fine (the caller then starts gloo ranks of its own)."""
    backend = getattr(cluster, "backend", "gloo")
    if cluster is not None and backend != "gloo":
        raise ValueError(
            f"{who} trains CPU models: it needs a gloo Cluster, got backend {backend!r} "
            "(use dplab.Cluster(2, backend='gloo'))"
        )
    return cluster


def check_nonneg_each(name: str, values: Iterable[Any], *, unit: str = "") -> list[float]:
    """Every value a finite number >= 0 (durations a schedule adds up); the first bad one is
    named by its index, ``name[i]``, so a long list does not hide which entry was wrong."""
    what = f"a finite number of {unit} >= 0" if unit else "a finite number >= 0"
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, Real) or not 0 <= v < math.inf:
            raise ValueError(f"{name}[{i}] must be {what}, got {v!r}")
        out.append(float(v))
    return out
