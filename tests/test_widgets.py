"""The DDP widgets, driven as a user would: values set on the controls, redraws and messages read
back. BucketExplorer measures on real ranks; OverlapExplorer only simulates."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dplab.ddp.buckets import bucket_plan
from dplab.models import make_model
from dplab.sim import (
    BackwardProfile,
    Contention,
    Link,
    ParamTiming,
    crossover_world_size,
    faster_compute,
)
from dplab.widgets import bucket_explorer as bucket_explorer_module
from dplab.widgets import overlap_explorer as overlap_explorer_module
from dplab.widgets.bucket_explorer import BucketExplorer
from dplab.widgets.overlap_explorer import OverlapExplorer
from tests.conftest import child_pids


def expected_buckets(model: str, cap: float) -> int:
    """The bucket count dplab.DDP must build (first bucket min(cap, 1 MiB))."""
    rows = [
        (n, p.numel(), p.numel() * 4, "f32")
        for n, p in reversed(list(make_model(model).named_parameters()))
    ]
    return len(bucket_plan(rows, bucket_cap_mb=cap, first_bucket_cap_mb=min(cap, 1.0)))


def classes(widget) -> set[str]:
    return set(widget._dom_classes)


# -- BucketExplorer --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def explorer(cluster2):
    ex = BucketExplorer(cluster2, bucket_cap_mb=1.0)
    yield ex
    ex.close()


def test_first_measurement_is_drawn_and_labelled(explorer):
    assert explorer.message == ""
    assert len(explorer.traces) == 2 and {t.rank for t in explorer.traces} == {0, 1}
    n = expected_buckets("tiny-gpt", 1.0)
    assert explorer.n_buckets == n
    assert explorer.count_html.value.startswith(f"<b>{n} buckets, step ")
    assert any(t.name == "all-reduce (hidden under backward)" for t in explorer.figure.data)
    assert "measured on this machine" in explorer.status_html.value
    assert explorer.progress.layout.visibility == "hidden" and not explorer.cap_slider.disabled


def test_moving_the_slider_re_measures_and_redraws(explorer):
    before = explorer.traces
    explorer.cap_slider.value = 0.25
    n = expected_buckets("tiny-gpt", 0.25)
    assert n != expected_buckets("tiny-gpt", 1.0)
    assert explorer.traces is not before and explorer.n_buckets == n
    assert explorer.traces[0].meta["bucket_cap_mb"] == 0.25
    assert explorer.count_html.value.startswith(f"<b>{n} buckets")
    hidden = next(t for t in explorer.figure.data if t.name.startswith("all-reduce (hidden"))
    assert len(hidden.x) == 2 * n  # both ranks, every bucket
    assert explorer.latency_s is not None and explorer.latency_s > 0


def test_neighbouring_slider_stops_change_the_bucket_count():
    """What the browser test relies on: one arrow key from the default changes the count."""
    ex = BucketExplorer(measure=False)
    stops = [v for _, v in ex.cap_slider.options]
    i = stops.index(ex.bucket_cap_mb)
    counts = [expected_buckets(ex.model, stops[j]) for j in (i - 1, i, i + 1)]
    assert len(set(counts)) == 3


def test_bad_values_are_refused_in_the_widget(explorer):
    kept = explorer.traces
    explorer.world_size_box.value = 0
    assert "world size must be a whole number in 1..8" in explorer.message
    assert "kept 2 ranks" in explorer.message_html.value
    assert explorer.world_size_box.value == 2 and explorer.traces is kept
    explorer.set_bucket_cap(-3)
    assert "bucket cap must be > 0 MiB, got -3" in explorer.message and explorer.traces is kept
    explorer.set_bucket_cap(0.3)  # off the slider's stops: added to them
    assert explorer.message == "" and explorer.bucket_cap_mb == 0.3
    assert explorer.n_buckets == expected_buckets("tiny-gpt", 0.3)


def test_a_failing_rank_is_a_message_not_a_traceback(explorer, monkeypatch):
    def boom(*args, **kwargs):
        if dist.get_rank() == 1:
            raise ValueError("planted failure on rank 1")
        return []

    kept = explorer.traces
    monkeypatch.setattr(bucket_explorer_module, "measure_ddp", boom)
    assert explorer.measure() is None
    assert "rank 1 failed: ValueError: planted failure on rank 1" in explorer.message
    assert "Measuring failed" in explorer.message_html.value
    assert explorer.traces is kept and not explorer.cap_slider.disabled


def test_stable_css_classes_for_the_browser_test(explorer):
    assert "dplab-bucket-explorer" in classes(explorer)
    assert "dplab-bucket-count" in classes(explorer.count_html)
    assert "dplab-bucket-cap" in classes(explorer.cap_slider)
    assert "dplab-timeline" in classes(explorer.figure)
    assert "dplab-message" in classes(explorer.message_html)


def test_a_new_world_size_restarts_its_own_pool_and_leaves_the_shared_one(cluster2):
    ex = BucketExplorer(cluster2, model="mlp")
    ex.world_size_box.value = 1
    assert ex.message == "" and ex.cluster is not cluster2 and ex.cluster.world_size == 1
    assert len(ex.traces) == 1 and ex.traces[0].world_size == 1
    assert cluster2.alive
    own = ex.cluster
    ex.close()
    assert not own.alive and cluster2.alive


def test_a_widget_that_starts_its_own_pool_stops_it():
    before = child_pids()
    ex = BucketExplorer(model="mlp", world_size=2)
    assert ex.message == "" and len(ex.traces) == 2
    ex.close()
    assert child_pids() <= before


def test_bad_constructor_arguments_raise():
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        BucketExplorer(model="gpt-9", measure=False)
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        BucketExplorer(bucket_cap_mb=0, measure=False)
    with pytest.raises(ValueError, match="world size must be"):
        BucketExplorer(world_size=99, measure=False)


# -- OverlapExplorer -------------------------------------------------------------------------------


def toy_profile(contention: Contention | None = None) -> BackwardProfile:
    """Eight 4 MB gradients over a 40 ms backward, the last-registered ready first."""
    return BackwardProfile(
        model="toy",
        params=tuple(
            ParamTiming(f"layer{i}.weight", 1_000_000, 4_000_000, "float32", 5.0 * (8 - i))
            for i in range(8)
        ),
        forward_ms=15.0,
        backward_ms=40.0,
        optimizer_ms=2.0,
        contention=contention,
    )


def test_world_size_and_link_change_the_simulated_step():
    ox = OverlapExplorer(toy_profile(), link="ib-400g", world_size=8, bucket_cap_mb=5.0)
    assert ox.trace.world_size == 8 and ox.trace.simulated
    comm_8 = ox.trace.metrics.t_comm_ms
    ox.world_size_slider.value = 1024
    assert ox.trace.world_size == 1024 and ox.trace.metrics.t_comm_ms > comm_8
    ox.link_dropdown.value = "25gbe"
    assert ox.link.name == "25gbe" and ox.bandwidth_box.value == pytest.approx(3.125)
    assert "25gbe" in ox.timeline.layout.title.text
    assert any(t.name == "current cap: 5 MiB" for t in ox.sweep_plot.data)


def test_compute_speed_up_turns_a_step_comms_bound():
    ox = OverlapExplorer(toy_profile(), link="25gbe", world_size=64)
    assert "compute-bound" in ox.verdict_html.value
    ox.speedup_slider.value = 100
    assert "comms-bound" in ox.verdict_html.value
    assert "100× faster than measured (what-if)" in ox.timeline.layout.title.text
    fast = faster_compute(toy_profile(), 4)
    assert fast.backward_ms == 10.0 and fast.params[0].ready_ms == 10.0
    assert fast.meta["compute_speedup"] == 4.0
    with pytest.raises(ValueError, match="speed-up must be a number > 0"):
        faster_compute(toy_profile(), 0)


def test_custom_link_values_and_refusals():
    ox = OverlapExplorer(toy_profile(), link="ib-400g")
    ox.bandwidth_box.value = 1.0
    assert ox.link.name == "custom" and ox.link_dropdown.value == "custom"
    assert ox.link.bandwidth_GBps == pytest.approx(1.0)
    good = ox.trace
    ox.latency_box.value = -5
    assert "latency must be >= 0 µs, got -5" in ox.message and ox.trace is good
    assert ox.latency_box.value == pytest.approx(ox.link.alpha_s * 1e6)  # put back
    ox.bandwidth_box.value = 0
    assert "bandwidth must be > 0 GB/s" in ox.message
    assert "bandwidth must be &gt; 0 GB/s" in ox.message_html.value


def test_a_link_that_cannot_be_loaded_is_refused(monkeypatch):
    def missing(name):
        raise FileNotFoundError("no measured loopback link at assets/x.json")

    monkeypatch.setattr(overlap_explorer_module, "get_link", missing)
    with pytest.raises(FileNotFoundError):
        OverlapExplorer(toy_profile(), link="gloo-loopback")
    ox = OverlapExplorer(toy_profile(), link=Link("mine", 1e-5, 1e10))
    ox.link_dropdown.value = "gloo-loopback"
    assert "no measured loopback link" in ox.message
    assert ox.link_dropdown.value != "gloo-loopback"


def test_extra_links_and_contention():
    mine = Link("this machine", 1e-4, 1e9, "measured in a test")
    slow = Contention(compute_slowdown=1.0)
    ox = OverlapExplorer(toy_profile(slow), link=mine, world_size=2, bucket_cap_mb=5.0)
    assert ox.link is mine and "measured in a test" in ox.link_html.value
    free = ox.trace.metrics.t_backward_ms
    ox.contention_box.value = True
    assert ox.trace.metrics.t_backward_ms > free  # sharing cores slows the backward
    assert OverlapExplorer(toy_profile()).contention_box.disabled  # nothing measured to apply


def test_crossover_world_size():
    profile = toy_profile()  # 57 ms compute, 32 MB of gradients
    assert crossover_world_size(profile, Link("slow", 0.0, 0.5e9)) == 2
    assert crossover_world_size(profile, Link("fast", 0.0, 1e12)) is None
