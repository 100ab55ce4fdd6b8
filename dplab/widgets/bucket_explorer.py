"""``BucketExplorer``: move the bucket cap, get a *new measured* step from your own machine.

Every change of the bucket cap (or the model) re-runs real DDP steps on a warm
:class:`dplab.Cluster` (the rank processes, ``import torch`` and the process group are already
paid for) and redraws the timeline from what the ranks recorded: nothing is interpolated or
cached, so two measurements of the same cap differ by the machine's noise. A new world size
needs new rank processes, so the pool is restarted (a few seconds; the widget says so).

The first bucket's cap follows torch's small-first-bucket rule but never exceeds the cap itself:
``first_bucket_cap_mb = min(cap, 1 MiB)``.
"""

from __future__ import annotations

import time
from typing import Any

import ipywidgets as w
import plotly.graph_objects as go

from dplab._checks import check_world_size as _check_world_size
from dplab._units import MIB
from dplab.ddp import first_bucket_cap, measure_ddp
from dplab.ddp.buckets import DEFAULT_FIRST_BUCKET_CAP_MB, cap_bytes, check_cap_mb
from dplab.launch import Cluster, RankError, RankTimeout
from dplab.models import MODELS
from dplab.trace import StepTrace, last_steps
from dplab.viz.timeline import timeline_figure
from dplab.widgets._common import (
    cap_options,
    classed,
    error_html,
    failure_html,
    placeholder_figure,
    short_error,
    show_figure,
    status_html,
)

MAX_WORLD_SIZE = 8
_STYLE = {"description_width": "90px"}


def check_world_size(value: Any) -> int:
    return _check_world_size(
        value,
        maximum=MAX_WORLD_SIZE,
        name="world size",
        why="each rank is a process on this machine",
    )


def check_bucket_cap(value: Any, name: str = "bucket cap") -> float:
    """A cap DDP can build buckets with: a finite number of MiB that is at least one byte."""
    cap = check_cap_mb(name, value)
    if cap_bytes(cap) < 1:
        raise ValueError(
            f"{name} {value!r} MiB is {cap_bytes(cap)} bytes: a bucket cap must be at least "
            f"1 byte ({1 / MIB:.3g} MiB)"
        )
    return cap


def check_model(value: Any) -> str:
    if value not in MODELS:
        raise ValueError(f"unknown model {value!r}; choose from {', '.join(MODELS)}")
    return value


def bucket_count_text(trace: StepTrace) -> str:
    """'7 buckets, step 212 ms, exposed 1.5 ms' for one rank's step."""
    n = len(trace.buckets)
    m = trace.metrics
    return (
        f"{n} bucket{'s' if n != 1 else ''}, step {m.t_step_ms:,.0f} ms, "
        f"exposed {m.exposed_comm_ms:,.1f} ms"
    )


def _dead_rank_text(cluster: Cluster) -> str:
    """'rank 1 was killed by SIGKILL' for a pool whose process died, from its repr."""
    text = repr(cluster).split(", ", 2)[-1].removesuffix(")").removesuffix(": call .restart()")
    return text if text.startswith("rank ") else "a rank process had exited"


def why_stopped(cluster: Cluster) -> str:
    """Why a pool is no longer alive: its stop reason, or which rank process died (the widgets
    say it while they restart the pool in place)."""
    return cluster.dead_reason or _dead_rank_text(cluster)


