"""Mutation tests for §8e: a planted "fix that does nothing" must make the lesson fail.

Each mutant keeps a failure's bug in its fix (the loss still a per-rank mean, the first
micro-batch still the one that syncs, the metric still all-reduced on rank 0 only, evaluation
still padded), so the lesson's assert that the fix removes the symptom must fail, in the named
cell. The machinery (copy the package, plant one substitution whose anchor occurs once, run the
derived notebook under nbval with ``PYTHONPATH`` at the copy) is tests/test_mutations.py's; the
derived notebook here is 08e's setup, the claim's cells, and the closing cell. The unmutated copy
passes the same cells first. Cost on 2 idle cores: five kernels and pools, about a minute.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import nbformat
import pytest

from tests.test_mutations import Mutation, failing_cells
from tests.test_mutations import run_nbval as shared_run_nbval

REPO = Path(__file__).resolve().parents[1]
LESSON = REPO / "notebooks" / "08e_when_dp_goes_wrong.ipynb"
SETUP, CLOSE = "e-01", "e-110"

MUTATIONS = [
    Mutation(
        "ragged_fix_keeps_the_per_rank_mean",
        "failures/ragged.py",
        "            loss = per_token.sum() / count * world  # DDP's 1/N cancels the * world\n",
        "            loss = per_token.mean()\n",
        "08e §3: the global token count gives the one-big-batch gradient",
        "e-31",
    ),
    Mutation(
        "no_sync_fix_still_syncs_the_first",
        "failures/no_sync.py",
        '                syncs = m == (0 if placement == "first_syncs" else micro_batches - 1)\n',
        "                syncs = m == 0\n",
        "08e §2: the last micro-batch syncing keeps the replicas equal",
        "e-22",
    ),
    Mutation(
        "desync_fix_still_rank_dependent",
        "failures/desync.py",
        "            if fixed or rank == 0:\n",
        "            if rank == 0:\n",
        "08e §5: the same collectives on every rank: no timeout, equal flight records",
        "e-51",
    ),
    Mutation(
        "eval_fix_still_padded",
        "failures/sampler.py",
        "        indices = list(range(rank, samples, world))\n",
        "        indices = list(DistributedSampler(range(samples), world, rank, shuffle=False))\n",
        "08e §9: exact evaluation shards give the true accuracy",
        "e-91",
    ),
]

# The claims' cells in lesson order; a mutant runs only its own (and e-22 needs e-21, whose
# runs it reads).
CLAIM_CELLS = ["e-21", "e-22", "e-31", "e-51", "e-91"]
NEEDS = {"e-22": ["e-21", "e-22"]}


def derived_notebook(upto: str | None) -> nbformat.NotebookNode:
    """08e's setup, the claim cells (only ``upto``'s, when given), and the closing cell."""
    cells = {c.get("id"): c for c in nbformat.read(LESSON, as_version=4).cells}
    claims = CLAIM_CELLS if upto is None else NEEDS.get(upto, [upto])
    ids = [SETUP, *claims, CLOSE]
    missing = [i for i in ids if i not in cells]
    assert not missing, f"08e no longer has cells {missing}: update CLAIM_CELLS"
    out = nbformat.v4.new_notebook()
    out.cells = [cells[i] for i in ids]
    out.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3"}}
    return out


def run_nbval(tmp_path: Path, mutation: Mutation | None) -> subprocess.CompletedProcess:
    return shared_run_nbval(
        tmp_path, mutation, derived_notebook(mutation.caught_by if mutation else None)
    )


def test_every_anchor_exists_exactly_once():
    package = REPO / "dplab"
    for m in MUTATIONS:
        text = (package / m.path).read_text()
        assert text.count(m.anchor) == 1, (m.name, m.path, text.count(m.anchor))


def test_the_unmutated_package_passes_the_claim_cells(tmp_path):
    result = run_nbval(tmp_path, None)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_a_fix_that_does_nothing_makes_the_lesson_fail(mutation, tmp_path):
    result = run_nbval(tmp_path, mutation)
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"{mutation.name} went unnoticed: {mutation.claim}"
    assert "AssertionError" in output, output[-4000:]  # a broken claim, not a crash
    ids = [c.get("id") for c in derived_notebook(mutation.caught_by).cells]
    caught = [ids[int(cell.split()[1])] for cell in failing_cells(output)]
    assert caught == [mutation.caught_by], (mutation.name, caught, output[-3000:])
