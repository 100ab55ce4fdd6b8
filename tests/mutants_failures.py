"""Planted bugs for §8e: a "fix that does nothing" must make the lesson fail.

Each mutant keeps a failure's bug in its fix (the loss still a per-rank mean, the first
micro-batch still the one that syncs, the metric still all-reduced on rank 0 only, evaluation
still padded), so the lesson's assert that the fix removes the symptom must fail, in the named
cell. The derived notebook is 08e's setup, the claim's cells, and the closing cell; the control
runs every claim's cells.
"""

from __future__ import annotations

import nbformat

from tests.mutation_harness import Mutation, lesson_cells

NAME = "failures"
LESSON = "08d_when_dp_goes_wrong.ipynb"
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


def notebook(mutation: Mutation | None) -> nbformat.NotebookNode:
    """08e's setup, the claim cells (only the mutant's, for a mutant), and the closing cell."""
    if mutation is None:
        claims = CLAIM_CELLS
    else:
        claims = NEEDS.get(mutation.caught_by, [mutation.caught_by])
    return lesson_cells(LESSON, [SETUP, *claims, CLOSE])
