"""The DDP step as a picture: per rank a compute lane and a comm lane, on one time axis.

Measured steps (host clock, CUDA events) and simulated ones draw the same way, because both are
:class:`~dplab.trace.StepTrace`. What the figure shows, per rank:

- the **compute lane**: forward, backward (one span per micro-batch), the wait at the end of
  backward for outstanding all-reduces, the optimizer step;
- the **comm lane**: each bucket's all-reduce, labelled ``b0``, ``b1``, …; hover gives the
  bucket, its bytes, its parameters and its times. A sharded step (§9b) also has all-gathers,
  reduce-scatters and broadcasts, each kind in its own colour and labelled by its unit. A
  collective can run while another one is still going (gloo runs them on two threads), so
  overlapping spans go to sub-rows of the lane;
- the **exposed** part of every collective (no forward or backward compute runs then) in its
  own colour: this is the time the step pays for communication;
- **bucket-ready markers** between the lanes: the moment a bucket's last gradient arrived;
- the **prediction** ``max(T_compute, T_comm)``, a dashed line: the step with perfect overlap.
  A real step can only be slower (it is a lower bound, both terms being parts of the step).

Several steps (e.g. naive, per-parameter and bucketed) go into panels, stacked on one time axis
so that their lengths compare at a glance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dplab._units import MIB
from dplab.trace import Span, StepTrace
from dplab.trace.metrics import COMM_KINDS, subtract
from dplab.viz.style import COLORS, layout

ALIGNS = ("rank0", "step")
COMPUTE_KINDS = ("forward", "backward", "wait", "optimizer")
KIND_LABELS = {
    "forward": "forward",
    "backward": "backward",
    "wait": "wait for all-reduces",
    "optimizer": "optimizer",
    "allreduce": "all-reduce (hidden under backward)",
    "allgather": "all-gather (hidden under compute)",
    "reduce_scatter": "reduce-scatter (hidden under compute)",
    "broadcast": "broadcast (hidden under compute)",
    "exposed": "all-reduce, exposed",
    "bucket_ready": "bucket ready",
    "predicted": "max(T_compute, T_comm)",
}
# a figure holding a sharded step (§9b) waits for, and exposes, more than all-reduces
SHARDED_LABELS = {"wait": "waiting for communication", "exposed": "communication, exposed"}
COLLECTIVE_NAMES = {  # plural, for the summary line
    "allreduce": "all-reduces",
    "allgather": "all-gathers",
    "reduce_scatter": "reduce-scatters",
    "broadcast": "broadcasts",
}
BAR_WIDTH = 0.8
ROW_PX = 34
MAX_PARAMS_IN_HOVER = 8


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


# -- drawing -----------------------------------------------------------------------------------


class _Bars:
    """The horizontal bars of one colour in one panel, gathered into a single plotly trace."""

    def __init__(self) -> None:
        self.base: list[float] = []
        self.x: list[float] = []
        self.y: list[float] = []
        self.text: list[str] = []
        self.hover: list[str] = []

    def add(self, start: float, end: float, y: float, text: str, hover: str) -> None:
        self.base.append(start)
        self.x.append(max(end - start, 0.0))
        self.y.append(y)
        self.text.append(text)
        self.hover.append(hover)


def _params_text(names: Sequence[str]) -> str:
    shown = list(names[:MAX_PARAMS_IN_HOVER])
    more = len(names) - len(shown)
    text = "<br>  ".join(shown)
    if more > 0:
        text += f"<br>  … and {more} more"
    return text


def _bytes_text(nbytes: int | None) -> str:
    if nbytes is None:
        return "?"
    if nbytes >= MIB:
        return f"{nbytes / 1024 / 1024:,.2f} MiB ({nbytes:,} B)"
    if nbytes >= 1024:
        return f"{nbytes / 1024:,.1f} KiB ({nbytes:,} B)"
    return f"{nbytes:,} B"


def _labels(panels: Sequence[Sequence[StepTrace]]) -> dict[str, str]:
    """The legend's names: DDP's, or the general ones when any step has another collective."""
    sharded = any(s.kind in COMM_KINDS[1:] for p in panels for t in p for s in t.spans)
    return {**KIND_LABELS, **SHARDED_LABELS} if sharded else KIND_LABELS


def _add_bars(
    fig: go.Figure,
    bars: dict[str, _Bars],
    where: dict[str, int],
    legend_seen: set[str],
    labels: Mapping[str, str],
) -> None:
    """One horizontal bar trace per kind (compute kinds, all-reduce, exposed)."""
    colors = {**COLORS}
    for kind, group in bars.items():
        if not group.x and kind != "allreduce":
            continue
        fig.add_trace(
            go.Bar(
                orientation="h",
                base=group.base,
                x=group.x,
                y=group.y,
                width=BAR_WIDTH,
                text=group.text,
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,
                hovertext=group.hover,
                hoverinfo="text",
                marker={"color": colors[kind], "line": {"width": 0.5, "color": "white"}},
                name=labels[kind],
                legendgroup=kind,
                showlegend=kind not in legend_seen and bool(group.x),
            ),
            **where,
        )
        if group.x:
            legend_seen.add(kind)


def _add_ready_marks(
    fig: go.Figure,
    ready: tuple[list[float], list[float], list[str]],
    where: dict[str, int],
    legend_seen: set[str],
) -> None:
    """A triangle where each bucket became ready."""
    ready_x, ready_y, ready_hover = ready
    if ready_x:
        fig.add_trace(
            go.Scatter(
                x=ready_x,
                y=ready_y,
                mode="markers",
                marker={"symbol": "triangle-down", "size": 9, "color": COLORS["bucket_ready"]},
                hovertext=ready_hover,
                hoverinfo="text",
                name=KIND_LABELS["bucket_ready"],
                legendgroup="bucket_ready",
                showlegend="bucket_ready" not in legend_seen,
            ),
            **where,
        )
        legend_seen.add("bucket_ready")


def _add_predicted(
    fig: go.Figure,
    predicted: list[tuple[float, float, float, str]],
    where: dict[str, int],
    legend_seen: set[str],
) -> None:
    """A dashed line per rank at max(T_compute, T_comm): the step with perfect overlap."""
    xs: list[float | None] = []
    ys: list[float | None] = []
    hovers: list[str | None] = []
    for x, top, bottom, hover in predicted:
        xs += [x, x, x, None]
        ys += [top, (top + bottom) / 2, bottom, None]
        hovers += [hover, hover, hover, None]
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys,
            mode="lines+markers",
            line={"color": COLORS["predicted"], "dash": "dash", "width": 2},
            marker={"size": 3, "color": COLORS["predicted"]},
            hovertext=hovers,
            hoverinfo="text",
            name=KIND_LABELS["predicted"],
            legendgroup="predicted",
            showlegend="predicted" not in legend_seen,
        ),
        **where,
    )
    legend_seen.add("predicted")


@dataclass
class _PanelMarks:
    """Everything one panel draws, gathered rank by rank before any plotly trace is made.

    Gathering first lets each kind become a single trace per panel (one legend entry, one
    hover style) however many ranks and buckets the panel holds.
    """

    bars: dict[str, _Bars] = field(
        default_factory=lambda: {k: _Bars() for k in (*COMPUTE_KINDS, *COMM_KINDS, "exposed")}
    )
    ready_x: list[float] = field(default_factory=list)
    ready_y: list[float] = field(default_factory=list)
    ready_hover: list[str] = field(default_factory=list)
    predicted: list[tuple[float, float, float, str]] = field(default_factory=list)
    tickvals: list[float] = field(default_factory=list)
    ticktext: list[str] = field(default_factory=list)


def _add_compute_lane(marks: _PanelMarks, trace: StepTrace, offset: float, y: float) -> None:
    """The rank's compute lane: forward, backward, wait and optimizer spans at height ``y``."""
    marks.tickvals.append(y)
    marks.ticktext.append(f"rank {trace.rank} compute")
    for span in trace.spans:
        if span.kind in COMPUTE_KINDS:
            marks.bars[span.kind].add(
                offset + span.start_ms,
                offset + span.end_ms,
                y,
                span.name,
                f"rank {trace.rank} · {span.name}<br>{span.start_ms:,.2f} → "
                f"{span.end_ms:,.2f} ms ({span.duration_ms:,.2f} ms)",
            )


