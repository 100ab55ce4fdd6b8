"""Planted bugs for §8d and §8e: a "fix that does nothing", or a reader that blames the wrong rank,
must make the lesson fail.

Each failure mutant keeps a failure's bug in its fix (the loss still a per-rank mean, the first
micro-batch still the one that syncs, the metric still all-reduced on rank 0 only, evaluation
still padded), so the lesson's assert that the fix removes the symptom must fail, in the named
cell. The flight-recorder mutant makes the doctor name a rank that did issue the collective. The
derived notebook is, for each lesson, its setup, the claims' cells and its closing cell; the
control runs every claim's cells.
"""

from __future__ import annotations

import nbformat

from tests.mutation_harness import Mutation, lesson_cells

NAME = "failures"
# lesson -> (setup cell, claim cells in lesson order, closing cell)
LESSONS = {
    "08d_when_dp_goes_wrong.ipynb": ("e-01", ["e-22", "e-31", "e-91"], "e-110"),
    "08e_when_jobs_hang.ipynb": ("h-01", ["h-11", "h-13"], "h-50"),
}

MUTATIONS = [
    Mutation(
        "ragged_fix_keeps_the_per_rank_mean",
        "failures/ragged.py",
        "            loss = per_token.sum() / count * world  # DDP's 1/N cancels the * world\n",
        "            loss = per_token.mean()\n",
        "08d §3: the global token count gives the one-big-batch gradient",
        "e-31",
    ),
    Mutation(
        "no_sync_fix_still_syncs_the_first",
        "failures/no_sync.py",
        '                syncs = m == (0 if placement == "first_syncs" else micro_batches - 1)\n',
        "                syncs = m == 0\n",
        "08d §2: the last micro-batch syncing keeps the replicas equal",
        "e-22",
    ),
    Mutation(
        "desync_fix_still_rank_dependent",
        "failures/hangs.py",
        "    if fixed or dist.get_rank() == 0:\n",
        "    if dist.get_rank() == 0:\n",
        "08e §1: the collective issued on every rank: no rank times out",
        "h-11",
    ),
    Mutation(
        "eval_fix_still_padded",
        "failures/sampler.py",
        "        indices = list(range(rank, samples, world))\n",
        "        indices = list(DistributedSampler(range(samples), world, rank, shuffle=False))\n",
        "08d §8: exact evaluation shards give the true accuracy",
        "e-91",
    ),
    Mutation(
        "flight_recorder_blames_who_issued_it",
        "doctor/flight_recorder.py",
        '            return Mismatch(group, seq, never, "never issued", ref, here, False)\n',
        '            return Mismatch(group, seq, (ref.rank,), "never issued", ref, here, False)\n',
        "08e §1: the doctor names rank 1, which never issued collective #2",
        "h-13",
    ),
]

# a mutant runs only its own claim's cells (h-13 reads the dumps h-11 wrote)
NEEDS = {"h-13": ["h-11", "h-13"]}


def notebook(mutation: Mutation | None) -> nbformat.NotebookNode:
    """Each lesson's setup, its claim cells (only the mutant's, for a mutant), its closing cell."""
    out = nbformat.v4.new_notebook()
    for lesson, (setup, claims, close) in LESSONS.items():
        wanted = claims if mutation is None else NEEDS.get(mutation.caught_by, [mutation.caught_by])
        chosen = [c for c in claims if c in wanted]
        if chosen:
            nb = lesson_cells(lesson, [setup, *chosen, close])
            out.cells += nb.cells
            out.metadata = nb.metadata
    return out
