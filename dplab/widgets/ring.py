"""``RingStepper``: step through a ring all-reduce, one message round at a time.

Pick a world size (2..8) and a tensor length, then move the step slider (or press prev/next):
the figure shows each rank's chunks after that step, whose gradients each partial sum holds, and
which chunk just moved from which rank to which. It redraws from the pure schedule
(:func:`dplab.collectives.ring_schedule`), so nothing is launched and every step is instant; the
tests check that schedule against what real ranks send.
"""

from __future__ import annotations

import html

import ipywidgets as w
from IPython.display import display

from dplab._checks import check_int_in
from dplab.collectives import ring_steps
from dplab.viz.collectives import ring_step_figure

MIN_WORLD_SIZE = 2
MAX_WORLD_SIZE = 8
MAX_NUMEL = 10**9


_check = check_int_in


class RingStepper(w.VBox):
    """World size, tensor length and step controls above the ring figure for that step.

    ``.figure`` is the figure on show; ``.message`` says why a value was refused (empty when
    all is well). Bad values typed into the boxes are refused there, with the last good figure
    kept; bad values passed to the constructor raise ``ValueError``.
    """

    def __init__(self, world_size: int = 4, *, numel: int = 12, step: int = 0):
        world_size = _check("world size", world_size, MIN_WORLD_SIZE, MAX_WORLD_SIZE)
        numel = _check("tensor length", numel, 1, MAX_NUMEL)
        step = _check("step", step, 0, ring_steps(world_size))
        self.world_size, self.numel = world_size, numel
        self.world_size_box = w.IntText(
            value=world_size, description="world size", layout=w.Layout(width="150px")
        )
        self.numel_box = w.IntText(
            value=numel, description="elements", layout=w.Layout(width="190px")
        )
        self.step_slider = w.IntSlider(
            value=step,
            min=0,
            max=ring_steps(world_size),
            description="step",
            continuous_update=True,
            layout=w.Layout(width="340px"),
        )
        self.prev_button = w.Button(description="◀ prev", layout=w.Layout(width="80px"))
        self.next_button = w.Button(description="next ▶", layout=w.Layout(width="80px"))
        self.message_html = w.HTML()
        self.output = w.Output()
        self.figure = None
        self.message = ""
        self._quiet = False  # set while the widget changes its own controls

        self.world_size_box.observe(self._on_world_size, names="value")
        self.numel_box.observe(self._on_numel, names="value")
        self.step_slider.observe(self._on_step, names="value")
        self.prev_button.on_click(lambda _: self.go(-1))
        self.next_button.on_click(lambda _: self.go(+1))
        controls = w.HBox(
            [
                self.world_size_box,
                self.numel_box,
                self.prev_button,
                self.step_slider,
                self.next_button,
            ]
        )
        super().__init__([controls, self.message_html, self.output])
        self._redraw()

    @property
    def step(self) -> int:
        return self.step_slider.value

    def go(self, delta: int) -> None:
        """Move ``delta`` steps, staying within 0..2(N-1)."""
        self.step_slider.value = min(self.step_slider.max, max(0, self.step + delta))

    def _refuse(self, box: w.IntText, good: int, text: str) -> None:
        """Put the last good value back in ``box`` and say why the new one was refused."""
        self._quiet = True
        try:
            box.value = good
        finally:
            self._quiet = False
        self.message = text
        self.message_html.value = f'<span style="color:#E45756">{html.escape(text)}</span>'

    def _on_step(self, change: dict) -> None:
        if not self._quiet:
            self._redraw()

    def _on_world_size(self, change: dict) -> None:
        if self._quiet:
            return
        try:
            n = _check("world size", change["new"], MIN_WORLD_SIZE, MAX_WORLD_SIZE)
        except ValueError as e:
            self._refuse(self.world_size_box, self.world_size, f"{e}; kept N={self.world_size}.")
            return
        self.world_size = n
        total = ring_steps(n)
        self._quiet = True
        try:  # keep the step where it still exists; lower the value before the max
            self.step_slider.value = min(self.step_slider.value, total)
            self.step_slider.max = total
        finally:
            self._quiet = False
        self._redraw()

    def _on_numel(self, change: dict) -> None:
        if self._quiet:
            return
        try:
            self.numel = _check("tensor length", change["new"], 1, MAX_NUMEL)
        except ValueError as e:
            self._refuse(self.numel_box, self.numel, f"{e}; kept {self.numel:,} elements.")
            return
        self._redraw()

    def _redraw(self) -> None:
        self.message = ""
        self.message_html.value = ""
        self.prev_button.disabled = self.step == 0
        self.next_button.disabled = self.step == self.step_slider.max
        self.figure = ring_step_figure(self.world_size, self.step, numel=self.numel)
        with self.output:
            self.output.clear_output(wait=True)
            display(self.figure)
