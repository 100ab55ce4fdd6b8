"""The machinery of the mutation tests: plant one bug in a copy of dplab, run lesson cells on it.

An assert that stays green when the thing it claims is broken is a defect (issue 15). A
``Mutation`` is ONE textual substitution in one file of the package, whose anchor must occur
exactly once (so a moved line fails loudly instead of silently testing nothing). A ``Job`` is a
derived notebook (lesson cells copied verbatim by id) to run on a copy of the package, mutated
or not. ``run_jobs`` runs a whole batch of jobs in ONE pytest process under nbval: each job gets
its own folder holding its copy, and its own kernel, whose first cell puts the copy first on
``sys.path`` and in ``PYTHONPATH`` (so the kernel and every rank it starts import the copy). One
process for the batch, rather than one per job, saves a pytest start (about 3 s) per job.

The verdicts a test asks for are ``assert_passes`` (the unmutated copy: otherwise a "caught"
mutant proves nothing) and ``assert_caught`` (the mutant fails on an ``AssertionError`` in
exactly the cell that carries its claim, not by crashing the notebook somewhere else).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

import dplab

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
PACKAGE = Path(dplab.__file__).resolve().parent  # the package under test (a copy is mutated)
SECONDS_PER_JOB = 120  # the batch's timeout grows with it: a few seconds of training per job
CELL_TIMEOUT_S = 300  # a hung cell fails its own job, and the batch goes on


@dataclass(frozen=True)
class Mutation:
    """One planted bug: in ``path`` (inside dplab/), ``anchor`` becomes ``replacement``."""

    name: str
    path: str
    anchor: str
    replacement: str
    claim: str  # the lesson claim that must catch it
    caught_by: str  # the id of the lesson cell whose assert fails


@dataclass(frozen=True)
class Job:
    """A derived notebook run on a copy of the package (``mutation`` planted, or none)."""

    name: str
    mutation: Mutation | None
    notebook: nbformat.NotebookNode


@dataclass
class Outcome:
    """What nbval said of one job: its code cells' ids, how many nbval reported on, the ids of
    the failing ones and their failure texts."""

    cell_ids: list[str]
    ran: int = 0  # code cells nbval reported on (the path cell not counted)
    failed: list[str] = field(default_factory=list)
    text: str = ""


def lesson_cells(lesson: str, ids: list[str]) -> nbformat.NotebookNode:
    """Cells of ``notebooks/lesson`` by id, verbatim, in the order given; a missing id fails."""
    cells = {c.get("id"): c for c in nbformat.read(NOTEBOOKS / lesson, as_version=4).cells}
    missing = [i for i in ids if i not in cells]
    assert not missing, f"{lesson} no longer has cells {missing}: update the mutation tests"
    out = nbformat.v4.new_notebook()
    out.cells = [cells[i] for i in ids]
    out.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3"}}
    return out


def assert_anchors_once(mutations: list[Mutation]) -> None:
    """Cheap and first: a moved line fails here, by name, before any notebook runs."""
    for m in mutations:
        text = (PACKAGE / m.path).read_text()
        assert text.count(m.anchor) == 1, (m.name, m.path, text.count(m.anchor))


def copy_package(dest: Path, mutation: Mutation | None) -> None:
    shutil.copytree(PACKAGE, dest / "dplab", ignore=shutil.ignore_patterns("__pycache__"))
    if mutation is None:
        return
    target = dest / "dplab" / mutation.path
    source = target.read_text()
    found = source.count(mutation.anchor)
    assert found == 1, (
        f"mutation {mutation.name}: anchor {mutation.anchor!r} occurs {found} times in "
        f"dplab/{mutation.path} (expected once): the code moved, re-anchor the mutation"
    )
    target.write_text(source.replace(mutation.anchor, mutation.replacement))


def _path_cell(copy: Path) -> nbformat.NotebookNode:
    # The kernel starts with the installed dplab on its path; the copy must win, in the kernel
    # and in the ranks it spawns (they read PYTHONPATH).
    return nbformat.v4.new_code_cell(
        "import os, sys\n"
        f"sys.path.insert(0, {str(copy)!r})\n"
        f"os.environ['PYTHONPATH'] = {str(copy)!r}\n"
        "import dplab\n"
        f"assert dplab.__file__.startswith({str(copy)!r}), dplab.__file__"
    )


def run_jobs(root: Path, jobs: list[Job]) -> dict[str, Outcome]:
    """Every job's notebook under nbval in one pytest process; an outcome per job."""
    paths = []
    for job in jobs:
        folder = root / job.name
        folder.mkdir()
        copy_package(folder, job.mutation)
        nb = nbformat.v4.new_notebook()
        nb.cells = [_path_cell(folder), *job.notebook.cells]
        nb.metadata = job.notebook.metadata
        path = folder / f"claims_{job.name}.ipynb"
        nbformat.write(nb, path)
        paths.append(path.relative_to(root))
    junit = root / "junit.xml"
    plugins_off = ["-p", "no:cacheprovider", "-p", "no:hypothesispytest"]  # 1 s to import
    cmd = [sys.executable, "-m", "pytest", "-q", *plugins_off, "--nbval-lax",
           f"--nbval-cell-timeout={CELL_TIMEOUT_S}", f"--junitxml={junit}"]  # fmt: skip
    done = subprocess.run(
        [*cmd, *map(str, paths)],
        cwd=root,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=SECONDS_PER_JOB * len(jobs),
    )
    tail = (done.stdout + done.stderr)[-4000:]
    assert junit.exists(), f"nbval wrote no report:\n{tail}"
    outcomes = {
        job.name: Outcome([c.get("id") for c in job.notebook.cells if c.cell_type == "code"])
        for job in jobs
    }
    for case in ET.parse(junit).getroot().iter("testcase"):
        where = case.get("classname", "") + "::" + case.get("name", "")
        job = next((j for j in outcomes if f"claims_{j}." in where), None)
        assert job is not None, f"a report for no job: {where}\n{tail}"
        index = int(case.get("name", "").split()[-1])  # "Cell 3"
        outcome = outcomes[job]
        problems = [p for p in (case.find("failure"), case.find("error")) if p is not None]
        texts = "\n".join(f"{p.get('message', '')}\n{p.text or ''}" for p in problems)
        if index == 0:  # the path cell
            assert not problems, f"{job}: the copy was not imported:\n{texts}"
            continue
        outcome.ran += 1
        if problems:
            outcome.failed.append(outcome.cell_ids[index - 1])
            outcome.text += f"\n--- {outcome.cell_ids[index - 1]}:\n{texts}"
    return outcomes


def assert_passes(outcome: Outcome) -> None:
    """The unmutated copy passes every cell it runs, and nbval ran every one of them."""
    assert not outcome.failed, outcome.text[-4000:]
    assert outcome.ran == len(outcome.cell_ids), (outcome.ran, outcome.cell_ids)


def assert_caught(outcome: Outcome, mutation: Mutation) -> None:
    """A failed assert in the claim's own cell, and no other cell failing."""
    assert outcome.failed, f"{mutation.name} went unnoticed: {mutation.claim}"
    # A failed assert, not a crash: the mutant must break a claim, not the notebook.
    assert "AssertionError" in outcome.text, outcome.text[-4000:]
    caught = outcome.failed
    assert caught == [mutation.caught_by], (mutation.name, caught, outcome.text[-3000:])
