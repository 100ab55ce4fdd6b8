"""Mutation tests: plant one bug in a copy of dplab and a lesson must fail under nbval.

An assert that stays green when the thing it claims is broken is a defect (issue 15). Each test
copies the package, applies ONE textual substitution whose anchor must occur exactly once (so a
moved line fails loudly instead of silently testing nothing), and runs a small notebook made of
the lesson cells that carry the claim, with ``PYTHONPATH`` pointing at the copy (the kernel and
every rank it starts import the mutant). The unmutated copy must pass the same notebook first:
otherwise a "caught" mutant proves nothing.

The derived notebook is cells of ``03_dp_mechanics`` (setup, §3.3 traffic), of
``03b_batch_accumulation_allreduce`` (setup, §3.4 B_global, §3.5 accumulation) and of ``08_ddp``
(setup, §2 three ways to all-reduce and overlap by its definition, §4 the last bucket), copied
verbatim by cell id; a missing id fails the test. Cost on 2 idle cores: one control and one run
per mutant, each a kernel, two rank pools and a few seconds of training; mutants stop at the
first failing cell (``-x``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

import dplab

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
PACKAGE = Path(dplab.__file__).resolve().parent  # the package under test (a copy is mutated)

LESSON_CELLS = {
    "03_dp_mechanics.ipynb": [
        "s3-01",  # imports, the 2- and 4-rank pools
        "s3-18", "s3-19",  # §3.3: exactly the gradient bytes per step
        "s3-50",  # close the pools
    ],
    "03b_batch_accumulation_allreduce.ipynb": [
        "s3b-01",  # imports, the 2- and 4-rank pools
        "s3-23", "s3-24",  # §3.4: same B_global, same weights (N = 1, 2, 4)
        "s3-26", "s3-27",  # §3.5: one all-reduce per bucket with no_sync, the big batch's weights
        "s3b-50",  # close the pools
    ],
    "08_ddp.ipynb": [
        "cdff95d1",  # imports, the pool, MODEL, measure, every_step, median
        "b013b8ed", "s8-grads",  # §1: the bucket map; a multi-bucket plan's gradient values
        "fea0c5bd", "c355d019", "6a803d81",  # §2: naive, per-parameter, bucketed
        "s8-ready",  # §2: each bucket launched as soon as it is ready, timed by the ranks
        "5b9e2f47", "c8f06a1d",  # §2: overlap by its definition, on a comms-bound model
        "4ca31f54", "7a523b33",  # §4: the exposed last bucket
    ],
    "08a_torch_ddp_as_it_is.ipynb": [
        "s8c-01",  # imports, the pool
        "s8a-rank0",  # the rebuild takes rank 0's order, whatever each rank saw
        "s8a-group",  # DDP averages over its own process group
        "s8c-24",  # close the pool
    ],
}  # fmt: skip


@dataclass(frozen=True)
class Mutation:
    """One planted bug: in ``path`` (inside dplab/), ``anchor`` becomes ``replacement``."""

    name: str
    path: str
    anchor: str
    replacement: str
    claim: str  # the lesson claim that must catch it
    caught_by: str | None  # the id of the lesson cell whose assert fails (None: none yet)


MUTATIONS = [
    Mutation(
        "launch_after_backward",
        "ddp/ddp.py",
        "    launch_when_ready = True\n",
        "    launch_when_ready = False\n",
        "08 §2: bucket 0's all-reduce is in flight while backward still computes",
        "6a803d81",
    ),
    Mutation(
        "no_sync_ignored",
        "ddp/ddp.py",
        "        sync = grad_enabled and self.require_backward_grad_sync\n",
        "        sync = grad_enabled\n",
        "03 §3.5: one all-reduce per bucket per optimizer step under no_sync",
        "s3-27",
    ),
    Mutation(
        "sum_not_average",
        "ddp/ddp.py",
        "        if n == 1 or self._comm_hook is not None:\n",
        "        if True or n == 1 or self._comm_hook is not None:\n",
        "03 §3.4: N = 2 and N = 4 reach the weights of N = 1 (the gradient is an average)",
        "s3-24",
    ),
    Mutation(
        "blocking_allreduce_in_hook",
        "ddp/ddp.py",
        "work: Any = dist.all_reduce(buffer, group=self.process_group, async_op=True)\n",
        "work: Any = dist.all_reduce(buffer, group=self.process_group, async_op=True)"
        "; work.wait()\n",
        "08 §2: a later bucket's gradients are computed while an earlier all-reduce is in flight",
        "c8f06a1d",
    ),
    Mutation(
        "every_allreduce_exposed",
        "trace/metrics.py",
        '    exposed = subtract(comm, of("backward"))\n',
        "    exposed = union(comm)\n",
        "08 §4: with small communication, every bucket but the last is hidden",
        "7a523b33",
    ),
    Mutation(
        "weights_all_reduced_not_gradients",
        "ddp/layout.py",
        "        grads = [p.grad for p in layout.member_params[b]]\n",
        "        grads = [p.detach() for p in layout.member_params[b]]\n",
        "03 §3.3: what the all-reduce carried is the rank's own gradient (÷ N), not its weights",
        "s3-19",
    ),
    Mutation(
        "offset_error_in_the_bucket_layout",
        "ddp/layout.py",
        "            view = buffer[offset : offset + p.numel()].view_as(p)\n",
        "            view = buffer[max(offset - 1, 0) :][: p.numel()].view_as(p)\n",
        "08 §1: on a multi-bucket plan each .grad is the hand-made average, tensor by tensor",
        "s8-grads",
    ),
    Mutation(
        "launch_one_bucket_late",
        "ddp/ddp.py",
        "        while st.next_bucket < len(st.pending) and st.pending[st.next_bucket] == 0:\n",
        "        while st.next_bucket < len(st.pending) and st.pending[st.next_bucket] == 0 and (\n"
        "            st.next_bucket + 1 == len(st.pending) or st.pending[st.next_bucket + 1] == 0\n"
        "        ):  # bucket b waits for bucket b + 1 (all of them go at the end)\n",
        "08 §2: bucket 0's all-reduce is in flight while backward still computes",
        "6a803d81",
    ),
    Mutation(
        "launch_after_a_fixed_delay",
        "ddp/ddp.py",
        "    def _launch(self, b: int) -> None:\n",
        "    def _launch(self, b: int) -> None:\n        __import__('time').sleep(0.005)\n",
        "08 §2: each bucket is launched as soon as its last gradient is in (timed by the ranks)",
        "s8-ready",
    ),
    Mutation(
        "default_group_world_size",
        "ddp/ddp.py",
        "        self.world_size = dist.get_world_size(self.process_group)\n",
        "        self.world_size = dist.get_world_size()\n",
        "08a §8: DDP in a group of one rank gives that rank's own gradient, as torch's does",
        "s8a-group",
    ),
    Mutation(
        "rebuild_on_each_ranks_own_order",
        "ddp/ddp.py",
        "        if self.rank == 0 and len(self._ready_order) == len(self._params):\n"
        "            order[:] = torch.tensor(self._ready_order)\n"
        "        order = order.to(self._comm_device)\n"
        "        if self.world_size > 1:\n"
        "            dist.broadcast(order, src=self._src, group=self.process_group)\n",
        "        if len(self._ready_order) == len(self._params):\n"
        "            order[:] = torch.tensor(self._ready_order)\n"
        "        order = order.to(self._comm_device)\n",
        "08a §1: ranks whose ready orders differ still rebuild the same buckets (rank 0's)",
        "s8a-rank0",
    ),
]

# Mutants no lesson assert catches yet: the finding, and the assert that would catch it, are in
# the reason; strict, so the marker must go once a lesson pins the claim.
UNPINNED: dict[str, str] = {}

NBVAL_TIMEOUT_S = 300


def derived_notebook(upto: str | None = None) -> nbformat.NotebookNode:
    """The lesson cells that carry the mutated claims, verbatim, in lesson order.

    With ``upto`` (a mutant's ``caught_by``), only that cell's lesson, from its setup cell up to
    that cell: a mutant needs no later claim, and each saved cell is a few seconds of CI.
    """
    out = nbformat.v4.new_notebook()
    for name, ids in LESSON_CELLS.items():
        if upto is not None:
            if upto not in ids:
                continue
            ids = ids[: ids.index(upto) + 1]
        cells = {c.get("id"): c for c in nbformat.read(NOTEBOOKS / name, as_version=4).cells}
        missing = [i for i in ids if i not in cells]
        assert not missing, f"{name} no longer has cells {missing}: update LESSON_CELLS"
        out.cells.extend(cells[i] for i in ids)
    assert out.cells, f"no lesson in LESSON_CELLS holds cell {upto!r}"
    out.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3"}}
    return out


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


def run_nbval(
    tmp_path: Path, mutation: Mutation | None, notebook_node: nbformat.NotebookNode | None = None
) -> subprocess.CompletedProcess:
    """The derived notebook (``notebook_node``, or this file's lesson cells up to the mutant's
    cell) under nbval, with the package copied (and mutated) first; ``-x`` for a mutant."""
    copy_package(tmp_path, mutation)
    notebook = tmp_path / "lesson_claims.ipynb"
    if notebook_node is None:
        notebook_node = derived_notebook(mutation.caught_by if mutation else None)
    nbformat.write(notebook_node, notebook)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax"]
    if mutation is not None:
        cmd.append("-x")  # the first failing cell is enough
    return subprocess.run(
        [*cmd, notebook.name],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=NBVAL_TIMEOUT_S,
    )


def failing_cells(output: str) -> list[str]:
    return re.findall(r"FAILED \S*::(Cell \d+)", output)


def test_the_unmutated_package_passes_the_lesson_cells(tmp_path):
    result = run_nbval(tmp_path, None)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.parametrize(
    "mutation",
    [
        pytest.param(
            m,
            marks=pytest.mark.xfail(strict=True, reason=UNPINNED[m.name])
            if m.name in UNPINNED
            else (),
        )
        for m in MUTATIONS
    ],
    ids=lambda m: m.name,
)
def test_a_planted_bug_makes_a_lesson_fail(mutation, tmp_path):
    result = run_nbval(tmp_path, mutation)
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"{mutation.name} went unnoticed; unpinned: {mutation.claim}"
    # A failed assert, not a crash: the mutant must break a claim, not the notebook.
    assert "AssertionError" in output, output[-4000:]
    ids = [c.get("id") for c in derived_notebook(mutation.caught_by).cells]
    caught = [ids[int(cell.split()[1])] for cell in failing_cells(output)]
    assert caught == [mutation.caught_by], (mutation.name, caught, output[-3000:])


def test_every_anchor_exists_exactly_once():
    """Cheap and first: a moved line fails here, by name, before any notebook runs."""
    for m in MUTATIONS:
        text = (PACKAGE / m.path).read_text()
        assert text.count(m.anchor) == 1, (m.name, m.path, text.count(m.anchor))
