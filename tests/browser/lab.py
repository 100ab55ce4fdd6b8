"""Drive the course as a learner does: a real JupyterLab server, a real Chromium, real clicks.

Used by the browser tests (``tests/browser/test_*.py``) and by ``screenshots.py``. What is done
here, and why, follows measurements on a 2-core machine with Debian's Chromium (see
``shared/notes/browser-testing.md``):

- Chromium is Debian's ``/usr/bin/chromium`` driven by Python Playwright (``playwright install``
  cannot download a browser here), with flags that keep it off the network and off the GPU.
- Every server gets its own HOME and Jupyter directories and a fresh copy of the notebooks, so a
  learner's settings never leak in and Lab's autosave never writes outputs into the repository.
- The kernel is ready when the status bar reads ``Python 3 (ipykernel) | Idle``; the notebook
  toolbar says idle too early. "Run all" goes through Lab's command registry (exposed on
  ``window.jupyterapp``) and is done when every code cell shows ``[n]`` and the kernel is idle.
- Outputs are judged from the notebook model Lab holds (output types, mime types), and their
  rendering from the DOM: a plotly figure is drawn when its ``.js-plotly-plot`` holds an
  ``svg.main-svg``; a widget is drawn when its output holds a ``.jupyter-widgets`` view.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = os.environ.get("DPLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
VIEWPORT = {"width": 1400, "height": 1600}  # tall: Lab is fixed-height, full_page adds nothing
KERNEL_IDLE = "Python 3 (ipykernel) | Idle"

SERVER_START_S = 90.0
KERNEL_READY_MS = 120_000
RUN_ALL_S = 240.0

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours in IPython's tracebacks
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def require_browser_reason() -> str | None:
    """Why the browser tests cannot run here (None when they can)."""
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        return (
            f"no Chromium at {CHROMIUM}: install Debian's package (apt-get install -y chromium); "
            "`playwright install` cannot download a browser here"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python Playwright is not installed (pip install -e '.[test]')"
    if shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None:
        return f"jupyter-lab is not installed next to {sys.executable} (pip install -e '.[test]')"
    return None


def lesson_names() -> list[str]:
    """The notebooks of the course, in lesson order (file name order)."""
    return sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


# -- the server ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


@dataclass
class LabServer:
    """``jupyter lab`` on 127.0.0.1 with a random port and token, isolated from the user.

    ``root`` gets a fresh copy of ``notebooks``; HOME and every Jupyter/IPython directory live
    under ``home``. Stopped by its PID (SIGTERM, then SIGKILL), kernels included.
    """

    workdir: Path
    notebooks: list[str] = field(default_factory=lesson_names)
    source: Path = NOTEBOOKS
    port: int = 0
    token: str = ""
    proc: subprocess.Popen | None = None

    @property
    def root(self) -> Path:
        return self.workdir / "course"

    @property
    def home(self) -> Path:
        return self.workdir / "home"

    @property
    def log_path(self) -> Path:
        return self.workdir / "jupyter-lab.log"

    def url(self, notebook: str) -> str:
        """The notebook in a workspace of its own (``reset``: no tabs from an earlier page), so
        two pages never hold the same notebook open."""
        workspace = "w-" + "".join(ch if ch.isalnum() else "-" for ch in notebook)
        return (
            f"http://127.0.0.1:{self.port}/lab/workspaces/{workspace}/tree/{notebook}"
            f"?reset&token={self.token}"
        )

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        home = self.home
        env.update(
            HOME=str(home),
            JUPYTER_CONFIG_DIR=str(home / "jupyter-config"),
            JUPYTER_DATA_DIR=str(home / "jupyter-data"),
            JUPYTER_RUNTIME_DIR=str(home / "jupyter-runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(home / "lab-settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(home / "lab-workspaces"),
            IPYTHONDIR=str(home / "ipython"),
            MPLCONFIGDIR=str(home / "mpl"),
            PYTHONUNBUFFERED="1",
        )
        # The kernel must import this checkout's dplab, whatever the working directory.
        env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH", ""), str(REPO)] if p)
        # JUPYTER_PATH of the venv only: no kernels or extensions of the machine's user.
        env.pop("JUPYTER_PATH", None)
        return env

    def _settings(self) -> None:
        settings = self.home / "lab-settings"
        # No "get notified about news?" toast over the notebook.
        _write_json(
            settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
            {"fetchNews": "false", "checkForUpdates": False},
        )
        # No autosave: the page is the only writer of its copy, and no "file changed" dialog.
        _write_json(
            settings / "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings",
            {"autosave": False},
        )
        # Every cell attached to the DOM, so every output is drawn whether on screen or not.
        _write_json(
            settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings",
            {"windowingMode": "none"},
        )

    def start(self) -> LabServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(exist_ok=True)
        for name in self.notebooks:
            shutil.copy2(self.source / name, self.root / name)
        self._settings()
        self.port = _free_port()
        self.token = secrets.token_hex(24)
        jupyter_lab = str(Path(sys.executable).parent / "jupyter-lab")
        cmd = [
            jupyter_lab,
            "--no-browser",
            "--allow-root",  # CI runs as root
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--port-retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--ServerApp.terminals_enabled=False",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.root,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        status = f"http://127.0.0.1:{self.port}/api/status?token={self.token}"
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"jupyter lab exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(status, timeout=5) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(
            f"jupyter lab did not answer in {SERVER_START_S:g} s:\n{self.log_tail()}"
        )

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no server log)"

    def descendants(self) -> list[Any]:
        """The processes under the server (kernels, their rank processes), as psutil objects."""
        import psutil

        if self.proc is None:
            return []
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(self.proc.pid).children(recursive=True)
        return []

    def stop(self) -> None:
        """SIGTERM the server by its PID (it shuts its kernels down); SIGKILL what is left."""
        if self.proc is None:
            return
        children = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for child in children:  # a kernel or rank that outlived the server, by its PID
            # is_running() also checks the start time, so a reused PID is never hit.
            with contextlib.suppress(Exception):
                if child.is_running():
                    child.kill()
        self.proc = None

    def __enter__(self) -> LabServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the browser --------------------------------------------------------------------------------


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Debian's Chromium under Playwright, with no network but 127.0.0.1 and file://."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser: Any) -> Any:
    """A page in a fresh context that can reach 127.0.0.1 and file:// and nothing else."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()

    def only_local(route: Any) -> None:
        url = route.request.url
        if url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "file://", "data:", "blob:")):
            route.continue_()
        else:
            route.abort()

    page.route("**/*", only_local)
    page.set_default_timeout(60_000)
    return page


