"""A bucket-size sweep as rows: one row per step (measured or simulated), and the best cap.

Rows are plain dicts so that measured and simulated sweeps, and sweeps saved as JSON, mix in
one table and one figure (:func:`dplab.viz.sweep.sweep_figure` draws them).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from dplab.trace.step import StepTrace

__all__ = ["best_cap", "by_cap", "sweep_row"]


def sweep_row(trace: StepTrace, **extra: Any) -> dict[str, Any]:
    """One row of a sweep from a step: its cap (from ``trace.meta`` unless given), bucket
    count and metrics."""
    m = trace.metrics
    row = {
        "bucket_cap_mb": trace.meta.get("bucket_cap_mb"),
        "n_buckets": len(trace.buckets) or len({s.bucket for s in trace.of("allreduce")}),
        "rank": trace.rank,
        "world_size": trace.world_size,
        "t_step_ms": m.t_step_ms,
        "t_compute_ms": m.t_compute_ms,
        "t_comm_ms": m.t_comm_ms,
        "exposed_comm_ms": m.exposed_comm_ms,
        "predicted_step_ms": m.predicted_step_ms,
        "simulated": trace.simulated,
    }
    row.update(extra)
    if row["bucket_cap_mb"] is None:
        raise ValueError("the trace does not say its bucket cap: pass bucket_cap_mb=")
    return row


def by_cap(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float, Any]]:
    """(cap, median of key, bucket count) per cap, caps ascending."""
    groups: dict[float, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(float(r["bucket_cap_mb"]), []).append(r)
    return [
        (
            cap,
            statistics.median(float(r[key]) for r in group),
            group[0].get("n_buckets"),
        )
        for cap, group in sorted(groups.items())
    ]


def best_cap(rows: Sequence[Mapping[str, Any]]) -> float:
    """The cap with the lowest median step time.

    Where neighbouring caps tie (the simulator's step only changes where the bucket plan
    does), the middle of the widest tied run, the choice least sensitive to the model.
    """
    medians = by_cap(rows, "t_step_ms")
    if not medians:
        raise ValueError("no rows")
    best = min(m[1] for m in medians)
    runs: list[list[float]] = []
    previous_tied = False
    for cap, step, _ in medians:
        tied = step <= best * (1 + 1e-9)
        if tied:
            if previous_tied:
                runs[-1].append(cap)
            else:
                runs.append([cap])
        previous_tied = tied
    widest = max(runs, key=len)
    return widest[len(widest) // 2]
