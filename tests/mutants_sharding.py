"""Planted bugs for §9b: a sum instead of an average in the sharded path fails the lesson.

The two plants are the bug §9b warns about, in both sharded paths: FSDP2's gradients left N
times too big after backward (what pytorch issue 162338 did on gloo), and the ZeRO-1 reference
optimizer summing its all-reduced gradients without dividing by N.
"""

from __future__ import annotations

import nbformat

from tests.mutation_harness import Mutation, lesson_cells

NAME = "sharding"
LESSON = "09b_past_the_wall.ipynb"
CONTROL = [
    "s9b-01",  # imports, the 4-rank pool, run()
    "s9b-07",  # §2: every method's first step equals one process on the global batch
    "s9b-14",  # §5: the learner's (untouched) class, the 2-rank pool
    "s9b-15",  # §5: the reference ZeRO-1 through the checker
    "s9b-16",  # close the pools
]
CELLS_OF = {  # a mutant runs the setup, its claim's cell and what that cell needs
    "s9b-07": ["s9b-01", "s9b-07"],
    "s9b-15": ["s9b-01", "s9b-14", "s9b-15", "s9b-16"],
}

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


def notebook(mutation: Mutation | None) -> nbformat.NotebookNode:
    """Every claim's cells for the control; a mutant's own, with what they need."""
    return lesson_cells(LESSON, CONTROL if mutation is None else CELLS_OF[mutation.caught_by])
