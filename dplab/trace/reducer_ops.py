"""Which op in a torch.profiler trace is torch's reducer taking each gradient into its bucket.

torch DDP's reducer hooks each gradient's accumulation (reducer.cpp, ``mark_variable_ready_dense``)
and does one of three things there, each recorded under its own name:

- ``torch::distributed::reducer::mul_out``: copies the gradient into its bucket, dividing it
  by the world size on the way (no comm hook);
- ``torch::distributed::reducer::copy_``: copies it without dividing (a comm hook divides);
- ``aten::div_`` alone: divides in place, when the gradient already *is* a view of its bucket
  (``gradient_as_bucket_view=True`` and the gradients kept between steps, ``set_to_none=False``).

Each runs inside the gradient's autograd node (``autograd::engine::evaluate_function:
torch::autograd::AccumulateGrad``), right after the accumulation itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from dplab.trace.kineto import Event

ACCUMULATED = "torch::autograd::AccumulateGrad"
ACCUMULATE_NODE = "autograd::engine::evaluate_function: " + ACCUMULATED
GRAD_READY = "torch::distributed::reducer::mul_out"
HOOK_COPY = "torch::distributed::reducer::copy_"  # with a comm hook: copied, not divided
VIEW_DIVIDE = "aten::div_"  # the gradient is its bucket's view already: divided in place


def reducer_ops(events: Sequence[Event]) -> list[Event]:
    """The reducer's op on each gradient (see the module notes): inside each accumulation's
    autograd node, the first of them after the accumulation itself, on the same thread."""
    by_tid: dict[int, list[Event]] = {}
    for e in events:
        if e.name in (GRAD_READY, HOOK_COPY, VIEW_DIVIDE, ACCUMULATED):
            by_tid.setdefault(e.tid, []).append(e)
    for tid_events in by_tid.values():
        tid_events.sort(key=lambda e: e.start)
    out = []
    for node in (e for e in events if e.name == ACCUMULATE_NODE):
        inside = [e for e in by_tid.get(node.tid, []) if node.start <= e.start < node.end]
        acc = next((e for e in inside if e.name == ACCUMULATED), None)
        after = [e for e in inside if e.name != ACCUMULATED and acc and e.start >= acc.end]
        op = next((e for e in after if e.name in (GRAD_READY, HOOK_COPY)), None)
        if op is None:
            op = next(iter(after), None)
        if op is not None:
            out.append(op)
    return out
