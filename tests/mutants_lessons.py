"""Planted bugs for the core lessons (03, 03b, 08, 08b) and the lesson cells that catch them.

The derived notebook is cells of ``03_dp_mechanics`` (setup, §3.3 traffic), of
``03b_batch_accumulation_allreduce`` (setup, §3.4 B_global, §3.5 accumulation), of ``08_ddp``
(setup, §1 the bucket map, §2 three ways to all-reduce and overlap by its definition, §4 the last
bucket) and of ``08b`` (the rebuild's order, the DDP's own group), copied verbatim by cell id. A
mutant runs only its own lesson's cells, up to the claim's cell; the control runs them all.
"""

from __future__ import annotations

import nbformat

from tests.mutation_harness import Mutation, lesson_cells

NAME = "lessons"

LESSON_CELLS = {
    "03_dp_mechanics.ipynb": [
        "s3-01",  # imports, the 2- and 4-rank pools
        "s3-19",  # §3.3: exactly the gradient bytes per step, each rank's own gradient ÷ N
        "s3-50",  # close the pools
    ],
    "03b_batch_accumulation_allreduce.ipynb": [
        "s3b-01",  # imports, the 2- and 4-rank pools
        "s3-24",  # §3.4: same B_global, same weights (N = 1, 2, 4)
        "s3-27",  # §3.5: one all-reduce per bucket with no_sync, the big batch's weights
        "s3b-50",  # close the pools
    ],
    "08_ddp.ipynb": [
        "cdff95d1",  # imports, the pool, MODEL, measure, every_step, median
        "b013b8ed", "s8-grads",  # §1: the bucket map; a multi-bucket plan's gradient values
        "fea0c5bd", "6a803d81",  # §2: naive, per-parameter, bucketed
        "s8-ready",  # §2: each bucket launched as soon as it is ready, timed by the ranks
        "5b9e2f47", "c8f06a1d",  # §2: overlap by its definition, on a comms-bound model
        "4ca31f54", "7a523b33",  # §4: the exposed last bucket
    ],
    "08b_torch_ddp_as_it_is.ipynb": [
        "s8c-01",  # imports, the pool
        "s8a-rank0",  # the rebuild takes rank 0's order, whatever each rank saw
        "s8a-group",  # DDP averages over its own process group
    ],
}  # fmt: skip


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
        "        return 1 if self._comm_hook is not None or self._mixed is not None else n\n",
        "        return 1  # planted: the buckets are summed, not averaged\n",
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
        "08b §7: DDP in a group of one rank gives that rank's own gradient, as torch's does",
        "s8a-group",
    ),
    Mutation(
        "rebuild_on_each_ranks_own_order",
        "ddp/plans.py",
        "        if self.rank == 0 and len(self._ready_order) == len(self._params):\n"
        "            order[:] = torch.tensor(self._ready_order)\n"
        "        order = order.to(self._comm_device)\n"
        "        if self.world_size > 1:\n"
        "            dist.broadcast(order, src=self._src, group=self.process_group)\n",
        "        if len(self._ready_order) == len(self._params):\n"
        "            order[:] = torch.tensor(self._ready_order)\n"
        "        order = order.to(self._comm_device)\n",
        "08b §1: ranks whose ready orders differ still rebuild the same buckets (rank 0's)",
        "s8a-rank0",
    ),
]


def notebook(mutation: Mutation | None) -> nbformat.NotebookNode:
    """The lesson cells that carry the mutated claims, verbatim, in lesson order.

    For a mutant, only its claim's lesson, from the setup cell up to the claim's cell: a mutant
    needs no later claim, and each saved cell is a few seconds of CI.
    """
    upto = mutation.caught_by if mutation else None
    out = nbformat.v4.new_notebook()
    for name, ids in LESSON_CELLS.items():
        if upto is not None:
            if upto not in ids:
                continue
            ids = ids[: ids.index(upto) + 1]
        out.cells.extend(lesson_cells(name, ids).cells)
    assert out.cells, f"no lesson in LESSON_CELLS holds cell {upto!r}"
    out.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3"}}
    return out
