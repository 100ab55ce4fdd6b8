"""The DDP figures: timeline lanes, exposed parts, bucket map and sweep, read back from the
figure objects (what is drawn where), on hand-made steps, a simulated one and a measured one."""

from __future__ import annotations

import dataclasses
import math

import plotly.graph_objects as go
import pytest

from dplab.ddp import measure_ddp
from dplab.ddp.buckets import bucket_plan
from dplab.models import make_model, param_sizes_of
from dplab.sim import BackwardProfile, ParamTiming, get_link, simulate
from dplab.trace import Span, StepTrace, best_cap, sweep_row
from dplab.trace.metrics import length
from dplab.viz.buckets import bucket_map_figure
from dplab.viz.sweep import sweep_figure
from dplab.viz.timeline import comm_rows, panels_of, timeline_figure

MIB = 1024 * 1024


def step(
    comms: list[tuple[float, float]],
    *,
    rank: int = 0,
    origin_ms: float = 0.0,
    backward: tuple[float, float] = (10.0, 40.0),
    meta: dict | None = None,
) -> StepTrace:
    """A hand-made step: forward 0-10, backward, one all-reduce per (start, end), optimizer."""
    spans = [
        Span("forward", "forward", 0.0, 10.0),
        Span("backward", "backward", *backward),
    ]
    buckets = []
    for b, (start, end) in enumerate(comms):
        spans.append(Span(f"bucket {b} ready", "bucket_ready", start, start, b, 400 * (b + 1)))
        spans.append(Span(f"all-reduce bucket {b}", "allreduce", start, end, b, 400 * (b + 1)))
        buckets.append(
            {"index": b, "param_names": [f"layer{b}.weight", f"layer{b}.bias"], "nbytes": 400}
        )
    last = max([backward[1], *(e for _, e in comms)])
    spans.append(Span("wait", "wait", backward[1], last))
    spans.append(Span("optimizer", "optimizer", last, last + 2.0))
    return StepTrace(
        rank=rank,
        world_size=2,
        backend="gloo",
        device="cpu",
        clock="host",
        step=0,
        spans=spans,
        buckets=buckets,
        origin_ms=origin_ms,
        meta=meta or {"variant": "bucketed", "bucket_cap_mb": 1.0},
    )


def bars(fig: go.Figure, name_part: str) -> list[go.Bar]:
    return [t for t in fig.data if t.type == "bar" and name_part in (t.name or "")]


def bar_total(fig: go.Figure, name_part: str) -> float:
    return sum(sum(t.x) for t in bars(fig, name_part))


# -- timeline: input ---------------------------------------------------------------------------


def test_inputs_normalise_to_panels_of_ranks():
    a, b = step([(20, 30)], rank=0), step([(20, 30)], rank=1)
    assert panels_of(a) == [[a]]
    assert panels_of([b, a]) == [[a, b]]  # ranks sorted
    assert panels_of([[a, b], [a]]) == [[a, b], [a]]
    assert panels_of([a.to_dict()])[0][0].spans == a.spans  # dicts read back


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "no traces"),
        ("trace", "needs a StepTrace"),
        ([step([]), [step([])]], "mixed input"),
        ([step([]), step([])], "holds rank 0 twice"),
        ([[]], "panel 0 has no traces"),
        ({"format": "nope"}, "not a dplab step trace"),
    ],
)
def test_bad_inputs_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        timeline_figure(bad)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="align must be one of"):
        timeline_figure(step([]), align="rank1")
    with pytest.raises(ValueError, match="arrange must be"):
        timeline_figure(step([]), arrange="grid")
    with pytest.raises(ValueError, match="2 panel titles for 1 panels"):
        timeline_figure(step([]), panel_titles=["a", "b"])


# -- timeline: what is drawn -------------------------------------------------------------------


def test_overlapping_collectives_get_sub_rows():
    assert comm_rows(step([(20, 30), (25, 35), (31, 40)])) == [0, 1, 0]
    assert comm_rows(step([(20, 30), (30, 35)])) == [0, 0]  # back to back: one row
    fig = timeline_figure(step([(20, 30), (25, 35)]))
    assert list(fig.layout.yaxis.ticktext) == ["rank 0 compute", "rank 0 comm ·1", "rank 0 comm ·2"]
    ys = sorted(y for t in bars(fig, "hidden") for y in t.y)
    assert ys == [1.0, 2.0]  # the two all-reduces sit on different rows


def test_exposed_parts_are_drawn_and_add_up_to_the_metric():
    # backward 10-40; bucket 0 fully hidden, bucket 1 half exposed, bucket 2 fully exposed
    trace = step([(15, 25), (35, 45), (45, 50)])
    fig = timeline_figure(trace)
    assert bar_total(fig, "exposed") == pytest.approx(trace.metrics.exposed_comm_ms) == 10.0
    assert bar_total(fig, "hidden") == pytest.approx(10 + 10 + 5)  # every all-reduce, whole
    exposed = bars(fig, "exposed")[0]
    assert list(exposed.base) == [40.0, 45.0] and list(exposed.text) == ["b1", "b2"]


