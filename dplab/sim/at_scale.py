"""The simulator's answers at scale: what-if faster compute, the least comm, the verdict.

These are the questions §8 asks of a measured profile once it is far from this machine: at which
world size does even a perfectly overlapped all-reduce outgrow the compute, and is a given step
compute-bound or comms-bound?
"""

from __future__ import annotations

import dataclasses
from numbers import Real

from dplab.sim.link import Link
from dplab.sim.profile import BackwardProfile
from dplab.trace import StepTrace

__all__ = ["WORLD_SIZES", "comm_time_ms", "crossover_world_size", "faster_compute", "verdict"]

WORLD_SIZES = tuple(2**k for k in range(11))  # 1 .. 1,024


def faster_compute(profile: BackwardProfile, speedup: float) -> BackwardProfile:
    """The profile with every compute time divided by ``speedup`` (a what-if, not a
    measurement; the meta says so)."""
    if isinstance(speedup, bool) or not isinstance(speedup, Real) or not speedup > 0:
        raise ValueError(f"compute speed-up must be a number > 0, got {speedup!r}")
    if speedup == 1:
        return profile
    k = float(speedup)
    return dataclasses.replace(
        profile,
        params=tuple(dataclasses.replace(p, ready_ms=p.ready_ms / k) for p in profile.params),
        forward_ms=profile.forward_ms / k,
        backward_ms=profile.backward_ms / k,
        optimizer_ms=profile.optimizer_ms / k,
        meta={**profile.meta, "compute_speedup": k},
    )


def comm_time_ms(profile: BackwardProfile, link: Link, world_size: int) -> float:
    """All-reduce time of every gradient, bucketed or not (bandwidth term), on ``link``:
    the least communication a step of this model can have, at this world size."""
    return link.allreduce_s(profile.total_bytes, world_size) * 1e3


def crossover_world_size(
    profile: BackwardProfile, link: Link, sizes: tuple[int, ...] = WORLD_SIZES
) -> int | None:
    """The smallest world size in ``sizes`` at which even one all-reduce of all the gradients
    takes longer than the step's compute: from there on no overlap can hide the comm."""
    compute = profile.forward_ms + profile.backward_ms + profile.optimizer_ms
    for n in sizes:
        if n > 1 and comm_time_ms(profile, link, n) > compute:
            return n
    return None


def verdict(trace: StepTrace) -> str:
    """Compute-bound or comms-bound, in words and numbers."""
    m = trace.metrics
    if m.t_comm_ms >= m.t_compute_ms:
        kind = "comms-bound: T_comm ≥ T_compute, no bucketing can hide it"
    elif m.exposed_comm_ms > 0.05 * m.t_step_ms:
        kind = "compute-bound, but part of the comm is exposed"
    else:
        kind = "compute-bound, comm hidden under backward"
    return (
        f"{kind}. Step {m.t_step_ms:,.1f} ms; T_compute {m.t_compute_ms:,.1f} ms, "
        f"T_comm {m.t_comm_ms:,.1f} ms, exposed {m.exposed_comm_ms:,.1f} ms "
        f"({len(trace.buckets)} buckets)."
    )
