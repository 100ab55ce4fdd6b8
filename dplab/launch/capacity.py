"""Checks made before any rank starts: world size, timeout, and what this machine can hold."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from dplab import _checks
from dplab.env import usable_cpus

# Resident memory of one idle gloo rank (torch imported, process group joined), measured with
# /proc/PID/status VmRSS on torch 2.13 CPU: 229 MB (PSS 154 MB); see docs/reliability.md.
RANK_MEMORY_BYTES = 230e6
# More ranks than this per core is never a useful experiment on one machine, only a swap storm.
RANKS_PER_CORE = 16


def check_world_size(world_size: Any) -> int:
    """A world size is a positive int (bools are not)."""
    return _checks.check_world_size(world_size)


def check_timeout(timeout_s: Any) -> float:
    """A finite number of seconds > 0: ``inf`` would overflow the waits after ``fn`` ran."""
    return _checks.check_positive("timeout_s", timeout_s)


def _available_memory() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    with contextlib.suppress(AttributeError, ValueError, OSError):
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return None


def check_capacity(world_size: int, *, oversubscribe: bool = False) -> int:
    """Refuse more ranks than this machine can hold, before starting any of them.

    Each rank is a process with torch in it (~230 MB): 10 000 of them would swap the machine to
    a halt long before the first collective. ``oversubscribe=True`` skips the check.
    """
    if oversubscribe:
        return world_size
    cores = usable_cpus()
    by_cores = RANKS_PER_CORE * cores
    memory = _available_memory()
    by_memory = None if memory is None else max(1, int(memory // RANK_MEMORY_BYTES))
    if world_size <= by_cores and (by_memory is None or world_size <= by_memory):
        return world_size
    reasons = [f"{cores} usable cores hold at most {by_cores} ranks ({RANKS_PER_CORE} per core)"]
    if by_memory is not None:
        reasons.append(
            f"{memory / 1e9:.1f} GB of available memory holds at most {by_memory} ranks of "
            f"~{RANK_MEMORY_BYTES / 1e6:.0f} MB each"
        )
    raise ValueError(
        f"world_size={world_size} is more ranks than this machine can hold: "
        + "; ".join(reasons)
        + ". Pass oversubscribe=True to start them anyway."
    )
