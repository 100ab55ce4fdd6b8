"""``python -m dplab html``: the static pages open offline with their figures drawn.

The browser test builds one lesson with the real command, opens the page from disk in Chromium
with every request outside file:// refused, and checks that each plotly figure in it is drawn.
The small tests below it check the page-building pieces without a kernel or a browser.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest

from dplab.cli.html import index_html, lesson_paths, replace_widgets, title_of
from tests.browser.lab import NOTEBOOKS, REPO, new_page

# A lesson with plotly figures and a widget: the page shows both kinds of output done offline.
PAGE_LESSON = "09_memory_wall"
BUILD_TIMEOUT_S = 280


@pytest.fixture(scope="module")
def built_page(browser_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (NOTEBOOKS / f"{PAGE_LESSON}.ipynb").exists():
        pytest.skip(f"notebooks/{PAGE_LESSON}.ipynb does not exist (yet)")
    out = tmp_path_factory.mktemp("html")
    run = subprocess.run(
        [sys.executable, "-m", "dplab", "html", "--out", str(out), "--only", PAGE_LESSON],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert run.returncode == 0, f"dplab html failed:\n{run.stdout}\n{run.stderr}"
    page = out / f"{PAGE_LESSON}.html"
    assert page.is_file(), run.stdout
    return page


@pytest.mark.browser
def test_static_page_draws_its_figures_offline(
    built_page: Path, chromium_browser: Any, pages_to_keep: list[Any]
) -> None:
    text = built_page.read_text(encoding="utf-8")
    assert "widget-state+json" not in text  # no megabytes of state for widgets it cannot run
    figures = text.count('class="plotly-graph-div"')
    assert figures >= 1, "the page holds no plotly figure"
    page = new_page(chromium_browser)
    pages_to_keep.append(page)
    refused: list[str] = []
    page.on("requestfailed", lambda r: refused.append(r.url))
    page.goto(built_page.as_uri(), wait_until="load")
    page.wait_for_function(
        """(n) => [...document.querySelectorAll('.plotly-graph-div')]
                    .filter(d => d.querySelector('svg.main-svg')).length >= n""",
        arg=figures,
        timeout=60_000,
    )
    drawn = page.locator(".js-plotly-plot svg.main-svg").count()
    assert drawn >= figures
    # The widget is replaced by a note saying where to use it (a static page cannot run it).
    assert "is an interactive widget" in page.locator("body").inner_text()
    print(f"{built_page.name}: {figures} figures drawn offline; refused requests: {refused}")


# -- the pieces, without a kernel ----------------------------------------------------------------


def test_lesson_paths_picks_and_refuses(tmp_path: Path) -> None:
    for name in ("00_a.ipynb", "03_b.ipynb"):
        nbformat.write(nbformat.v4.new_notebook(), tmp_path / name)
    assert [p.name for p in lesson_paths(tmp_path)] == ["00_a.ipynb", "03_b.ipynb"]
    assert [p.name for p in lesson_paths(tmp_path, ["03_b"])] == ["03_b.ipynb"]
    with pytest.raises(ValueError, match="unknown lesson 'nope'; choose from 00_a, 03_b"):
        lesson_paths(tmp_path, ["nope"])
    with pytest.raises(ValueError, match="no notebooks folder"):
        lesson_paths(tmp_path / "missing")


def test_widget_outputs_become_a_note() -> None:
    out = nbformat.v4.new_output(
        "display_data",
        data={
            "application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2},
            "text/plain": "MemoryWall(children=(HBox(...),))",
        },
    )
    plot = nbformat.v4.new_output("display_data", data={"text/html": "<div>fig</div>"})
    cell = nbformat.v4.new_code_cell("MemoryWall()", outputs=[out, plot])
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# §9 Wall"), cell])
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    assert replace_widgets(nb, "09_memory_wall.ipynb") == 1
    assert "widgets" not in nb.metadata
    note = nb.cells[1].outputs[0]["data"]["text/html"]
    assert "<b>MemoryWall</b> is an interactive widget" in note
    assert "notebooks/09_memory_wall.ipynb" in note
    assert nb.cells[1].outputs[1]["data"] == {"text/html": "<div>fig</div>"}
    assert title_of(nb, "x") == "§9 Wall"


def test_index_links_every_page() -> None:
    page = index_html([("00_start_here.html", "Start here"), ("08_ddp.html", "§8 <DDP>")])
    assert "<a href='00_start_here.html'>Start here</a>" in page
    assert "§8 &lt;DDP&gt;" in page
