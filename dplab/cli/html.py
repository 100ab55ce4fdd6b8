"""``python -m dplab html``: the course, executed here, as static HTML that opens offline.

Each lesson is run top to bottom in a fresh kernel (so every number in the pages was measured
while building them), then exported with nbconvert's JupyterLab template into ``build/``, with an
``index.html`` that lists the lessons.

Two things make the pages work with no network:

- plotly figures need plotly.js in the page. The kernel runs with
  ``PLOTLY_RENDERER=plotly_mimetype+notebook``: ``plotly_mimetype`` is what JupyterLab draws, and
  ``notebook`` adds an HTML version of each figure plus, once per page, plotly.js itself. Loading
  plotly.js from a CDN instead is what fails offline.
- widgets need a live kernel; a static page cannot run them. Each widget output is replaced by a
  short note that names the widget and says where to use it.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLOTLY_RENDERER = "plotly_mimetype+notebook"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
DEFAULT_CELL_TIMEOUT_S = 600


def lesson_paths(notebooks: Path, only: Sequence[str] = ()) -> list[Path]:
    """The notebooks to build, in lesson order; ``only`` picks some by name (with or without
    ``.ipynb``). An unknown name is an error that lists the lessons."""
    if not notebooks.is_dir():
        raise ValueError(f"no notebooks folder at {notebooks}")
    found = sorted(notebooks.glob("*.ipynb"))
    if not found:
        raise ValueError(f"no notebooks in {notebooks}")
    if not only:
        return found
    by_name = {p.name: p for p in found} | {p.stem: p for p in found}
    unknown = [n for n in only if n not in by_name]
    if unknown:
        raise ValueError(
            f"unknown lesson {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(p.stem for p in found)}"
        )
    return sorted({by_name[n] for n in only})


def title_of(nb: Any, fallback: str) -> str:
    """The first markdown heading of a notebook (its title), else ``fallback``."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^#\s+(.+)$", cell.source, flags=re.MULTILINE)
            if m:
                return m.group(1).strip()
    return fallback


def execute(nb: Any, cwd: Path, *, timeout_s: int = DEFAULT_CELL_TIMEOUT_S) -> None:
    """Run every cell of ``nb`` in place, in a fresh kernel started in ``cwd``."""
    from nbclient import NotebookClient

    env = dict(os.environ, PLOTLY_RENDERER=PLOTLY_RENDERER)
    client = NotebookClient(
        nb,
        timeout=timeout_s,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd)}},
    )
    client.execute(env=env)  # the kernel starts in cwd (resources path)


def replace_widgets(nb: Any, notebook_name: str) -> int:
    """Swap each widget output for a note (a static page cannot run a widget); return how many."""
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_MIME not in data:
                continue
            name = str(data.get("text/plain", "widget")).split("(", 1)[0].strip() or "widget"
            note = (
                "<div style='border:1px dashed #999;padding:8px 12px;color:#444'>"
                f"<b>{html.escape(name)}</b> is an interactive widget: it needs a running "
                f"kernel. Open <code>notebooks/{html.escape(notebook_name)}</code> in JupyterLab "
                "(<code>make lab</code>) to use it.</div>"
            )
            out["data"] = {"text/html": note, "text/plain": f"[{name}: interactive widget]"}
            out.get("metadata", {}).pop(WIDGET_MIME, None)
            n += 1
    # The widgets' saved state (the kernel's last values of every control and FigureWidget):
    # megabytes that no static page can use once the views are gone.
    nb.metadata.pop("widgets", None)
    return n


def to_html(nb: Any) -> str:
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(nb)
    return body


def index_html(pages: Sequence[tuple[str, str]]) -> str:
    """A page that links every lesson: (file name, title) pairs."""
    items = "\n".join(
        f"    <li><a href='{html.escape(href)}'>{html.escape(title)}</a></li>"
        for href, title in pages
    )
    return (
        "<!DOCTYPE html>\n<html lang='en'>\n<head><meta charset='utf-8'>"
        "<title>dplab: data parallelism, measured</title></head>\n"
        "<body style='font-family:sans-serif;max-width:760px;margin:40px auto'>\n"
        "  <h1>dplab: data parallelism, measured</h1>\n"
        "  <p>The course as it ran on the machine that built these pages. Widgets need a running "
        "kernel: open the notebooks in JupyterLab (<code>make lab</code>) to use them.</p>\n"
        f"  <ol>\n{items}\n  </ol>\n</body>\n</html>\n"
    )


def build(
    notebooks: Path,
    out: Path,
    *,
    only: Sequence[str] = (),
    timeout_s: int = DEFAULT_CELL_TIMEOUT_S,
    log: Any = sys.stdout,
) -> list[Path]:
    """Execute and export the lessons into ``out``; return the pages written (index last)."""
    import nbformat

    paths = lesson_paths(notebooks, only)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    listed: list[tuple[str, str]] = []
    for path in paths:
        t0 = time.monotonic()
        print(f"{path.name}: executing ...", file=log, flush=True)
        nb = nbformat.read(path, as_version=4)
        execute(nb, path.parent, timeout_s=timeout_s)
        widgets = replace_widgets(nb, path.name)
        page = out / f"{path.stem}.html"
        page.write_text(to_html(nb), encoding="utf-8")
        written.append(page)
        listed.append((page.name, title_of(nb, path.stem)))
        print(
            f"{path.name}: {page} ({page.stat().st_size / 1e6:.1f} MB, "
            f"{widgets} widget(s) noted) in {time.monotonic() - t0:.1f} s",
            file=log,
            flush=True,
        )
    index = out / "index.html"
    if not only:
        index.write_text(index_html(listed), encoding="utf-8")
        written.append(index)
    return written


def cmd_html(args: argparse.Namespace) -> int:
    from nbclient.exceptions import CellExecutionError

    try:
        pages = build(
            Path(args.notebooks), Path(args.out), only=args.only or (), timeout_s=args.timeout
        )
    except ValueError as e:
        print(f"dplab html: {e}", file=sys.stderr)
        return 2
    except CellExecutionError as e:
        print(f"dplab html: a cell failed, no page written for it:\n{e}", file=sys.stderr)
        return 1
    print(f"open {pages[-1]} in a browser (works offline)")
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "html", help="execute the course and export it as static HTML that opens offline"
    )
    p.add_argument("--out", default="build", help="folder for the pages (default: build/)")
    p.add_argument("--notebooks", default="notebooks", help="the lessons' folder")
    p.add_argument(
        "--only",
        action="append",
        metavar="LESSON",
        help="build only this lesson (e.g. 00_start_here); repeat for more; no index page",
    )
    p.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_CELL_TIMEOUT_S,
        help=f"seconds one cell may run (default {DEFAULT_CELL_TIMEOUT_S})",
    )
    p.set_defaults(func=cmd_html)
