"""Fixtures of the real-browser tests: one JupyterLab server and one Chromium per test module.

Every test here is marked ``browser``. Without Chromium they are skipped, with the reason, unless
``DPLAB_REQUIRE_BROWSER=1`` (CI sets it): then a missing browser is a failure. On a failure the
test's pages are saved as screenshots under ``test-artifacts/`` with the server's log.

The browser lives for one module, not the session: Playwright's sync API holds an event loop
while it runs, and the notebook tests (nbval) that follow in the same pytest run need their own.

A lesson that the browser runs whole (Run All in JupyterLab, failing on any error output or any
cell left unrun: everything ``--nbval-lax`` checks) is not run a second time by nbval in the
same pytest run; the terminal summary names those lessons. Without a browser, or when the
browser tests are not selected, nbval runs every lesson.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any

import pytest

from tests.browser.lab import ARTIFACTS, LabServer, Lesson, chromium, require_browser_reason


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


_WHOLE_LESSON = re.compile(r"tests/browser/test_lab\.py::test_lesson_runs_and_draws\[(.+)\]$")
_RAN_IN_LAB = pytest.StashKey[list[str]]()


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what they deselect
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # strict --nbval compares outputs, which the browser does not: only --nbval-lax is covered
    if not config.getoption("nbval_lax", False) or require_browser_reason() is not None:
        return
    whole = {m.group(1) for item in items if (m := _WHOLE_LESSON.match(item.nodeid))}
    if not whole:
        return
    in_lab = [
        item
        for item in items
        if PurePosixPath(item.nodeid.split("::")[0]).suffix == ".ipynb"
        and PurePosixPath(item.nodeid.split("::")[0]).stem in whole
    ]
    if in_lab:
        config.hook.pytest_deselected(items=in_lab)
        items[:] = [item for item in items if item not in in_lab]
        config.stash[_RAN_IN_LAB] = sorted(
            {PurePosixPath(i.nodeid.split("::")[0]).stem for i in in_lab}
        )


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    lessons = config.stash.get(_RAN_IN_LAB, None)
    if lessons:
        terminalreporter.write_line(
            "nbval: run whole in JupyterLab by tests/browser instead (every cell, no error "
            "output): " + ", ".join(lessons)
        )


@pytest.fixture(scope="module")
def browser_ready() -> None:
    reason = require_browser_reason()
    if reason is None:
        return
    if os.environ.get("DPLAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"DPLAB_REQUIRE_BROWSER=1 but the browser tests cannot run: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium_browser(browser_ready: None) -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def lab(browser_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """A Lab server on a fresh copy of the notebooks, for this module's tests."""
    with LabServer(tmp_path_factory.mktemp("lab")) as server:
        yield server


class Lessons:
    """Lessons opened and run once per module: the lesson test and the interaction tests of the
    same notebook share one page (running a notebook is the slow part)."""

    def __init__(self, browser: Any, server: LabServer):
        self.browser = browser
        self.server = server
        self.opened: dict[str, Lesson] = {}

    def run(self, name: str, keep: list[Any], *, clean: bool = False) -> Lesson:
        """``name`` opened and run (once); its page goes into ``keep`` for failure screenshots.
        ``clean``: fail at once if the run left error output (a widget test needs the cells
        above its widget to have worked)."""
        if name not in self.opened:
            if not (self.server.root / name).exists():
                pytest.skip(f"notebooks/{name} does not exist (yet)")
            lesson = Lesson.open(self.browser, self.server, name)
            self.opened[name] = lesson
            keep.append(lesson.page)
            try:
                lesson.run_all()
            except BaseException:
                lesson.failed = True
                raise
        lesson = self.opened[name]
        if lesson.page not in keep:
            keep.append(lesson.page)
        if lesson.failed:
            pytest.fail(f"{name} did not run in Lab (see its lesson test)")
        if clean and lesson.errors():
            first = lesson.errors()[0].splitlines()[0]
            pytest.fail(f"{name} ran with errors (see its lesson test), first: {first}")
        return lesson

    def close(self) -> None:
        for lesson in self.opened.values():
            lesson.close()


@pytest.fixture(scope="module")
def lessons(chromium_browser: Any, lab: LabServer) -> Iterator[Lessons]:
    opened = Lessons(chromium_browser, lab)
    yield opened
    opened.close()


@pytest.fixture
def pages_to_keep(request: pytest.FixtureRequest) -> Iterator[list[Any]]:
    """Pages a test appends here are saved as screenshots if the test fails."""
    pages: list[Any] = []
    yield pages
    report = getattr(request.node, "report_call", None)
    if report is None or not report.failed:
        return
    ARTIFACTS.mkdir(exist_ok=True)
    stem = re.sub(r"[^\w.-]+", "_", request.node.nodeid.split("::", 1)[-1])
    for n, page in enumerate(pages):
        try:
            page.screenshot(path=str(ARTIFACTS / f"{stem}-{n}.png"))
        except Exception as e:  # the page may be gone; the log still helps
            (ARTIFACTS / f"{stem}-{n}.txt").write_text(f"no screenshot: {e!r}\n")
    server = request.node.funcargs.get("lab")
    if isinstance(server, LabServer) and server.log_path.exists():
        shutil.copy(server.log_path, ARTIFACTS / f"{stem}-jupyter-lab.log")
