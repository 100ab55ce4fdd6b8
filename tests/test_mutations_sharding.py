"""Mutation tests for §9b: a planted sum-instead-of-average in the sharded path fails the lesson.

Same method as ``tests/test_mutations.py`` (whose helpers this imports): copy the package, apply
ONE textual substitution whose anchor occurs exactly once, run the lesson cells that carry the
claim under nbval with ``PYTHONPATH`` at the copy, and require the named cell to fail on an
assert. The unmutated copy passes the same cells first.

The two plants are the bug §9b warns about, in both sharded paths: FSDP2's gradients left N
times too big after backward (what pytorch issue 162338 did on gloo), and the ZeRO-1 reference
optimizer summing its all-reduced gradients without dividing by N.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import nbformat
import pytest

from tests.test_mutations import NOTEBOOKS, Mutation, failing_cells
from tests.test_mutations import run_nbval as shared_run_nbval

LESSON = "09b_past_the_wall.ipynb"
CELLS = [
    "s9b-01",  # imports, the 4-rank pool, run()
    "s9b-07",  # §2: every method's first step equals one process on the global batch
    "s9b-14",  # §5: the learner's (untouched) class, the 2-rank pool
    "s9b-15",  # §5: the reference ZeRO-1 through the checker
    "s9b-16",  # close the pools
]

MUTATIONS = [
    Mutation(
        "fsdp_sums_gradients",
        "sharding/ranks.py",
        "                loss.backward()\n",
        "                loss.backward()\n"
        '                if method in ("zero2", "zero3"):  # planted: issue 162338\n'
        "                    for p in params:\n"
        "                        p.grad.mul_(world)\n",
        "09b §2: FSDP2's gradient equals the global-batch gradient (an average, not a sum)",
        "s9b-07",
    ),
    Mutation(
        "zero1_sums_gradients",
        "exercises/zero1.py",
        "                p.grad.div_(self.world_size)\n",
        "                pass  # planted: the all-reduced gradient is left a sum\n",
        "09b §5: the reference ZeRO-1 passes the checker (weights of one process)",
        "s9b-15",
    ),
]


def derived_notebook() -> nbformat.NotebookNode:
    cells = {c.get("id"): c for c in nbformat.read(NOTEBOOKS / LESSON, as_version=4).cells}
    missing = [i for i in CELLS if i not in cells]
    assert not missing, f"{LESSON} no longer has cells {missing}: update CELLS"
    out = nbformat.v4.new_notebook()
    out.cells = [cells[i] for i in CELLS]
    out.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3"}}
    return out


def run_nbval(tmp_path: Path, mutation: Mutation | None) -> subprocess.CompletedProcess:
    return shared_run_nbval(tmp_path, mutation, derived_notebook())


def test_every_anchor_exists_exactly_once():
    package = Path(__import__("dplab").__file__).resolve().parent
    for m in MUTATIONS:
        text = (package / m.path).read_text()
        assert text.count(m.anchor) == 1, (m.name, m.path, text.count(m.anchor))


def test_the_unmutated_package_passes_the_sharding_cells(tmp_path):
    result = run_nbval(tmp_path, None)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_a_planted_sum_makes_the_lesson_fail(mutation, tmp_path):
    result = run_nbval(tmp_path, mutation)
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"{mutation.name} went unnoticed: {mutation.claim}"
    assert "AssertionError" in output, output[-4000:]
    ids = [c.get("id") for c in derived_notebook().cells]
    caught = [ids[int(cell.split()[1])] for cell in failing_cells(output)]
    assert caught == [mutation.caught_by], (mutation.name, caught, output[-3000:])
