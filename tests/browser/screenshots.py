"""Refresh the README's screenshots from a real run of the course in JupyterLab and Chromium.

    python -m tests.browser.screenshots            # all of them, into assets/
    python -m tests.browser.screenshots --only memory-wall --out /tmp/shots

Each lesson is run top to bottom on this machine (so every number in a picture was measured
while taking it), then one element is photographed:

- ``screenshot-ring-stepper.png``: §3's ring all-reduce, stepped into the reduce-scatter;
- ``screenshot-bucket-explorer.png``: §8f's BucketExplorer, a measured DDP step per rank;
- ``screenshot-memory-wall.png``: §9's MemoryWall, one rank's memory and the verdict;
- ``screenshot-timeline.png``: the timeline that "Start here" teaches to read.

Run it under the CPU lock on a shared machine: ``flock /tmp/dplab-cpu.lock .venv/bin/python -m
tests.browser.screenshots``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.browser.lab import REPO, LabServer, Lesson, chromium, require_browser_reason


def output_of(lesson: Lesson, needle: str) -> Any:
    """The (first) output of the first cell whose source contains ``needle``, without the
    prompt."""
    node = lesson.cell_node(lesson.cell_index(needle))
    area = node.query_selector(".jp-OutputArea-output")
    if area is None:
        raise LookupError(f"{lesson.name}: the cell with {needle!r} has no output")
    return area


def ring_stepper(lesson: Lesson) -> Any:
    area = output_of(lesson, "RingStepper(")
    # Two steps into the reduce-scatter: partial sums are on the move.
    for _ in range(2):
        before = area.inner_text()
        next_button = area.query_selector("button:has-text('next')")
        if next_button is None:
            break
        next_button.click()
        lesson.page.wait_for_function(
            "([el, old]) => el.innerText !== old", arg=[area, before], timeout=30_000
        )
    return area


def bucket_explorer(lesson: Lesson, cap: str = "0.25 MiB") -> Any:
    """The explorer after moving its cap down to ``cap`` with the keyboard: more buckets, so
    the picture shows the all-reduces of several buckets overlapping backward."""
    explorer = lesson.page.locator(".dplab-bucket-explorer").first
    explorer.scroll_into_view_if_needed()
    readout = explorer.locator(".dplab-bucket-cap .widget-readout")
    count = explorer.locator(".dplab-bucket-count")
    handle = explorer.locator(".dplab-bucket-cap .noUi-handle")
    for _ in range(12):
        if (readout.text_content() or "").strip() == cap:
            break
        before = count.text_content()
        handle.focus()
        lesson.page.keyboard.press("ArrowLeft")
        lesson.page.wait_for_function(
            "([el, old]) => el.textContent !== old",
            arg=[count.element_handle(), before],
            timeout=180_000,
        )
    return explorer.element_handle()


def memory_wall(lesson: Lesson) -> Any:
    return lesson.page.locator(".dplab-memory-wall").first.element_handle()


def timeline(lesson: Lesson) -> Any:
    return output_of(lesson, "timeline_figure(step)")


@dataclass(frozen=True)
class Shot:
    name: str
    notebook: str
    element: Callable[[Lesson], Any]


SHOTS = [
    Shot("ring-stepper", "03b_batch_accumulation_allreduce.ipynb", ring_stepper),
    Shot("bucket-explorer", "08f_your_own_job.ipynb", bucket_explorer),
    Shot("memory-wall", "09_memory_wall.ipynb", memory_wall),
    Shot("timeline", "00_start_here.ipynb", timeline),
]


def take(shots: list[Shot], out: Path) -> list[Path]:
    notebooks = sorted({s.notebook for s in shots})
    written = []
    with (
        tempfile.TemporaryDirectory(prefix="dplab-shots-") as tmp,
        LabServer(Path(tmp), notebooks=notebooks) as server,
        chromium() as browser,
    ):
        for notebook in notebooks:
            t0 = time.monotonic()
            lesson = Lesson.open(browser, server, notebook)
            try:
                lesson.run_all()
                errors = lesson.errors()
                if errors:
                    raise RuntimeError(f"{notebook} has errors:\n" + "\n".join(errors))
                problems = lesson.wait_drawn()
                if problems:
                    raise RuntimeError(f"{notebook} is not drawn:\n" + "\n".join(problems))
                for shot in (s for s in shots if s.notebook == notebook):
                    element = shot.element(lesson)
                    element.scroll_into_view_if_needed()
                    time.sleep(0.5)  # let plotly finish its transitions
                    path = out / f"screenshot-{shot.name}.png"
                    out.mkdir(parents=True, exist_ok=True)
                    element.screenshot(path=str(path))
                    written.append(path)
                    print(f"{path} ({notebook}, {time.monotonic() - t0:.0f} s)")
            finally:
                lesson.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "assets"))
    parser.add_argument("--only", action="append", choices=[s.name for s in SHOTS])
    args = parser.parse_args(argv)
    reason = require_browser_reason()
    if reason:
        print(f"cannot take screenshots: {reason}", file=sys.stderr)
        return 2
    shots = [s for s in SHOTS if not args.only or s.name in args.only]
    missing = [s.notebook for s in shots if not (REPO / "notebooks" / s.notebook).exists()]
    if missing:
        print(f"missing notebooks: {', '.join(sorted(set(missing)))}", file=sys.stderr)
        return 2
    take(shots, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