def _allreduce_hover(trace: StepTrace, span: Span, exposed_ms: float, params: Sequence[str]) -> str:
    """What one bucket's all-reduce moved and when: bytes, times, exposed part, parameters."""
    if span.kind != "allreduce" or span.bucket is None:  # a sharded step's collective
        return (
            f"rank {trace.rank} · {span.name}<br>{_bytes_text(span.nbytes)}<br>"
            f"{span.start_ms:,.2f} → {span.end_ms:,.2f} ms ({span.duration_ms:,.2f} ms), "
            f"exposed {exposed_ms:,.2f} ms"
        )
    return (
        f"rank {trace.rank} · all-reduce of bucket {span.bucket}<br>"
        f"{_bytes_text(span.nbytes)}<br>"
        f"{span.start_ms:,.2f} → {span.end_ms:,.2f} ms ({span.duration_ms:,.2f} ms), "
        f"exposed {exposed_ms:,.2f} ms<br>"
        f"parameters ({len(params)}):<br>  {_params_text(params)}"
    )


def _add_comm_lanes(
    marks: _PanelMarks,
    trace: StepTrace,
    offset: float,
    y: float,
    names: Mapping[int | None, list[str]],
) -> int:
    """The rank's comm lane below ``y``: each collective whole, and its exposed part on top.

    The exposed part is the collective minus the backward and forward spans: the time nothing
    was being computed, so the step paid for it. Returns how many sub-rows the lane needed.
    """
    rows = comm_rows(trace)
    n_rows = max(rows, default=0) + 1
    for k in range(n_rows):
        marks.tickvals.append(y + 1 + k)
        marks.ticktext.append(f"rank {trace.rank} comm" + (f" ·{k + 1}" if n_rows > 1 else ""))
    compute = [(s.start_ms, s.end_ms) for s in trace.of("backward") + trace.of("forward")]
    for span, row in zip(comm_spans(trace), rows, strict=True):
        row_y = y + 1 + row
        exposed = subtract([(span.start_ms, span.end_ms)], compute)
        hover = _allreduce_hover(
            trace, span, sum(b - a for a, b in exposed), names.get(span.bucket, [])
        )
        label = f"b{span.bucket}" if span.bucket is not None else span.name
        marks.bars[span.kind].add(offset + span.start_ms, offset + span.end_ms, row_y, label, hover)
        for a, b in exposed:
            marks.bars["exposed"].add(
                offset + a,
                offset + b,
                row_y,
                label,
                f"exposed: {b - a:,.2f} ms with no backward running<br>{hover}",
            )
    return n_rows


