"""Mutation tests: plant one bug in a copy of dplab and a lesson must fail under nbval.

An assert that stays green when the thing it claims is broken is a defect (issue 15). Each
mutant is one substitution in a copy of the package (``tests/mutation_harness.py``) and runs a
small notebook made of the lesson cells that carry its claim; it must fail on an assert in the
claim's own cell. Each group's unmutated copy must pass the same cells: otherwise a "caught"
mutant proves nothing. The groups, with their plants and cells:

- ``tests/mutants_lessons.py``: the core lessons (03, 03b, 08, 08a, 08b);
- ``tests/mutants_failures.py``: §8d's fixes that do nothing and §8e's hang reader blaming the
  wrong rank;
- ``tests/mutants_sharding.py``: §9b's sum instead of an average.

Every job runs in one nbval process (this module's fixture), each in its own kernel: about four
minutes on 2 idle cores, most of it the lessons' own training and rank pools.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests import mutants_failures, mutants_lessons, mutants_sharding
from tests.mutation_harness import (
    SECONDS_PER_JOB,
    Job,
    Outcome,
    assert_anchors_once,
    assert_caught,
    assert_passes,
    run_jobs,
)

GROUPS = [mutants_lessons, mutants_failures, mutants_sharding]
MUTANTS = [(group, m) for group in GROUPS for m in group.MUTATIONS]
# the batch runs in the first test that needs it (every job, whatever -k selects), bounded by
# SECONDS_PER_JOB each; a hung cell fails after CELL_TIMEOUT_S and the batch goes on
pytestmark = pytest.mark.timeout(SECONDS_PER_JOB * (len(GROUPS) + len(MUTANTS)) + 60)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    jobs = [Job(f"unmutated_{group.NAME}", None, group.notebook(None)) for group in GROUPS]
    jobs += [Job(m.name, m, group.notebook(m)) for group, m in MUTANTS]
    return run_jobs(tmp_path_factory.mktemp("mutations"), jobs)


def test_every_anchor_exists_exactly_once_and_every_name_is_unique():
    """Cheap and first: a moved line fails here, by name, before any notebook runs."""
    assert_anchors_once([m for _, m in MUTANTS])
    names = Counter(m.name for _, m in MUTANTS)
    assert all(n == 1 for n in names.values()), names


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.NAME)
def test_the_unmutated_package_passes_the_claim_cells(group, outcomes):
    assert_passes(outcomes[f"unmutated_{group.NAME}"])


@pytest.mark.parametrize("mutation", [m for _, m in MUTANTS], ids=lambda m: m.name)
def test_a_planted_bug_makes_a_lesson_fail(mutation, outcomes):
    assert_caught(outcomes[mutation.name], mutation)
