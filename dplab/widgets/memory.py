"""``MemoryWall``: pick a model, a recipe, a GPU and a data-parallel layout; see one rank's memory.

Every control feeds :func:`dplab.memory.fits`; the figure is :func:`dplab.viz.memory.fit_figure`
and the verdict is the sentence :func:`dplab.memory.verdict` builds from the numbers. A value the
model cannot take (a world size of 0, a sequence of -5 tokens) is refused with a message in the
widget; the last good figure stays on screen.
"""

from __future__ import annotations

import html
import math
from numbers import Real
from typing import Any

import ipywidgets as w
import plotly.graph_objects as go

from dplab.memory.activations import RECOMPUTE
from dplab.memory.fit import Fit, fits, fmt_gb, fmt_params
from dplab.memory.presets import GPUS, LLM_SHAPES
from dplab.memory.recipes import OPTIMIZER_LABELS, PRECISION_LABELS
from dplab.memory.state import STAGE_LABELS
from dplab.viz.memory import MeasuredPerParam, fit_figure
from dplab.widgets._common import classed

CUSTOM = "custom"
_STYLE = {"description_width": "110px"}
_WIDE = w.Layout(width="340px")
FIGURE_WIDTH = 1000  # px: room for both panels and the legend
# The parameter slider's range, as powers of ten: 100 M (smaller models fit anywhere) to 1 T.
N_PARAMS_LOG10 = (8, 12)


def check_n_params(value: Any) -> float:
    """A parameter count the slider can show. The slider would silently clamp anything else
    (1e13 to 1e12), and the figure would then be for a model nobody asked about."""
    lo, hi = (10.0**e for e in N_PARAMS_LOG10)
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"n_params must be a finite number of parameters, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(
            f"n_params={value:g} is outside the parameter slider's range {lo:g}..{hi:g} "
            "(100 M to 1 T parameters); the slider would clamp it to "
            f"{min(max(value, lo), hi):g}. For other sizes use "
            "dplab.memory.fits(n_params, gpu) or python -m dplab memory --params N"
        )
    return float(value)


