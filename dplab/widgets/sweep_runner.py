"""``SweepRunner``: a measured bucket-size sweep with a progress bar, then the U-curve.

Press *run*: every cap is measured ``repeats`` times on real ranks (the caps interleaved, one
direction then the other, so that a slow minute of the machine does not land on one cap), then,
if asked, the simulator draws its line over the points: the same model profiled on the same
ranks (:func:`dplab.sim.measure_profile`, with its measured compute/comm contention) and this
machine's loopback link (the saved α-β fit if there is one, else fitted now).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ipywidgets as w
import plotly.graph_objects as go

from dplab._units import KIB, MIB
from dplab.collectives import fit_alpha_beta, geometric_sizes, measure_bandwidth
from dplab.ddp import first_bucket_cap, measure_ddp
from dplab.ddp.buckets import check_cap_mb
from dplab.launch import Cluster, RankError, RankTimeout, check_capacity, check_world_size
from dplab.models import MODELS
from dplab.sim import Link, loopback_link, measure_profile
from dplab.sim import simulate as simulate_step
from dplab.trace import sweep_row
from dplab.viz.sweep import sweep_figure
from dplab.widgets._common import (
    CAPS_MB,
    classed,
    error_html,
    failure_html,
    placeholder_figure,
    short_error,
    show_figure,
    status_html,
)
from dplab.widgets.bucket_explorer import why_stopped

MAX_CAPS = 20
MAX_REPEATS = 10
DEFAULT_CAPS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 25.0)
_STYLE = {"description_width": "80px"}


def parse_caps(text: Any) -> list[float]:
    """'0.1, 1, 25' → [0.1, 1.0, 25.0]; anything else is a ValueError naming the bad part."""
    if isinstance(text, str):
        parts = [p.strip() for p in text.replace(";", ",").split(",") if p.strip()]
        values: list[Any] = []
        for p in parts:
            try:
                values.append(float(p))
            except ValueError:
                raise ValueError(f"{p!r} is not a number of MiB") from None
    elif isinstance(text, Sequence):
        values = list(text)
    else:
        raise ValueError(f"caps must be text like '0.1, 1, 25' or a list, got {text!r}")
    caps = sorted({check_cap_mb("bucket cap", v) for v in values})
    if len(caps) < 2:
        raise ValueError(f"a sweep needs at least 2 different caps, got {caps}")
    if len(caps) > MAX_CAPS:
        raise ValueError(f"at most {MAX_CAPS} caps per sweep, got {len(caps)}")
    return caps


def measured_link(cluster: Cluster, *, use_saved: bool = True) -> Link:
    """This machine's loopback link for the simulator: the saved fit when there is one,
    otherwise an α-β fit of ``dist.all_reduce`` timed now on ``cluster`` (about a second)."""
    if use_saved:
        try:
            return loopback_link()
        except (FileNotFoundError, ValueError):
            pass
    sizes = geometric_sizes(4 * KIB, 16 * MIB, 4)
    rows = measure_bandwidth(cluster=cluster, sizes=sizes, repeats=3, warmup=1)
    fit = fit_alpha_beta([r.size_bytes for r in rows], [r.time_s for r in rows], rows[0].world_size)
    return Link.from_beta(
        "this machine (fitted now)",
        fit.alpha_s,
        fit.beta_s_per_byte,
        f"α-β fit of dist.all_reduce on {rows[0].world_size} ranks, measured "
        f"{time.strftime('%Y-%m-%d %H:%M')} (max error {fit.max_rel_error:.0%})",
    )


class SweepRunner(w.VBox):
    """Caps, repeats and model → a measured sweep (progress bar), then the U-curve.

    ``.rows`` are the measured rows (one per rank per traced step), ``.simulated_rows`` the
    simulator's, ``.figure`` the FigureWidget, ``.message`` why a value was refused or a run
    failed. Nothing runs until :meth:`run` (or the button), unless ``run=True``. A
    ``world_size`` this machine cannot hold (cores, memory per rank) is refused at once;
    ``oversubscribe=True`` starts it anyway.
    """

    def __init__(
        self,
        cluster: Cluster | None = None,
        *,
        model: str = "gpt-7m",
        world_size: int = 2,
        caps: Sequence[float] | str = DEFAULT_CAPS,
        repeats: int = 2,
        steps: int = 2,
        batch_size: int = 2,
        simulate: bool = True,
        link: Link | None = None,
        run: bool = False,
        oversubscribe: bool = False,
    ):
        if cluster is None:
            # Refused here, not at the first run: 10 000 ranks would take the machine down.
            world_size = check_capacity(check_world_size(world_size), oversubscribe=oversubscribe)
        self._oversubscribe = oversubscribe
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
        caps = parse_caps(caps)
        for name, value, low, high in (
            ("repeats", repeats, 1, MAX_REPEATS),
            ("steps", steps, 1, 20),
            ("batch_size", batch_size, 1, 256),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an int in {low}..{high}, got {value!r}")
        self.cluster = cluster
        self._owns_cluster = cluster is None
        self.world_size = cluster.world_size if cluster is not None else world_size
        self.steps = steps
        self.link = link
        self.rows: list[dict[str, Any]] = []
        self.simulated_rows: list[dict[str, Any]] = []
        self.message = ""

        self._build_controls(model, caps, repeats, batch_size, simulate)
        self.run_button.on_click(lambda _: self.run())
        super().__init__(
            [
                w.HBox([self.model_dropdown, self.caps_text]),
                w.HBox([self.repeats_box, self.batch_box, self.simulate_box, self.run_button]),
                w.HBox([self.progress, self.status_html]),
                self.message_html,
                self.figure,
            ]
        )
        classed(self, "dplab-sweep-runner")
        show_figure(self.figure, placeholder_figure("press run sweep: the U-curve appears here"))
        self.status_html.value = status_html(
            f"{len(caps)} caps × {repeats} repeats on {self.world_size} ranks: press run sweep"
        )
        if run:
            self.run()

    def _build_controls(
        self, model: str, caps: list[float], repeats: int, batch_size: int, simulate: bool
    ) -> None:
        """The controls and outputs, each with the CSS class the browser tests find it by."""
        self.model_dropdown = classed(
            w.Dropdown(options=list(MODELS), value=model, description="model", style=_STYLE),
            "dplab-model",
        )
        self.caps_text = classed(
            w.Text(
                value=", ".join(f"{c:g}" for c in caps),
                description="caps MiB",
                style=_STYLE,
                layout=w.Layout(width="360px"),
            ),
            "dplab-caps",
        )
        self.repeats_box = classed(
            w.IntText(value=repeats, description="repeats", style=_STYLE, layout=_narrow()),
            "dplab-repeats",
        )
        self.batch_box = classed(
            w.IntText(value=batch_size, description="batch/rank", style=_STYLE, layout=_narrow()),
            "dplab-batch",
        )
        self.simulate_box = classed(
            w.Checkbox(value=simulate, description="simulated line", indent=False),
            "dplab-simulate",
        )
        self.run_button = classed(
            w.Button(description="run sweep", icon="play", button_style="primary"),
            "dplab-run-sweep",
        )
        self.progress = classed(
            w.IntProgress(value=0, min=0, max=1, layout=w.Layout(width="300px")),
            "dplab-progress",
        )
        self.status_html = classed(w.HTML(), "dplab-status")
        self.message_html = classed(w.HTML(), "dplab-message")
        self.figure = classed(go.FigureWidget(), "dplab-sweep")

    def _read(self) -> tuple[list[float], int, int]:
        caps = parse_caps(self.caps_text.value)
        repeats, batch = self.repeats_box.value, self.batch_box.value
        if not 1 <= repeats <= MAX_REPEATS:
            raise ValueError(f"repeats must be in 1..{MAX_REPEATS}, got {repeats}")
        if not 1 <= batch <= 256:
            raise ValueError(f"batch per rank must be in 1..256, got {batch}")
        return caps, repeats, batch

    def _tick(self, text: str) -> None:
        self.progress.value += 1
        self.status_html.value = status_html(
            f"{text} ({self.progress.value} of {self.progress.max})", busy=True
        )

    def run(self) -> list[dict[str, Any]] | None:
        """Measure the sweep (and the simulated line), then draw. None if refused or failed."""
        self.message = ""
        self.message_html.value = ""
        try:
            caps, repeats, batch = self._read()
        except ValueError as e:
            self.message = str(e)
            self.message_html.value = error_html(f"{e}. Nothing was run.")
            return None
        model, simulate = self.model_dropdown.value, self.simulate_box.value
        self.run_button.disabled = True
        self.progress.value = 0
        self.progress.max = len(caps) * repeats + (2 if simulate else 0)
        rows: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        try:
            self._ensure_cluster()
            for r in range(repeats):
                order = caps if r % 2 == 0 else caps[::-1]
                for cap in order:
                    results = self.cluster.run(
                        measure_ddp,
                        model,
                        bucket_cap_mb=cap,
                        first_bucket_cap_mb=first_bucket_cap(cap),
                        steps=self.steps,
                        warmup=1,
                        batch_size=batch,
                    )
                    rows += [sweep_row(t, repeat=r) for rank in results for t in rank]
                    self._tick(f"measured cap {cap:g} MiB, repeat {r + 1}")
            sim_rows: list[dict[str, Any]] = []
            if simulate:
                profile = measure_profile(
                    model,
                    cluster=self.cluster,
                    batch_size=batch,
                    steps=4,
                    warmup=1,
                    contention_repeats=3,
                )
                self._tick("profiled backward")
                link = self.link or measured_link(self.cluster)
                self.link = link
                self._tick(f"link: {link.name}")
                sim_rows = [
                    sweep_row(
                        simulate_step(
                            profile,
                            bucket_cap_mb=c,
                            first_bucket_cap_mb=first_bucket_cap(c),
                            world_size=self.world_size,
                            link=link,
                            contention=profile.contention,
                        )
                    )
                    for c in _dense(caps)
                ]
        except (RankError, RankTimeout, RuntimeError, ValueError, OSError) as e:
            self.message = f"the sweep failed: {short_error(e)}"
            self.message_html.value = failure_html("The sweep failed", short_error(e))
            self.status_html.value = ""
            return None
        finally:
            self.run_button.disabled = False
        self.rows, self.simulated_rows = rows, sim_rows
        title = f"{model}, {self.world_size} ranks, batch {batch}/rank: measured on this machine"
        if sim_rows:
            title += f" vs simulated ({self.link.name})"
        show_figure(self.figure, sweep_figure(rows, sim_rows or None, title=title))
        self.status_html.value = status_html(
            f"done: {len(caps)} caps × {repeats} repeats in {time.perf_counter() - t0:.1f} s"
        )
        return rows

    def _ensure_cluster(self) -> Cluster:
        """A live pool: the one given (or started before), restarted **in place** if a rank died
        or a run was interrupted, so that a pool shared with the notebook is usable there again
        too (before, the widget started a pool of its own and left the notebook's dead)."""
        c = self.cluster
        if c is not None and c.alive:
            return c
        if c is not None:
            self.status_html.value = status_html(
                f"restarting {c.world_size} ranks (the pool had stopped: {why_stopped(c)}; "
                "a few seconds)…",
                busy=True,
            )
            return c.restart()
        self.status_html.value = status_html(f"starting {self.world_size} ranks…", busy=True)
        self.cluster = Cluster(self.world_size, timeout_s=300, oversubscribe=self._oversubscribe)
        self._owns_cluster = True
        return self.cluster

    def close(self) -> None:
        """Stop the rank processes this widget started, and close the widget."""
        if getattr(self, "_owns_cluster", False) and self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        super().close()


def _narrow() -> w.Layout:
    return w.Layout(width="170px")


def _dense(caps: Sequence[float]) -> list[float]:
    """The simulator is cheap: the sweep's caps plus the slider stops between them."""
    lo, hi = min(caps), max(caps)
    return sorted(set(caps) | {c for c in CAPS_MB if lo <= c <= hi})