def _add_bucket_ready(
    marks: _PanelMarks,
    trace: StepTrace,
    offset: float,
    y: float,
    names: Mapping[int | None, list[str]],
) -> None:
    """A marker between the lanes where each bucket's last gradient arrived."""
    for span in trace.of("bucket_ready"):
        marks.ready_x.append(offset + span.start_ms)
        marks.ready_y.append(y + 0.5)
        n_params = len(names.get(span.bucket, []))
        marks.ready_hover.append(
            f"rank {trace.rank} · bucket {span.bucket} ready at {span.start_ms:,.2f} ms<br>"
            f"its last gradient is in ({n_params} parameters, {_bytes_text(span.nbytes)})"
        )


def _add_perfect_overlap(
    marks: _PanelMarks, trace: StepTrace, offset: float, y: float, n_rows: int
) -> None:
    """Where the step would end with perfect overlap, max(T_compute, T_comm) after its start.

    The line spans the rank's compute and comm lanes, so the gap to the real step end reads
    directly as time lost to exposed communication.
    """
    m = trace.metrics
    start = min((s.start_ms for s in trace.spans), default=0.0)
    marks.predicted.append(
        (
            offset + start + m.predicted_step_ms,
            y - BAR_WIDTH / 2,
            y + n_rows + BAR_WIDTH / 2,
            f"rank {trace.rank} · perfect overlap: max(T_compute, T_comm) = "
            f"{m.predicted_step_ms:,.1f} ms<br>T_compute {m.t_compute_ms:,.1f} ms "
            f"(forward + backward + optimizer), T_comm {m.t_comm_ms:,.1f} ms<br>"
            f"this step took {m.t_step_ms:,.1f} ms; exposed comm {m.exposed_comm_ms:,.1f} ms",
        )
    )


def _draw_panel(
    fig: go.Figure,
    panel: Sequence[StepTrace],
    *,
    align: str,
    where: dict[str, int],
    legend_seen: set[str],
    show_predicted: bool,
    labels: Mapping[str, str],
) -> tuple[list[float], list[str]]:
    """Add one panel's traces to ``fig``; return its y tick positions and labels.

    Ranks are laid out top to bottom, each a compute lane and its comm sub-rows; with
    ``align="rank0"`` every rank is shifted onto rank 0's clock so a late rank shows.
    """
    marks = _PanelMarks()
    reference = panel[0].origin_ms
    y = 0.0
    for trace in panel:
        offset = trace.origin_ms - reference if align == "rank0" else 0.0
        names: dict[int | None, list[str]] = {b.index: list(b.param_names) for b in trace.buckets}
        _add_compute_lane(marks, trace, offset, y)
        n_rows = _add_comm_lanes(marks, trace, offset, y, names)
        _add_bucket_ready(marks, trace, offset, y, names)
        _add_perfect_overlap(marks, trace, offset, y, n_rows)
        # A gap between ranks. Not `y += n_rows + 1.6`: that rounds differently and would move
        # the tick positions of existing figures by one ulp.
        y = y + n_rows + 1.6

    _add_bars(fig, marks.bars, where, legend_seen, labels)
    _add_ready_marks(fig, (marks.ready_x, marks.ready_y, marks.ready_hover), where, legend_seen)
    if show_predicted:
        _add_predicted(fig, marks.predicted, where, legend_seen)
    return marks.tickvals, marks.ticktext


def _lanes(panel: Sequence[StepTrace]) -> float:
    return sum(2 + max(comm_rows(t), default=0) + 0.6 for t in panel)