class BucketExplorer(w.VBox):
    """Bucket cap, model and world size → a freshly measured DDP step, drawn per rank.

    ``.figure`` is the FigureWidget on show, ``.traces`` the last measured step (one StepTrace
    per rank), ``.message`` why a value was refused or a run failed ("" when all is well),
    ``.latency_s`` how long the last re-measure took from the change to the redrawn figure.
    Pass a warm ``cluster`` to share one with the notebook; otherwise the widget starts its own
    and :meth:`close` stops it.
    """

    def __init__(
        self,
        cluster: Cluster | None = None,
        *,
        model: str = "tiny-gpt",
        world_size: int | None = None,
        bucket_cap_mb: float = 1.0,
        batch_size: int = 8,
        steps: int = 1,
        warmup: int = 1,
        measure: bool = True,
    ):
        cap, world_size = _checked(cluster, model, world_size, bucket_cap_mb, batch_size, steps)
        self.batch_size, self.steps, self.warmup = batch_size, steps, warmup
        self.cluster = cluster
        self._owns_cluster = cluster is None
        self.world_size = world_size
        self.traces: list[StepTrace] = []
        self.message = ""
        self.latency_s: float | None = None
        self._quiet = False

        self._build_controls(cap, model, world_size)
        self.cap_slider.observe(self._on_change, names="value")
        self.model_dropdown.observe(self._on_change, names="value")
        self.world_size_box.observe(self._on_world_size, names="value")
        self.remeasure_button.on_click(lambda _: self.measure())
        controls = w.HBox(
            [self.cap_slider, self.model_dropdown, self.world_size_box, self.remeasure_button]
        )
        note = w.HTML(
            "<span style='color:#555'>Each change runs real DDP steps on this machine's ranks "
            f"(first bucket: min(cap, {DEFAULT_FIRST_BUCKET_CAP_MB:g} MiB)).</span>"
        )
        super().__init__(
            [
                controls,
                note,
                w.HBox([self.progress, self.status_html]),
                self.message_html,
                self.count_html,
                self.figure,
            ]
        )
        classed(self, "dplab-bucket-explorer")
        show_figure(self.figure, placeholder_figure("the measured timeline appears here"))
        if measure:
            self.measure()

    def _build_controls(self, cap: float, model: str, world_size: int) -> None:
        """The controls and outputs, each with the CSS class the browser tests find it by."""
        self.cap_slider = classed(
            w.SelectionSlider(
                options=cap_options(cap),
                value=cap,
                description="bucket cap",
                continuous_update=False,
                style=_STYLE,
                layout=w.Layout(width="420px"),
            ),
            "dplab-bucket-cap",
        )
        self.model_dropdown = classed(
            w.Dropdown(options=list(MODELS), value=model, description="model", style=_STYLE),
            "dplab-model",
        )
        # IntText, not a bounded box: a bad number must reach the check and be explained.
        self.world_size_box = classed(
            w.IntText(
                value=world_size,
                description="world size",
                style=_STYLE,
                layout=w.Layout(width="170px"),
            ),
            "dplab-world-size",
        )
        self.remeasure_button = classed(
            w.Button(description="measure again", icon="refresh"), "dplab-remeasure"
        )
        self.progress = classed(
            w.IntProgress(value=0, min=0, max=3, layout=w.Layout(width="160px")),
            "dplab-progress",
        )
        self.progress.layout.visibility = "hidden"
        self.status_html = classed(w.HTML(), "dplab-status")
        self.message_html = classed(w.HTML(), "dplab-message")
        self.count_html = classed(w.HTML(), "dplab-bucket-count")
        self.figure = classed(go.FigureWidget(), "dplab-timeline")

    # -- reading the controls ------------------------------------------------------------------

    @property
    def bucket_cap_mb(self) -> float:
        return float(self.cap_slider.value)

    @property
    def model(self) -> str:
        return str(self.model_dropdown.value)

    @property
    def n_buckets(self) -> int | None:
        return len(self.traces[0].buckets) if self.traces else None

    def set_bucket_cap(self, cap_mb: Any) -> None:
        """Set any cap (not only the slider's stops); a bad one is refused in the widget.

        A new cap is always measured. Replacing the slider's options moves its value to the
        first option, and a cap below every stop *is* the first option, so the value seen after
        the swap may already be the new cap: no change event would come, hence the explicit
        measure.
        """
        try:
            cap = check_bucket_cap(cap_mb)
        except ValueError as e:
            self._refuse(f"{e}; kept {self.bucket_cap_mb:g} MiB.")
            return
        if cap == self.bucket_cap_mb:
            return
        self._quiet = True
        try:
            if cap not in [v for _, v in self.cap_slider.options]:
                self.cap_slider.options = cap_options(cap)
            self.cap_slider.value = cap
        finally:
            self._quiet = False
        self.measure()

    # -- events --------------------------------------------------------------------------------

    def _on_change(self, change: dict) -> None:
        if not self._quiet:
            self.measure()

    def _on_world_size(self, change: dict) -> None:
        if self._quiet:
            return
        try:
            n = check_world_size(change["new"])
        except ValueError as e:
            self._quiet = True
            try:
                self.world_size_box.value = self.world_size
            finally:
                self._quiet = False
            self._refuse(f"{e}; kept {self.world_size} ranks.")
            return
        self.world_size = n
        self.measure()

    def _refuse(self, text: str) -> None:
        self.message = text
        self.message_html.value = error_html(text)

    def _busy(self, on: bool) -> None:
        for control in (
            self.cap_slider,
            self.model_dropdown,
            self.world_size_box,
            self.remeasure_button,
        ):
            control.disabled = on
        self.progress.layout.visibility = "visible" if on else "hidden"

    # -- measuring -----------------------------------------------------------------------------

    def _ensure_cluster(self) -> Cluster:
        """A live pool of ``world_size`` ranks: reuse it, restart it if it stopped (a rank
        died, a run was interrupted), or start a new one for a new world size; say which."""
        c = self.cluster
        if c is not None and c.alive and c.world_size == self.world_size:
            return c
        if c is not None and c.world_size == self.world_size:
            why = f"the pool had stopped: {why_stopped(c)}"
            self.status_html.value = status_html(
                f"restarting {self.world_size} ranks ({why}; a few seconds)…", busy=True
            )
            # In place, so a pool shared with the notebook is usable there again too.
            return c.restart()
        why = (
            "a new world size needs new rank processes"
            if c is not None
            else "starting the rank processes"
        )
        self.status_html.value = status_html(
            f"restarting: {self.world_size} ranks ({why}; a few seconds)…", busy=True
        )
        if c is not None and self._owns_cluster:
            c.close()
        self.cluster = Cluster(self.world_size, timeout_s=300)
        self._owns_cluster = True
        return self.cluster

    def measure(self) -> list[StepTrace] | None:
        """Re-measure with the current controls and redraw. Returns the per-rank traces, or
        None when the run failed (the reason is in ``.message`` and shown in the widget)."""
        t0 = time.perf_counter()
        self.message = ""
        self.message_html.value = ""
        self._busy(True)
        self.progress.value = 0
        cap, model = self.bucket_cap_mb, self.model
        try:
            cluster = self._ensure_cluster()
            self.progress.value = 1
            self.status_html.value = status_html(
                f"measuring {model} at bucket cap {cap:g} MiB on {self.world_size} ranks: "
                f"{self.warmup} warm-up + {self.steps} traced step(s)…",
                busy=True,
            )
            results = cluster.run(
                measure_ddp,
                model,
                bucket_cap_mb=cap,
                first_bucket_cap_mb=first_bucket_cap(cap),
                steps=self.steps,
                warmup=self.warmup,
                batch_size=self.batch_size,
            )
            self.progress.value = 2
            step = last_steps(results)
            fig = timeline_figure(step)
            show_figure(self.figure, fig)
            self.traces = step
            self.progress.value = 3
        except (RankError, RankTimeout, RuntimeError, ValueError, OSError) as e:
            self.message = f"measuring failed: {short_error(e)}"
            self.message_html.value = failure_html(
                "Measuring failed",
                f"{short_error(e)}. The figure shows the last good measurement; change a value "
                "to try again (a stopped pool is restarted).",
            )
            self.status_html.value = ""
            return None
        finally:
            self._busy(False)
        self.latency_s = time.perf_counter() - t0
        self.count_html.value = f"<b>{bucket_count_text(self.traces[0])}</b>" + (
            " (rank 0)" if len(self.traces) > 1 else ""
        )
        self.status_html.value = status_html(
            f"measured on this machine in {self.latency_s:.2f} s "
            f"({self.traces[0].backend}, {self.world_size} ranks, {self.traces[0].clock} clock)"
        )
        return self.traces

    def close(self) -> None:
        """Stop the rank processes this widget started, and close the widget."""
        if getattr(self, "_owns_cluster", False) and self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        super().close()


def _checked(
    cluster: Cluster | None, model: str, world_size: int | None, bucket_cap_mb: float,
    batch_size: int, steps: int,
) -> tuple[float, int]:  # fmt: skip
    """The checked cap and world size (the cluster's, if none given); a bad value is named."""
    check_model(model)
    cap = check_bucket_cap(bucket_cap_mb, "bucket_cap_mb")
    if world_size is None:
        world_size = cluster.world_size if cluster is not None else 2
    check_world_size(world_size)
    if cluster is not None and cluster.world_size != world_size:
        raise ValueError(f"world_size={world_size} but the cluster has {cluster.world_size} ranks")
    for name, value, low in (("batch_size", batch_size, 1), ("steps", steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return cap, world_size