def test_a_fully_hidden_step_draws_no_exposed_bar():
    fig = timeline_figure(step([(15, 20), (25, 38)]))
    assert bar_total(fig, "exposed") == 0.0
    assert not bars(fig, "exposed")


def test_hover_names_bucket_bytes_parameters_and_times():
    fig = timeline_figure(step([(15, 25), (26, 30)]))
    hover = bars(fig, "hidden")[0].hovertext[1]
    assert "bucket 1" in hover and "800 B" in hover
    assert "layer1.weight" in hover and "layer1.bias" in hover
    assert "26.00 → 30.00 ms (4.00 ms)" in hover


def test_ready_markers_and_the_prediction_line():
    trace = step([(15, 25), (35, 45)])
    fig = timeline_figure(trace)
    ready = next(t for t in fig.data if t.name == "bucket ready")
    assert list(ready.x) == [15.0, 35.0]
    line = next(t for t in fig.data if t.name.startswith("max(T_compute"))
    xs = [x for x in line.x if x is not None]
    m = trace.metrics
    assert xs == [pytest.approx(max(m.t_compute_ms, m.t_comm_ms))] * 3
    assert m.t_step_ms >= xs[0]  # the bound is never beaten


def test_align_rank0_shifts_a_late_rank_and_step_does_not():
    a = step([(15, 25)], rank=0, origin_ms=100.0)
    b = step([(15, 25)], rank=1, origin_ms=103.0)
    shifted = timeline_figure([a, b], align="rank0")
    forward = next(t for t in shifted.data if t.name == "forward")
    assert list(forward.base) == [0.0, 3.0]
    own = timeline_figure([a, b], align="step")
    assert list(next(t for t in own.data if t.name == "forward").base) == [0.0, 0.0]


def test_several_panels_share_one_time_axis_and_legend_entries_once():
    fig = timeline_figure([[step([(15, 25)])], [step([(45, 60)])], [step([])]])
    assert fig.layout.xaxis3.matches == "x" or fig.layout.xaxis.matches == "x3"  # shared time
    named = [t.name for t in fig.data if t.showlegend]
    assert len(named) == len(set(named))
    assert len(fig.layout.annotations) == 3  # one title per panel
    side = timeline_figure([[step([(15, 25)])], [step([])]], arrange="side")
    assert side.layout.xaxis2.domain[0] > side.layout.xaxis.domain[1]


def test_panel_titles_say_what_ran_and_its_numbers():
    naive = step([(40, 50)], meta={"variant": "naive", "model": "tiny-gpt"})
    fig = timeline_figure([[naive], [step([(15, 25)])]])
    assert fig.layout.annotations[0].text.startswith("naive · tiny-gpt · 2 ranks · measured")
    assert "exposed comm 10.0 ms of 10.0" in fig.layout.annotations[0].text
    assert "cap 1 MiB" in fig.layout.annotations[1].text


def _profile() -> BackwardProfile:
    names = [f"l{i}.weight" for i in range(6)]
    # backward 60 ms; the last-registered layer's gradient is ready first
    return BackwardProfile(
        model="toy",
        params=tuple(
            ParamTiming(n, 250_000, 1_000_000, "float32", 10.0 * (6 - i))
            for i, n in enumerate(names)
        ),
        forward_ms=20.0,
        backward_ms=60.0,
        optimizer_ms=3.0,
    )


def test_a_simulated_step_draws_the_same_way():
    trace = simulate(
        _profile(),
        bucket_cap_mb=1.0,
        first_bucket_cap_mb=1.0,
        world_size=1024,
        link=get_link("25gbe"),
    )
    fig = timeline_figure(trace)
    assert "1,024 ranks · simulated on 25gbe" in fig.layout.title.text
    assert bar_total(fig, "exposed") == pytest.approx(trace.metrics.exposed_comm_ms)
    # 1 MB gradients, 1 MiB cap: two per bucket
    assert sum(len(t.x) for t in bars(fig, "hidden")) == len(trace.buckets) == 3


# -- bucket map ----------------------------------------------------------------------------------


