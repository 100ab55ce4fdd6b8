"""Argument checks shared by the collectives modules: bad values name themselves."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any


def check_world_size(world_size: Any, *, minimum: int = 1) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, Integral):
        raise ValueError(f"world_size must be an int >= {minimum}, got {world_size!r}")
    if world_size < minimum:
        raise ValueError(f"world_size must be an int >= {minimum}, got {world_size!r}")
    return int(world_size)


def check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def check_nonneg(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def check_positive(name: str, value: Any) -> float:
    if check_nonneg(name, value) == 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)