def _subplots(
    panels: list[list[StepTrace]],
    titles: list[str],
    *,
    arrange: str,
    shared_time: bool,
    height: int | None,
) -> tuple[go.Figure, list[dict[str, int]], int]:
    """The empty figure: one subplot per panel, sized by its lanes; its cells and height."""
    lanes = [_lanes(p) for p in panels]
    n = len(panels)
    gap_px = 95  # between stacked panels: the time axis' labels, then the next panel's title
    if height is None:
        per_panel = ROW_PX * (sum(lanes) if arrange == "stack" else max(lanes))
        height = int(max(300, per_panel + gap_px * (n - 1 if arrange == "stack" else 0) + 220))
    plot_px = max(height - 220, 1)  # the margins and legend take the rest
    if arrange == "stack":
        fig = make_subplots(
            rows=n,
            cols=1,
            shared_xaxes=shared_time,
            row_heights=[x / sum(lanes) for x in lanes],
            subplot_titles=titles,
            vertical_spacing=min(gap_px / plot_px, 0.5 / n) if n > 1 else 0.0,
        )
        cells = [{"row": i + 1, "col": 1} for i in range(n)]
    else:
        fig = make_subplots(
            rows=1,
            cols=n,
            shared_xaxes=shared_time,
            subplot_titles=titles,
            horizontal_spacing=min(0.08, 0.4 / n) if n > 1 else 0.0,
        )
        cells = [{"row": 1, "col": i + 1} for i in range(n)]
    return fig, cells, height


def timeline_figure(
    traces: Any,
    *,
    title: str | None = None,
    align: str = "rank0",
    panel_titles: Sequence[str] | None = None,
    arrange: str = "stack",
    shared_time: bool = True,
    show_predicted: bool = True,
    height: int | None = None,
) -> go.Figure:
    """A timeline of one or several DDP steps.

    Args:
        traces: a StepTrace; a list of StepTrace (one step, one trace per rank); or a list of
            those lists (one panel each, e.g. naive / per-parameter / bucketed).
        title: the figure's title (default: the first panel's description).
        align: ``"rank0"`` puts every rank on rank 0's clock (a late rank shows as a shift);
            ``"step"`` starts every rank's step at 0.
        panel_titles: one title per panel (default: what ran, and its numbers).
        arrange: ``"stack"`` (panels one above the other) or ``"side"`` (side by side).
        shared_time: one time axis for all panels, so lengths compare directly.
        show_predicted: draw the ``max(T_compute, T_comm)`` line.
        height: pixels (default: from the number of lanes).
    """
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align!r}")
    if arrange not in ("stack", "side"):
        raise ValueError(f"arrange must be 'stack' or 'side', got {arrange!r}")
    panels = panels_of(traces)
    if panel_titles is not None and len(panel_titles) != len(panels):
        raise ValueError(f"{len(panel_titles)} panel titles for {len(panels)} panels")
    titles = (
        list(panel_titles)
        if panel_titles is not None
        else [f"{describe_step(p[0])}<br><sup>{summary_line(p)}</sup>" for p in panels]
    )
    fig, cells, height = _subplots(
        panels, titles, arrange=arrange, shared_time=shared_time, height=height
    )
    n = len(panels)
    legend_seen: set[str] = set()
    labels = _labels(panels)
    for panel, where in zip(panels, cells, strict=True):
        tickvals, ticktext = _draw_panel(
            fig,
            panel,
            align=align,
            where=where,
            legend_seen=legend_seen,
            show_predicted=show_predicted,
            labels=labels,
        )
        fig.update_yaxes(
            tickvals=tickvals,
            ticktext=ticktext,
            autorange="reversed",
            zeroline=False,
            showgrid=False,
            **where,
        )
    clock = "rank 0's step start" if align == "rank0" else "each rank's step start"
    fig.update_xaxes(title_text=f"ms from {clock}", zeroline=False)
    if arrange == "stack" and shared_time and n > 1:
        for i in range(1, n):
            fig.update_xaxes(title_text="", showticklabels=True, row=i, col=1)
    fig.update_layout(barmode="overlay", bargap=0, uniformtext={"minsize": 9, "mode": "hide"})
    layout(
        fig,
        title=title or ("DDP step timeline" if n > 1 else describe_step(panels[0][0])),
        height=height,
    )
    fig.update_layout(
        margin={"t": 90 if n == 1 else 110, "b": 120},
        hoverlabel={"align": "left"},
        # Below the time axis whatever the figure's height (a fraction of the plot would not be).
        legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom", "x": 0},
    )
    if n == 1 and panel_titles is None:
        # One panel: its description is the title already; keep only the numbers above it.
        fig.layout.annotations[0].text = f"<sup>{summary_line(panels[0])}</sup>"
    return fig