# -- a lesson in Lab ---------------------------------------------------------------------------

# The notebook model of the current panel: per code cell, its execution count and its outputs.
_MODEL_JS = """
() => {
  const panel = window.jupyterapp.shell.currentWidget;
  if (!panel || !panel.content || !panel.content.model) return null;
  const cells = panel.content.model.cells;
  const out = [];
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    const j = c.toJSON();
    out.push({
      index: i,
      type: j.cell_type,
      source: Array.isArray(j.source) ? j.source.join('') : j.source,
      count: j.execution_count === undefined ? null : j.execution_count,
      outputs: j.outputs || [],
    });
  }
  return out;
}
"""

_EXECUTING_JS = """
() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cells = panel.content.widgets;
  let busy = 0, unrun = 0;
  for (const c of cells) {
    if (c.model.type !== 'code') continue;
    const n = c.model.executionCount;
    const prompt = c.node.querySelector('.jp-InputPrompt');
    const text = prompt ? prompt.textContent : '';
    if (text.includes('*')) busy++;
    else if (n === null || n === undefined) unrun++;
  }
  return {busy, unrun};
}
"""


@dataclass
class Lesson:
    """One notebook opened in Lab in its own page, and what running it produced."""

    name: str
    page: Any = field(repr=False)
    server: LabServer = field(repr=False)
    timings: dict[str, float] = field(default_factory=dict)
    cells: list[dict[str, Any]] = field(default_factory=list, repr=False)
    failed: bool = False

    @classmethod
    def open(cls, browser: Any, server: LabServer, name: str) -> Lesson:
        t0 = time.monotonic()
        page = new_page(browser)
        lesson = cls(name, page, server)
        page.goto(server.url(name), wait_until="domcontentloaded")
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell")
        page.wait_for_selector(".jp-NotebookPanel .jp-Cell", state="attached")
        lesson.wait_kernel_idle(KERNEL_READY_MS)
        lesson.timings["open_s"] = time.monotonic() - t0
        return lesson

    def kernel_status(self) -> str:
        return self.page.locator("#jp-main-statusbar").inner_text().replace("\n", " ")

    def wait_kernel_idle(self, timeout_ms: float) -> None:
        self.page.wait_for_function(
            """(want) => {
                const bar = document.querySelector('#jp-main-statusbar');
                return bar && bar.textContent.includes(want);
            }""",
            arg=KERNEL_IDLE,
            timeout=timeout_ms,
        )

    def run_all(self, timeout_s: float = RUN_ALL_S) -> list[dict[str, Any]]:
        """Run every cell as Run → Run All Cells does; return the cells with their outputs."""
        t0 = time.monotonic()
        first = self.page.evaluate(_EXECUTING_JS)
        # Fire the command; its promise resolves only when the run ends, so do not await it here.
        self.page.evaluate(
            "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }"
        )
        deadline = t0 + timeout_s
        started = False
        quiet_since: float | None = None
        while True:
            state = self.page.evaluate(_EXECUTING_JS)
            idle = KERNEL_IDLE in self.kernel_status()
            started = started or state["busy"] > 0 or state["unrun"] < first["unrun"]
            # Done when nothing is queued or running and the kernel is idle, twice, 1 s apart.
            # Lab stops a run at the first error and un-queues the rest: those stay unrun.
            if (started or state["unrun"] == 0) and state["busy"] == 0 and idle:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 1.0:
                    break
            else:
                quiet_since = None
            if time.monotonic() > deadline or (not started and time.monotonic() > t0 + 60):
                raise TimeoutError(
                    f"{self.name}: run-all not finished after {time.monotonic() - t0:.0f} s "
                    f"({state['busy']} cells running, {state['unrun']} not run; "
                    f"status bar: {self.kernel_status()!r})"
                )
            time.sleep(0.25)
        self.timings["run_all_s"] = time.monotonic() - t0
        self.cells = self.page.evaluate(_MODEL_JS)
        return self.cells

    # -- what the model holds ----------------------------------------------------------------

    def code_cells(self) -> list[dict[str, Any]]:
        return [c for c in self.cells if c["type"] == "code"]

    def errors(self) -> list[str]:
        """Error outputs (and tracebacks written to stderr), with the cell they came from."""
        found = []
        for cell in self.code_cells():
            for out in cell["outputs"]:
                if out.get("output_type") == "error":
                    tb = _ANSI.sub("", "\n".join(out.get("traceback", [])))
                    found.append(
                        f"cell {cell['index']}: {out.get('ename')}: {out.get('evalue')}\n{tb}"
                    )
                elif out.get("output_type") == "stream" and out.get("name") == "stderr":
                    text = "".join(out.get("text", ""))
                    if "Traceback (most recent call last)" in text:
                        found.append(f"cell {cell['index']} wrote a traceback to stderr:\n{text}")
        return found

    def mime_count(self, mime: str) -> int:
        return sum(mime in out.get("data", {}) for c in self.code_cells() for out in c["outputs"])

    def cell_index(self, needle: str) -> int:
        """The index of the first cell whose source contains ``needle``."""
        for cell in self.cells:
            if needle in cell["source"]:
                return cell["index"]
        raise LookupError(f"{self.name}: no cell contains {needle!r}")

    # -- what the page draws -----------------------------------------------------------------

    def drawn(self) -> list[dict[str, Any]]:
        """Per cell, what its output area draws: plotly figures (with their SVG), widget views
        (with any plotly figure inside them), and widget error text."""
        return self.page.evaluate(
            """() => {
              const sized = p => {
                const svg = p.querySelector('svg.main-svg');
                return !!svg && Number(svg.getAttribute('width')) > 0
                             && Number(svg.getAttribute('height')) > 0;
              };
              const cells = window.jupyterapp.shell.currentWidget.content.widgets;
              return cells.map((c, index) => {
                const node = c.node;
                const all = sel => [...node.querySelectorAll(sel)];
                const plots = all('.jp-OutputArea-output.jp-RenderedPlotly');
                const views = all('.jp-OutputArea-output > .jupyter-widgets');
                const inner = views.flatMap(v => [...v.querySelectorAll('.js-plotly-plot')]);
                const text = [...node.querySelectorAll('.jp-OutputArea-output')]
                  .map(o => o.textContent);
                return {
                  index,
                  plotly: plots.length,
                  plotly_drawn: plots.filter(sized).length,
                  widgets: views.length,
                  widget_plots: inner.length,
                  widget_plots_drawn: inner.filter(sized).length,
                  broken: text.filter(t => t.includes('Error displaying widget')
                                        || t.includes('Loading widget...')),
                };
              });
            }"""
        )

    def undrawn(self) -> list[str]:
        """What the model holds but the page has not drawn (empty when all is drawn)."""
        problems = []
        drawn = {d["index"]: d for d in self.drawn()}
        for cell in self.code_cells():
            d = drawn[cell["index"]]
            want_plotly = sum(PLOTLY_MIME in o.get("data", {}) for o in cell["outputs"])
            want_widgets = sum(WIDGET_MIME in o.get("data", {}) for o in cell["outputs"])
            where = f"cell {cell['index']} ({cell['source'].strip().splitlines()[-1][:60]!r})"
            if d["plotly_drawn"] < want_plotly:
                problems.append(
                    f"{where}: {want_plotly} plotly figure(s) in the outputs, "
                    f"{d['plotly']} on the page, {d['plotly_drawn']} with a drawn svg.main-svg"
                )
            if d["widgets"] < want_widgets:
                problems.append(
                    f"{where}: {want_widgets} widget(s) in the outputs, {d['widgets']} drawn"
                )
            if d["widget_plots_drawn"] < d["widget_plots"]:
                problems.append(
                    f"{where}: {d['widget_plots']} plotly figure(s) inside widgets, "
                    f"{d['widget_plots_drawn']} drawn"
                )
            problems += [f"{where}: {t.strip()[:200]}" for t in d["broken"]]
        return problems

    def wait_drawn(self, timeout_s: float = 60.0) -> list[str]:
        """Wait until every figure and widget the model holds is drawn; return what is not."""
        deadline = time.monotonic() + timeout_s
        while True:
            problems = self.undrawn()
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.25)

    def cell_node(self, index: int) -> Any:
        """The DOM node of cell ``index`` (an ElementHandle)."""
        return self.page.evaluate_handle(
            "i => window.jupyterapp.shell.currentWidget.content.widgets[i].node", index
        ).as_element()

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path))
        return path

    def close(self) -> None:
        """Shut this notebook's kernel down and close the page."""
        with contextlib.suppress(Exception):
            self.page.evaluate(
                "async () => { await window.jupyterapp.shell.currentWidget"
                ".sessionContext.shutdown(); }"
            )
        with contextlib.suppress(Exception):
            self.page.context.close()
