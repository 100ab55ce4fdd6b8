"""The course as a learner sees it: lessons run in JupyterLab in a real Chromium.

For the start page, the lessons whose widgets are used below, and the other lessons' widget
cells gathered in one notebook (every lesson whole with ``DPLAB_BROWSER_ALL=1``): Run All,
then no error output, every plotly figure drawn (its ``svg.main-svg``), every widget drawn.
Then the lessons' widgets are used as a learner uses them: the bucket-cap slider of §8f moved
with the keyboard re-measures the step and the bucket count changes; the model of §9's memory
wall changed with the dropdown changes the verdict.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest

from tests.browser.conftest import Lessons
from tests.browser.lab import NOTEBOOKS, Lesson, lesson_names

pytestmark = pytest.mark.browser


def _has_widgets(name: str) -> bool:
    return "dplab.widgets" in (NOTEBOOKS / name).read_text()


# nbval already runs every lesson and fails on any error; what only a browser can check is that
# widgets are drawn and answer. So CI opens the start page and the lessons whose widgets are
# used below (§8f's slider, §9's dropdown) whole; the other lessons' widget cells run verbatim in
# one small notebook (GALLERY), after a setup cell that loads what they need from assets/.
# DPLAB_BROWSER_ALL=1 opens every lesson whole (each costs about as long as its nbval run).
USED_BELOW = {"08f_your_own_job.ipynb", "09_memory_wall.ipynb"}
GALLERY = "widget_gallery.ipynb"
GALLERY_SETUP = (
    "import json\n"
    "from dplab.sim import BackwardProfile\n"
    "from dplab.sim.link import ASSETS\n"
    "# 08c's profile, measured on these 2 cores and saved: the widget needs no ranks\n"
    "profile = BackwardProfile.from_dict(json.loads((ASSETS / 'profile_gpt-7m.json').read_text()))"
)
EVERY_LESSON = os.environ.get("DPLAB_BROWSER_ALL") == "1"
LESSONS = sorted(
    name
    for name in lesson_names()
    if EVERY_LESSON or name == "00_start_here.ipynb" or name in USED_BELOW
)
DRAWN_ONLY = (
    [] if EVERY_LESSON else [n for n in lesson_names() if _has_widgets(n) and n not in USED_BELOW]
)
if DRAWN_ONLY:
    LESSONS.append(GALLERY)


def write_gallery(root: Path) -> None:
    """The widget cells of ``DRAWN_ONLY``'s lessons, verbatim, after ``GALLERY_SETUP``."""
    gallery = nbformat.v4.new_notebook()
    gallery.cells.append(nbformat.v4.new_code_cell(GALLERY_SETUP))
    for name in DRAWN_ONLY:
        cells = nbformat.read(NOTEBOOKS / name, as_version=4).cells
        widget_cells = [c for c in cells if c.cell_type == "code" and "dplab.widgets" in c.source]
        assert widget_cells, name
        gallery.cells.append(nbformat.v4.new_markdown_cell(f"From {name}:"))
        gallery.cells.extend(nbformat.v4.new_code_cell(c.source) for c in widget_cells)
    gallery.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3"}}
    nbformat.write(gallery, root / GALLERY)


WIDGET_TIMEOUT_MS = 180_000  # a re-measure on a busy 2-core machine, with room to spare


@pytest.mark.parametrize("name", LESSONS, ids=[n.removesuffix(".ipynb") for n in LESSONS])
def test_lesson_runs_and_draws(name: str, lessons: Lessons, pages_to_keep: list[Any]) -> None:
    if name == GALLERY:
        write_gallery(lessons.server.root)
    lesson = lessons.run(name, pages_to_keep)
    assert lesson.code_cells(), f"{name} has no code cells"
    errors = lesson.errors()
    assert not errors, f"{name} has error output:\n\n" + "\n\n".join(errors)
    unrun = [c["index"] for c in lesson.code_cells() if not c["count"]]
    assert not unrun, f"{name}: code cells {unrun} did not run"
    problems = lesson.wait_drawn()
    assert not problems, f"{name}: not drawn in the browser:\n" + "\n".join(problems)
    print(f"{name}: {lesson.timings}")


def _widget(lesson: Lesson, selector: str, widget: str, module: str, inner: str) -> Any:
    """The first element matching ``selector`` once the lesson is drawn, scrolled into view;
    a clear failure when the widget's root lacks the CSS class the test relies on."""
    assert not lesson.wait_drawn(), f"{lesson.name} is not fully drawn"
    found = lesson.page.locator(selector)
    if found.count() == 0:
        pytest.fail(
            f"{lesson.name}: no element {selector} on the page. The test finds the {widget} by "
            f"CSS classes that dplab/widgets/{module} gives it with add_class(...): "
            f"{selector.lstrip('.')!r} on the widget; inside it {inner}"
        )
    found.first.scroll_into_view_if_needed()
    return found.first


