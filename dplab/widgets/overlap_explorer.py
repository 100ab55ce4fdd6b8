"""``OverlapExplorer``: the simulator at any scale, instantly.

A measured :class:`~dplab.sim.BackwardProfile` (when each gradient is ready on this machine)
plus a link model gives a predicted step (:func:`dplab.sim.simulate`) for any fabric, world size
up to 1,024 and bucket cap; every change redraws the timeline, the simulated bucket-size sweep
and the verdict: is this step compute-bound or comms-bound?

One what-if knob is not a measurement: *compute speed-up* divides the profile's compute times by
k, to ask "what if the compute were k times faster than on this machine" (a GPU, or a smaller
per-GPU batch). It is labelled as such wherever it shows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real

import ipywidgets as w
import plotly.graph_objects as go

from dplab._units import GB, MIB
from dplab.ddp import first_bucket_cap
from dplab.ddp.buckets import check_cap_mb
from dplab.sim import (
    LINK_NAMES,
    WORLD_SIZES,
    BackwardProfile,
    Link,
    crossover_world_size,
    faster_compute,
    get_link,
    simulate,
    verdict,
)
from dplab.trace import StepTrace, best_cap, sweep_row
from dplab.viz.sweep import sweep_figure
from dplab.viz.timeline import timeline_figure
from dplab.widgets._common import CAPS_MB, cap_options, classed, error_html, show_figure

CUSTOM = "custom"
SPEEDUPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
_STYLE = {"description_width": "130px"}


class OverlapExplorer(w.VBox):
    """Fabric, world size, bucket cap → a simulated step, its sweep and its verdict.

    ``.trace`` is the simulated step on show, ``.link`` the link used, ``.message`` why a value
    was refused. ``links`` adds named links (say, this machine's loopback measured in the
    notebook) to the presets.
    """

    def __init__(
        self,
        profile: BackwardProfile,
        *,
        link: str | Link = "ib-400g",
        links: Mapping[str, Link] | None = None,
        world_size: int = 8,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = None,
        compute_speedup: float = 1,
        contention: bool = False,
    ):
        if not isinstance(profile, BackwardProfile):
            raise ValueError(f"profile must be a dplab.sim.BackwardProfile, got {profile!r}")
        self.profile = profile
        self.extra_links = dict(links or {})
        if isinstance(link, Link):
            self.extra_links.setdefault(link.name, link)
            link = link.name
        names = [*self.extra_links, *(n for n in LINK_NAMES if n not in self.extra_links)]
        cap = self._check_choices(link, names, world_size, bucket_cap_mb, compute_speedup)
        self.first_bucket_cap_mb = first_bucket_cap_mb
        first_bucket_cap(cap, first_bucket_cap_mb)  # checks it
        self.message = ""
        self.trace: StepTrace | None = None
        self.link: Link | None = None
        self._quiet = False
        first_link = self._named_link(link)  # a link that cannot be read fails here, loudly
        self._build_controls(link, names, world_size, cap, compute_speedup, contention)
        left = w.VBox([self.link_dropdown, self.bandwidth_box, self.latency_box])
        right = w.VBox(
            [self.world_size_slider, self.cap_slider, self.speedup_slider, self.contention_box]
        )
        super().__init__(
            [
                w.HBox([left, right]),
                self.message_html,
                self.link_html,
                self.verdict_html,
                self.timeline,
                self.sweep_plot,
            ]
        )
        classed(self, "dplab-overlap-explorer")
        self._use_link(first_link)

    def _check_choices(
        self, link: str, names: list[str], world_size: int, bucket_cap_mb: float, speedup: float
    ) -> float:
        """Refuse a value no control can show, naming it; return the checked cap."""
        if link not in names:
            raise ValueError(f"unknown link {link!r}; choose from {', '.join(names)}")
        if world_size not in WORLD_SIZES:
            raise ValueError(f"world_size must be one of {WORLD_SIZES}, got {world_size!r}")
        cap = check_cap_mb("bucket_cap_mb", bucket_cap_mb)
        faster_compute(self.profile, speedup)  # checks it
        if speedup not in SPEEDUPS:
            raise ValueError(f"compute_speedup must be one of {SPEEDUPS}, got {speedup!r}")
        return cap

    def _build_controls(
        self, link: str, names: list[str], world_size: int, cap: float, compute_speedup: float,
        contention: bool,
    ) -> None:  # fmt: skip
        """The controls and outputs, each with the CSS class the browser tests find it by."""
        profile = self.profile
        self.link_dropdown = classed(
            w.Dropdown(options=[*names, CUSTOM], value=link, description="link", style=_STYLE),
            "dplab-link",
        )
        self.bandwidth_box = classed(
            w.FloatText(description="bandwidth GB/s", style=_STYLE), "dplab-bandwidth"
        )
        self.latency_box = classed(
            w.FloatText(description="latency µs/step", style=_STYLE), "dplab-latency"
        )
        self.world_size_slider = _slider(
            [(f"{n:,}", n) for n in WORLD_SIZES], world_size, "world size", "dplab-world-size"
        )
        self.cap_slider = _slider(cap_options(cap), cap, "bucket cap", "dplab-bucket-cap")
        self.speedup_slider = _slider(
            [(f"{k:g}×", k) for k in SPEEDUPS], compute_speedup, "compute speed-up", "dplab-speedup"
        )
        self.contention_box = classed(
            w.Checkbox(
                value=bool(contention) and profile.contention is not None,
                description="comm and compute share CPU cores (as measured here)",
                disabled=profile.contention is None,
                indent=False,
                layout=w.Layout(width="460px"),
            ),
            "dplab-contention",
        )
        self.message_html = classed(w.HTML(), "dplab-message")
        self.link_html = classed(w.HTML(), "dplab-link-source")
        self.verdict_html = classed(w.HTML(), "dplab-verdict")
        self.timeline = classed(go.FigureWidget(), "dplab-timeline")
        self.sweep_plot = classed(go.FigureWidget(), "dplab-sweep")

        self.link_dropdown.observe(self._on_link, names="value")
        for box in (self.bandwidth_box, self.latency_box):
            box.observe(self._on_custom, names="value")
        for control in (
            self.world_size_slider,
            self.cap_slider,
            self.speedup_slider,
            self.contention_box,
        ):
            control.observe(self._on_change, names="value")

    # -- links ---------------------------------------------------------------------------------

    def _named_link(self, name: str) -> Link:
        if name in self.extra_links:
            return self.extra_links[name]
        return get_link(name)

    def _set_boxes(self, link: Link) -> None:
        self._quiet = True
        try:
            self.bandwidth_box.value = round(link.bandwidth_GBps, 6)
            self.latency_box.value = round(link.alpha_s * 1e6, 6)
        finally:
            self._quiet = False

    def _refuse(self, text: str) -> None:
        self.message = text
        self.message_html.value = error_html(text)

    def _on_link(self, change: dict) -> None:
        if self._quiet:
            return
        name = change["new"]
        if name == CUSTOM:
            self._on_custom({})
            return
        try:
            link = self._named_link(name)
        except (FileNotFoundError, ValueError) as e:
            self._quiet = True
            try:
                self.link_dropdown.value = self.link.name if self.link else CUSTOM
            finally:
                self._quiet = False
            self._refuse(str(e))
            return
        self._use_link(link)

    def _use_link(self, link: Link) -> None:
        self.link = link
        self._set_boxes(link)
        if link.name == "gloo-loopback" and self.profile.contention is not None:
            self._quiet = True
            try:
                self.contention_box.value = True
            finally:
                self._quiet = False
        self.redraw()

    def _on_custom(self, change: dict) -> None:
        if self._quiet:
            return
        bandwidth, latency = self.bandwidth_box.value, self.latency_box.value
        try:
            if not (isinstance(bandwidth, Real) and math.isfinite(bandwidth) and bandwidth > 0):
                raise ValueError(f"bandwidth must be > 0 GB/s, got {bandwidth!r}")
            if not (isinstance(latency, Real) and math.isfinite(latency) and latency >= 0):
                raise ValueError(f"latency must be >= 0 µs, got {latency!r}")
            link = Link(
                CUSTOM,
                latency * 1e-6,
                bandwidth * GB,
                "typed in: a what-if, not a measurement",
            )
        except ValueError as e:
            kept = self.link.describe() if self.link else "nothing"
            self._refuse(f"{e}; kept {kept}.")
            if self.link is not None:
                self._set_boxes(self.link)
            return
        self.link = link
        self._quiet = True
        try:
            self.link_dropdown.value = CUSTOM
        finally:
            self._quiet = False
        self.redraw()

    # -- drawing -------------------------------------------------------------------------------

    def _on_change(self, change: dict) -> None:
        if not self._quiet:
            self.redraw()

    def redraw(self) -> StepTrace | None:
        """Simulate with the controls' values and redraw everything (milliseconds)."""
        if self.link is None:
            return None
        self.message = ""
        self.message_html.value = ""
        n = int(self.world_size_slider.value)
        cap = float(self.cap_slider.value)
        k = float(self.speedup_slider.value)
        profile = faster_compute(self.profile, k)
        contention = self.profile.contention if self.contention_box.value else None
        kwargs = {"world_size": n, "link": self.link, "contention": contention}
        trace = simulate(
            profile,
            bucket_cap_mb=cap,
            first_bucket_cap_mb=first_bucket_cap(cap, self.first_bucket_cap_mb),
            **kwargs,
        )
        sweep_traces = [
            simulate(
                profile,
                bucket_cap_mb=c,
                first_bucket_cap_mb=first_bucket_cap(c, self.first_bucket_cap_mb),
                **kwargs,
            )
            for c in CAPS_MB
        ]
        rows = [sweep_row(t) for t in sweep_traces]
        best = best_cap(rows)
        crossing = crossover_world_size(profile, self.link)
        what_if = f", compute {k:g}× faster than measured (what-if)" if k != 1 else ""
        title = f"simulated: {profile.model}, {n:,} ranks on {self.link.name}{what_if}"
        show_figure(self.timeline, timeline_figure(trace, title=title))
        sweep_title = f"simulated sweep, {n:,} ranks on {self.link.name}{what_if}"
        show_figure(
            self.sweep_plot, sweep_figure([], rows, title=sweep_title, current_cap=cap, height=440)
        )
        self.trace = trace
        self.link_html.value = (
            f"<span style='color:#555'>{self.link.describe()}<br>source: "
            f"{self.link.source or '—'}</span>"
        )
        cross = (
            f"On this link one all-reduce of all {profile.total_bytes / MIB:,.1f} MiB of "
            f"gradients outlasts the step's compute from N = {crossing:,} on."
            if crossing
            else "Up to 1,024 ranks, one all-reduce of all gradients stays shorter than the "
            "step's compute on this link."
        )
        self.verdict_html.value = (
            f"<div class='dplab-verdict-text'><b>{verdict(trace)}</b><br>"
            f"Best cap here: {best:g} MiB. {cross}</div>"
        )
        return trace


def _slider(options: list, value: object, description: str, css_class: str) -> w.SelectionSlider:
    """One of the explorer's stepped sliders (a fixed set of stops, all the same width)."""
    return classed(
        w.SelectionSlider(
            options=options,
            value=value,
            description=description,
            style=_STYLE,
            layout=w.Layout(width="460px"),
        ),
        css_class,
    )
