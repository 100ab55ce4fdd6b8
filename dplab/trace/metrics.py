"""What a timeline says in numbers: compute, communication, and the part of it left exposed.

Everything here is interval arithmetic on spans, so a measured step and a simulated step give
their numbers the same way.

- ``t_comm``: the union of all collective intervals (two collectives that run at once, as gloo's
  two worker threads do, count once). DDP's are all-reduces; a sharded step (§9b) adds
  all-gathers, reduce-scatters and broadcasts (``COMM_KINDS``).
- ``exposed_comm``: communication time during which no forward or backward compute runs on the
  rank, the time the step pays for it. It is the union of collectives minus the backward spans
  (and the forward ones, under which a sharded step's all-gathers can hide; a DDP step
  communicates in backward). Time under the optimizer counts as exposed.
- ``exposed_ms``: that exposed time split among DDP's buckets (their all-reduces); a sharded
  step's other collectives have no bucket and are not in it.
- ``overlap_fraction``: the share of ``t_comm`` hidden under forward or backward.
- ``predicted_step``: the seed's ``max(T_compute, T_comm)``, the step with perfect overlap. The
  measured step can never beat it (both are parts of one step), so it is a lower bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

Interval = tuple[float, float]
COMM_KINDS = ("allreduce", "allgather", "reduce_scatter", "broadcast")


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals into disjoint, sorted ones."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in union(intervals))


def subtract(intervals: Iterable[Interval], cover: Iterable[Interval]) -> list[Interval]:
    """The parts of ``intervals`` not covered by ``cover`` (both merged first)."""
    out: list[Interval] = []
    holes = union(cover)
    for start, end in union(intervals):
        cursor = start
        for h_start, h_end in holes:
            if h_end <= cursor or h_start >= end:
                continue
            if h_start > cursor:
                out.append((cursor, h_start))
            cursor = max(cursor, h_end)
            if cursor >= end:
                break
        if cursor < end:
            out.append((cursor, end))
    return out


def attribute(
    exposed: Sequence[Interval], owners: Sequence[tuple[int, Interval]]
) -> dict[int, float]:
    """Split exposed time among buckets: each instant goes to the lowest bucket active then.

    The per-bucket numbers then add up to the exposed time of the buckets' all-reduces even
    when they ran at the same time (all of a DDP step's exposed time).
    """
    share: dict[int, float] = {index: 0.0 for index, _ in owners}
    points = sorted(
        {p for a, b in exposed for p in (a, b)} | {p for _, (a, b) in owners for p in (a, b)}
    )
    exposed_set = union(exposed)
    for left, right in itertools.pairwise(points):
        mid = (left + right) / 2
        if not any(a <= mid < b for a, b in exposed_set):
            continue
        active = [index for index, (a, b) in owners if a <= mid < b]
        if active:
            share[min(active)] += right - left
    return share


@dataclass
class StepMetrics:
    """The numbers of one step, all in milliseconds."""

    t_step_ms: float
    t_forward_ms: float
    t_backward_ms: float
    t_optimizer_ms: float
    t_compute_ms: float
    t_comm_ms: float
    exposed_comm_ms: float
    overlap_fraction: float
    predicted_step_ms: float
    n_allreduce: int
    exposed_ms: dict[int, float] = field(default_factory=dict)  # per bucket

    def to_dict(self) -> dict:
        d = asdict(self)
        d["exposed_ms"] = {str(k): v for k, v in self.exposed_ms.items()}
        return d


def step_metrics(spans: Sequence) -> StepMetrics:
    """Metrics of one step from its spans (objects with kind, start_ms, end_ms, bucket)."""

    def of(kind: str) -> list[Interval]:
        return [(s.start_ms, s.end_ms) for s in spans if s.kind == kind]

    def total(kind: str) -> float:
        return sum(b - a for a, b in of(kind))

    comm = [interval for kind in COMM_KINDS for interval in of(kind)]
    exposed = subtract(comm, of("backward"))
    exposed = subtract(exposed, of("forward"))
    t_comm = length(comm)
    t_exposed = length(exposed)
    t_forward, t_backward, t_optimizer = total("forward"), total("backward"), total("optimizer")
    t_compute = t_forward + t_backward + t_optimizer
    owners = [
        (s.bucket, (s.start_ms, s.end_ms))
        for s in spans
        if s.kind == "allreduce" and s.bucket is not None
    ]
    return StepMetrics(
        t_step_ms=max((s.end_ms for s in spans), default=0.0)
        - min((s.start_ms for s in spans), default=0.0),
        t_forward_ms=t_forward,
        t_backward_ms=t_backward,
        t_optimizer_ms=t_optimizer,
        t_compute_ms=t_compute,
        t_comm_ms=t_comm,
        exposed_comm_ms=t_exposed,
        overlap_fraction=(t_comm - t_exposed) / t_comm if t_comm > 0 else 0.0,
        predicted_step_ms=max(t_compute, t_comm),
        n_allreduce=len(of("allreduce")),
        exposed_ms=attribute(exposed, owners),
    )