# -- §8f: the bucket explorer re-measures when its slider moves ----------------------------------


def _bucket_count(text: str) -> int:
    m = re.search(r"(\d+) buckets?\b", text)
    assert m, f"no bucket count in {text!r}"
    return int(m.group(1))


def test_bucket_explorer_slider_remeasures(lessons: Lessons, pages_to_keep: list[Any]) -> None:
    lesson = lessons.run("08f_your_own_job.ipynb", pages_to_keep, clean=True)
    page = lesson.page
    explorer = _widget(
        lesson,
        ".dplab-bucket-explorer",
        "BucketExplorer",
        "bucket_explorer.py",
        "'dplab-bucket-cap' on the cap slider, 'dplab-bucket-count' on the count, "
        "'dplab-timeline' on the figure",
    )
    count = explorer.locator(".dplab-bucket-count")
    readout = explorer.locator(".dplab-bucket-cap .widget-readout")
    handle = explorer.locator(".dplab-bucket-cap .noUi-handle")
    page.wait_for_function("el => /\\d+ buckets?/.test(el.textContent)", arg=count.element_handle())
    before_text, before_cap = count.text_content() or "", readout.text_content()
    before = _bucket_count(before_text)

    # A smaller cap cuts the same gradients into more buckets (a larger one may change nothing
    # when everything already fits one bucket), so move left unless the cap is the smallest.
    handle.focus()
    at_min = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemin")
    key = "ArrowRight" if at_min else "ArrowLeft"
    t0 = time.monotonic()
    page.keyboard.press(key)
    page.wait_for_function(
        "([el, old]) => el.textContent !== old", arg=[readout.element_handle(), before_cap]
    )
    page.wait_for_function(
        "([el, old]) => el.textContent !== old && /\\d+ buckets?/.test(el.textContent)",
        arg=[count.element_handle(), before_text],
        timeout=WIDGET_TIMEOUT_MS,
    )
    after_text = count.text_content() or ""
    after = _bucket_count(after_text)
    print(
        f"cap {before_cap} → {readout.text_content()}: {before_text!r} → {after_text!r} "
        f"in {time.monotonic() - t0:.1f} s"
    )
    if key == "ArrowLeft":
        assert after > before, f"smaller cap, yet {before} → {after} buckets"
    else:
        assert after < before, f"larger cap, yet {before} → {after} buckets"
    # The timeline itself was redrawn from the new step: its summary line names the new count.
    timeline = explorer.locator(".dplab-timeline")
    page.wait_for_function(
        """([el, want]) => [...el.querySelectorAll('svg text')]
                             .some(t => t.textContent.includes(want))""",
        arg=[timeline.element_handle(), f"{after} bucket{'s' if after != 1 else ''},"],
        timeout=30_000,
    )


# -- §9: the memory wall's verdict follows the model --------------------------------------------


def test_memory_wall_verdict_follows_the_model(lessons: Lessons, pages_to_keep: list[Any]) -> None:
    lesson = lessons.run("09_memory_wall.ipynb", pages_to_keep, clean=True)
    page = lesson.page
    wall = _widget(
        lesson,
        ".dplab-memory-wall",
        "MemoryWall",
        "memory.py",
        "'dplab-model' on the model dropdown, 'dplab-verdict' on the verdict",
    )
    select = wall.locator(".dplab-model select")
    verdict = wall.locator(".dplab-verdict")
    page.wait_for_function("el => el.textContent.trim().length > 0", arg=verdict.element_handle())
    before = verdict.text_content()
    model = select.evaluate("s => s.options[s.selectedIndex].textContent")
    labels = select.locator("option").all_text_contents()
    # Another preset model (not "custom", whose verdict follows the parameter slider).
    choice = next(label for label in labels if label != model and "custom" not in label)
    select.focus()
    select.select_option(label=choice)
    page.wait_for_function(
        "([el, old]) => el.textContent !== old", arg=[verdict.element_handle(), before]
    )
    after = " ".join((verdict.text_content() or "").split())  # no-break spaces → spaces
    print(f"{model}: {before!r}\n{choice}: {after!r}")
    # A preset's label ends with its parameter count, "(124 M)"; the verdict counts from it.
    count = re.search(r"\(([^()]+)\)\s*$", choice)
    if count:
        params = " ".join(count.group(1).split())
        assert f"{params} params" in after, f"the verdict is not about {choice!r}: {after!r}"
