"""What a timeline panel holds and says: the input read into panels (one step, one trace per
rank), each rank's collectives put on sub-rows so that none overlap, and a panel's title and
summary line.

Kept apart from the drawing so that the layout rules (which trace is in which panel, which row a
collective takes) read and test without plotly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dplab.trace import Span, StepTrace
from dplab.trace.metrics import COMM_KINDS

COLLECTIVE_NAMES = {  # plural, for the summary line
    "allreduce": "all-reduces",
    "allgather": "all-gathers",
    "reduce_scatter": "reduce-scatters",
    "broadcast": "broadcasts",
}


# -- input -------------------------------------------------------------------------------------


def _as_trace(item: Any) -> StepTrace:
    if isinstance(item, StepTrace):
        return item
    if isinstance(item, Mapping):
        return StepTrace.from_dict(dict(item))
    raise ValueError(f"expected a StepTrace (or its to_dict()), got {type(item).__name__}")


def panels_of(traces: Any) -> list[list[StepTrace]]:
    """Normalise the input: a StepTrace, a list of them (one step, one per rank), or a list of
    such lists (one panel each). Dicts from ``to_dict()`` are read back."""
    if isinstance(traces, (StepTrace, Mapping)):
        return [[_as_trace(traces)]]
    if not isinstance(traces, Sequence) or isinstance(traces, (str, bytes)):
        raise ValueError(
            "timeline_figure needs a StepTrace, a list of StepTrace (one per rank) or a list of "
            f"such lists (one panel each); got {type(traces).__name__}"
        )
    if not traces:
        raise ValueError("no traces to draw")
    if all(isinstance(t, (StepTrace, Mapping)) for t in traces):
        groups: list[Any] = [traces]
    elif all(isinstance(t, Sequence) and not isinstance(t, (str, bytes)) for t in traces):
        groups = list(traces)
    else:
        raise ValueError(
            "mixed input: pass either a list of StepTrace (one panel) or a list of lists "
            "(one panel each), not both"
        )
    panels = []
    for n, group in enumerate(groups):
        items = [group] if isinstance(group, (StepTrace, Mapping)) else list(group)
        if not items:
            raise ValueError(f"panel {n} has no traces")
        panel = sorted((_as_trace(t) for t in items), key=lambda t: t.rank)
        ranks = [t.rank for t in panel]
        if len(set(ranks)) != len(ranks):
            raise ValueError(
                f"panel {n} holds rank {_first_duplicate(ranks)} twice: a panel is one step, "
                "one trace per rank (use several panels for several steps)"
            )
        panels.append(panel)
    return panels


def _first_duplicate(values: list[int]) -> int:
    seen: set[int] = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    raise AssertionError("no duplicate")


# -- layout of the lanes -----------------------------------------------------------------------


def comm_spans(trace: StepTrace) -> list[Span]:
    """Every collective of the step (all-reduces, and a sharded step's other kinds), by start."""
    return sorted((s for s in trace.spans if s.kind in COMM_KINDS), key=lambda s: s.start_ms)


def comm_rows(trace: StepTrace) -> list[int]:
    """Sub-row of each collective (in ``comm_spans(trace)`` order) so none overlap.

    Greedy interval partitioning: each collective takes the first sub-row that is free when it
    starts. With gloo's two worker threads this needs at most two rows; a simulated or NCCL
    step, whose collectives run one after the other, needs one.
    """
    ends: list[float] = []
    rows = []
    for span in comm_spans(trace):
        for row, end in enumerate(ends):
            if end <= span.start_ms + 1e-9:
                ends[row] = span.end_ms
                rows.append(row)
                break
        else:
            ends.append(span.end_ms)
            rows.append(len(ends) - 1)
    return rows


def describe_step(trace: StepTrace) -> str:
    """One line for a panel title: what ran, where, and how it was timed."""
    meta = trace.meta
    variant = meta.get("variant", "bucketed")
    parts = [str(variant).replace("_", "-")]
    if variant == "bucketed" and "bucket_cap_mb" in meta:
        parts[0] += f", cap {meta['bucket_cap_mb']:g} MiB"
    if "model" in meta:
        parts.append(str(meta["model"]))
    if int(meta.get("micro_batches", 1)) > 1:
        parts.append(f"{meta['micro_batches']} micro-batches (all but the last under no_sync)")
    parts.append(f"{trace.world_size:,} rank{'s' if trace.world_size != 1 else ''}")
    if trace.simulated:
        link = meta.get("link")
        parts.append(f"simulated{f' on {link}' if link else ''}")
    else:
        parts.append(f"measured: {trace.backend}, {trace.clock.replace('_', ' ')} clock")
    return " · ".join(parts)


def summary_line(panel: Sequence[StepTrace]) -> str:
    """The panel's numbers (rank 0, or the lowest rank drawn)."""
    m = panel[0].metrics
    who = f"rank {panel[0].rank}: " if len(panel) > 1 else ""
    head = (
        f"{who}step {m.t_step_ms:,.1f} ms · max(T_compute, T_comm) {m.predicted_step_ms:,.1f} ms · "
        f"exposed comm {m.exposed_comm_ms:,.1f} ms of {m.t_comm_ms:,.1f} · "
    )
    sharded = {k: len(panel[0].of(k)) for k in COMM_KINDS[1:] if panel[0].of(k)}
    if sharded:  # a sharded step (§9b): its collectives by kind
        counts = {"allreduce": m.n_allreduce, **sharded}
        return head + ", ".join(f"{n} {COLLECTIVE_NAMES[k]}" for k, n in counts.items() if n)
    n_buckets = len(panel[0].buckets) or len({s.bucket for s in panel[0].of("allreduce")})
    return head + f"{n_buckets} bucket{'s' if n_buckets != 1 else ''}, {m.n_allreduce} all-reduces"
