"""One timeline panel's marks as plain data, gathered rank by rank before any plotly trace is made.

Per rank: the compute lane's spans, each collective on its comm sub-row with its exposed part,
a marker where each bucket became ready, and the perfect-overlap line; each with the hover text
that says what it is. Gathering first lets each kind become a single trace per panel (one legend
entry, one hover style) however many ranks and buckets the panel holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dplab._units import MIB
from dplab.trace import Span, StepTrace
from dplab.trace.metrics import COMM_KINDS, subtract
from dplab.viz.timeline_panels import comm_rows, comm_spans

COMPUTE_KINDS = ("forward", "backward", "wait", "optimizer")
BAR_WIDTH = 0.8
MAX_PARAMS_IN_HOVER = 8


class Bars:
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


@dataclass
class PanelMarks:
    """Everything one panel draws: the bars by kind, the bucket-ready markers, the
    perfect-overlap lines, and the y ticks that name each lane."""

    bars: dict[str, Bars] = field(
        default_factory=lambda: {k: Bars() for k in (*COMPUTE_KINDS, *COMM_KINDS, "exposed")}
    )
    ready_x: list[float] = field(default_factory=list)
    ready_y: list[float] = field(default_factory=list)
    ready_hover: list[str] = field(default_factory=list)
    predicted: list[tuple[float, float, float, str]] = field(default_factory=list)
    tickvals: list[float] = field(default_factory=list)
    ticktext: list[str] = field(default_factory=list)


def _add_compute_lane(marks: PanelMarks, trace: StepTrace, offset: float, y: float) -> None:
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
    marks: PanelMarks,
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
    marks: PanelMarks,
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
    marks: PanelMarks, trace: StepTrace, offset: float, y: float, n_rows: int
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


def panel_marks(panel: Sequence[StepTrace], *, align: str) -> PanelMarks:
    """Every mark of one panel, rank by rank from the top: each a compute lane, its comm sub-rows,
    its bucket-ready markers and its perfect-overlap line; then a gap to the next rank.

    With ``align="rank0"`` every rank is shifted onto rank 0's clock so a late rank shows.
    """
    marks = PanelMarks()
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
    return marks