def test_bucket_map_of_a_real_model_follows_reverse_registration_order():
    model = make_model("tiny-gpt")
    sizes = param_sizes_of(model)
    rows = [(n, s // 4, s, "f32") for n, s in reversed(sizes.items())]
    plan = bucket_plan(rows, bucket_cap_mb=0.25, first_bucket_cap_mb=0.25)
    buckets = [
        {"index": b, "param_names": [rows[j][0] for j in m], "nbytes": sum(rows[j][2] for j in m)}
        for b, m in enumerate(plan)
    ]
    fig = bucket_map_figure(buckets, sizes, cap_mb=0.25)
    bar = fig.data[0]
    assert len(bar.x) == len(sizes)  # one segment per parameter
    order = list(sizes)
    # bucket 0 holds the last-registered parameters: colour = registration index
    first_bucket = [c for c, y in zip(bar.marker.color, bar.y, strict=True) if y == "bucket 0"]
    assert min(first_bucket) > len(order) / 2
    widths = {}
    for w, y in zip(bar.x, bar.y, strict=True):
        widths[y] = widths.get(y, 0.0) + w
    for b in buckets:
        assert widths[f"bucket {b['index']}"] == pytest.approx(b["nbytes"] / MIB)
    assert [s.x0 for s in fig.layout.shapes] == [0.25]
    assert any(a.text == "cap 0.25 MiB" for a in fig.layout.annotations)


def test_bucket_map_takes_bucket_objects_traces_and_refuses_bad_input():
    trace = step([(15, 25), (26, 30)])
    fig = bucket_map_figure(trace)  # no sizes: one cell per parameter
    assert list(fig.data[0].x) == [1.0] * 4
    assert "one cell each" in fig.layout.xaxis.title.text
    with pytest.raises(ValueError, match=r"no size for 'layer0\.weight'"):
        bucket_map_figure(trace.buckets, {"layer1.weight": 4})
    with pytest.raises(ValueError, match="no buckets"):
        bucket_map_figure([])
    with pytest.raises(ValueError, match="not a bucket"):
        bucket_map_figure([{"nbytes": 3}])


# -- sweep ---------------------------------------------------------------------------------------


def _row(cap: float, t_step: float, exposed: float = 1.0) -> dict:
    return {"bucket_cap_mb": cap, "t_step_ms": t_step, "exposed_comm_ms": exposed, "n_buckets": 3}


def test_sweep_draws_points_medians_and_the_simulated_line():
    measured = [_row(0.1, 30), _row(0.1, 34), _row(0.1, 90), _row(1, 20), _row(25, 26)]
    simulated = [_row(c, 25 - math.log10(c)) for c in (0.1, 1, 10, 25)]
    fig = sweep_figure(measured, simulated, current_cap=1)
    points = next(t for t in fig.data if t.name.startswith("measured (each"))
    assert len(points.x) == 5
    median = next(t for t in fig.data if t.name == "measured median")
    assert list(median.x) == [0.1, 1.0, 25.0] and list(median.y) == [34.0, 20.0, 26.0]
    assert any(t.name == "simulated" for t in fig.data)
    assert any(t.name == "fastest measured: 1 MiB" for t in fig.data)
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis2.type == "log"


def test_best_cap_prefers_the_middle_of_a_tie():
    rows = [_row(c, s) for c, s in ((0.1, 50), (1, 40), (5, 40), (25, 40), (50, 45))]
    assert best_cap(rows) == 5
    assert best_cap([_row(1, 3), _row(2, 1)]) == 2


def test_sweep_refuses_rows_it_cannot_draw():
    with pytest.raises(ValueError, match="no rows"):
        sweep_figure([])
    with pytest.raises(ValueError, match="has no 'exposed_comm_ms'"):
        sweep_figure([{"bucket_cap_mb": 1, "t_step_ms": 2}])
    with pytest.raises(ValueError, match="bad bucket_cap_mb"):
        sweep_figure([_row(-1, 2)])
    with pytest.raises(ValueError, match="does not say its bucket cap"):
        sweep_row(dataclasses.replace(step([]), meta={}))


# -- a measured step -----------------------------------------------------------------------------


def test_a_measured_two_rank_step_draws_every_bucket_on_both_ranks(cluster2):
    results = cluster2.run(measure_ddp, "tiny-gpt", bucket_cap_mb=0.25, steps=1, warmup=1)
    ranks = [r[0] for r in results]
    fig = timeline_figure(ranks)
    hidden = bars(fig, "hidden")[0]
    n_buckets = len(ranks[0].buckets)
    assert len(hidden.x) == 2 * n_buckets == sum(t.metrics.n_allreduce for t in ranks)
    for trace in ranks:
        lanes = [t for t in fig.layout.yaxis.ticktext if t.startswith(f"rank {trace.rank}")]
        assert lanes[0] == f"rank {trace.rank} compute"
        assert len(lanes) - 1 == max(comm_rows(trace)) + 1 <= trace.meta["comm_lanes"]
    # Exposed bars are drawn per collective; two that run at once count once in the metric.
    exposed = bars(fig, "exposed")[0] if bars(fig, "exposed") else None
    for trace in ranks:
        pieces = (
            [
                (b, b + x)
                for b, x, h in zip(exposed.base, exposed.x, exposed.hovertext, strict=True)
                if f"rank {trace.rank} ·" in h
            ]
            if exposed is not None
            else []
        )
        assert length(pieces) == pytest.approx(trace.metrics.exposed_comm_ms, abs=1e-6)
    bucket_map_figure(ranks[0], param_sizes_of(make_model("tiny-gpt")), cap_mb=0.25)