class MemoryWall(w.VBox):
    """The memory-wall explorer. ``wall.fit`` is the last good :class:`~dplab.memory.Fit`,
    ``wall.verdict.value`` its sentence, ``wall.message.value`` the refusal of a bad value.

    ``measured``: model-state bytes per parameter measured on real ranks, by recipe
    ``(precision, optimizer)``, ZeRO stage and world size (see :func:`~dplab.viz.fit_figure`);
    the points of the chosen recipe are drawn as crosses beside the curves.
    """

    def __init__(
        self,
        *,
        model: str = "llama2-7b",
        n_params: float = 7e9,
        precision: str = "mixed",
        optimizer: str = "adam",
        gpu: str = "h100-80gb",
        micro_batch: int = 1,
        seq_len: int = 2048,
        world_size: int = 8,
        zero_stage: int = 0,
        recompute: str = "none",
        measured: MeasuredPerParam | None = None,
    ):
        n_params = check_n_params(n_params)
        self.measured = measured
        self._model_controls(model, n_params, precision, optimizer, gpu)
        # IntText, not BoundedIntText: a bad number must reach the check and be explained.
        self.micro_batch = w.IntText(micro_batch, description="micro-batch", style=_STYLE)
        self.seq_len = w.IntText(seq_len, description="sequence length", style=_STYLE)
        self.world_size = w.IntText(world_size, description="world size N", style=_STYLE)
        self.zero_stage = w.Dropdown(
            options=[(label, k) for k, label in STAGE_LABELS.items()],
            value=zero_stage,
            description="ZeRO stage",
            style=_STYLE,
        )
        self.recompute = w.Dropdown(
            options=list(RECOMPUTE), value=recompute, description="recompute", style=_STYLE
        )
        self.verdict = w.HTML()
        self.message = w.HTML()
        self.figure = go.FigureWidget()
        self.fit: Fit | None = None

        controls = [
            self.model,
            self.n_params,
            self.precision,
            self.optimizer,
            self.gpu,
            self.micro_batch,
            self.seq_len,
            self.world_size,
            self.zero_stage,
            self.recompute,
        ]
        for control in controls:
            control.observe(self._on_change, names="value")
        left = w.VBox(controls[:5])
        right = w.VBox(controls[5:])
        super().__init__([w.HBox([left, right]), self.message, self.verdict, self.figure])
        classed(self, "dplab-memory-wall")  # stable hooks for the browser tests
        classed(self.model, "dplab-model")
        classed(self.verdict, "dplab-verdict")
        self.update()

    def _model_controls(
        self, model: str, n_params: float, precision: str, optimizer: str, gpu: str
    ) -> None:
        """What is trained and on what: the model (or a parameter count), the precision recipe,
        the optimizer, the GPU."""
        self.model = w.Dropdown(
            options=[
                (f"{m.name} ({fmt_params(m.n_params).removesuffix(' params')})", k)
                for k, m in LLM_SHAPES.items()
            ]
            + [("custom parameter count", CUSTOM)],
            value=model,
            description="model",
            style=_STYLE,
            layout=_WIDE,
        )
        self.n_params = w.FloatLogSlider(
            value=n_params,
            base=10,
            min=N_PARAMS_LOG10[0],
            max=N_PARAMS_LOG10[1],
            step=0.01,
            description="parameters",
            readout_format=".3s",
            style=_STYLE,
            layout=_WIDE,
            continuous_update=False,
        )
        self.precision = w.Dropdown(
            options=[(label, k) for k, label in PRECISION_LABELS.items()],
            value=precision,
            description="precision",
            style=_STYLE,
            layout=_WIDE,
        )
        self.optimizer = w.Dropdown(
            options=[(label, k) for k, label in OPTIMIZER_LABELS.items()],
            value=optimizer,
            description="optimizer",
            style=_STYLE,
            layout=_WIDE,
        )
        self.gpu = w.Dropdown(
            options=[(f"{g.name} ({g.memory_gib} GiB)", k) for k, g in GPUS.items()],
            value=gpu,
            description="GPU",
            style=_STYLE,
            layout=_WIDE,
        )

    def _on_change(self, change: dict) -> None:
        self.update()

    def _read(self) -> Fit:
        model = self.model.value
        return fits(
            round(self.n_params.value) if model == CUSTOM else model,  # a count is whole
            self.gpu.value,
            precision=self.precision.value,
            optimizer=self.optimizer.value,
            world_size=self.world_size.value,
            zero_stage=self.zero_stage.value,
            micro_batch=self.micro_batch.value,
            seq_len=self.seq_len.value,
            recompute=self.recompute.value,
        )

    def update(self) -> None:
        """Recompute from the controls; refuse a bad value with a message, never a traceback."""
        self.n_params.disabled = self.model.value != CUSTOM
        try:
            fit = self._read()
        except ValueError as e:
            self.message.value = (
                f"<div style='color:#B03A2E'><b>Not drawn:</b> {html.escape(str(e))}. "
                "The figure and verdict below are for the last good values.</div>"
            )
            return
        self.fit = fit
        self.message.value = ""
        colour = "#2E7D32" if fit.fits else "#B03A2E"
        self.verdict.value = (
            f"<div style='font-size:15px;max-width:980px;border-left:5px solid {colour};"
            f"padding-left:10px'>{html.escape(fit.reason)}"
            f"<div style='color:#555;font-size:13px'>per rank: {fmt_gb(fit.total)} of "
            f"{fmt_gb(fit.gpu.capacity_bytes)}</div></div>"
        )
        new = fit_figure(fit, measured=self.measured)
        with self.figure.batch_update():
            self.figure.data = ()
        self.figure.add_traces(list(new.data))
        self.figure.layout = new.layout
        self.figure.layout.width = FIGURE_WIDTH
