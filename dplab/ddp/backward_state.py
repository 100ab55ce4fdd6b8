"""What dplab.DDP's hooks keep during one backward, and the hooks themselves.

A plain object with slots, not attributes of the DDP: ``nn.Module.__setattr__`` is slow, and the
hooks change this state once per gradient. It is replaced by a fresh one at the end of every
backward (or at the next forward, if a backward died half-way).

The hooks hold the DDP only through a weak reference, so that a dropped wrapper is collected (and
its hooks removed) instead of being kept alive by its own parameters.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class BackwardState:
    """The hooks' bookkeeping for one backward."""

    __slots__ = (
        "got_grad",
        "hits",
        "next_bucket",
        "no_grad",
        "open",
        "order",
        "outputs",
        "pending",
        "queued",
        "ready",
        "ready_order",
        "unused_marked",
        "used",
        "works",
    )

    def __init__(self, n_params: int, bucket_sizes: list[int]):
        self.open = False  # a synchronising backward began and has not finished
        self.queued = False  # its end-of-backward callback is queued
        self.got_grad = False  # a parameter's hook ran: this backward reduces (else: no sync)
        self.unused_marked = False  # the parameters this backward cannot reach are marked ready
        self.ready = [False] * n_params
        self.pending = list(bucket_sizes)  # per bucket: gradients still to come
        self.next_bucket = 0  # buckets launch strictly in order: the next one to launch
        self.outputs: dict[int, torch.Tensor] = {}  # mixed precision: bucket → what is summed
        self.used: tuple[Any, torch.Tensor] | None = None  # the used-counts all-reduce, launched
        self.works: list[Any] = []  # per bucket in launch order: its future (None: skipped)
        self.no_grad: set[int] = set()  # parameters with no .grad when their bucket launched
        self.ready_order: list[int] = []  # parameters in the order they became ready
        self.hits: list[int] = []  # static graph: gradients per parameter (made on first use)
        self.order: list[int] = []  # static graph's first iteration: first-gradient order


def param_hook(ref: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    """Parameter ``i``'s post-accumulate-grad hook: its gradient is in."""

    def hook(param: torch.Tensor) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._on_grad(i, param)

    return hook


def output_hook(ref: weakref.ref, generation: int) -> Callable[[torch.Tensor], None]:
    """A forward output's hook: the gradient reached it, so the user's backward has begun."""

    def hook(grad: torch.Tensor) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._on_output_grad(generation)

    return hook


def unreachable(roots: list[torch.Tensor], index: dict[int, int]) -> list[int]:
    """Trainable parameters the autograd graph of ``roots`` never reaches (torch's search for
    ``find_unused_parameters``). ``index`` maps ``id(parameter)`` to its index."""
    seen: set[Any] = set()
    reached: set[int] = set()
    stack = [t.grad_fn for t in roots]
    leaf = _accumulate_grad_type()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if type(fn) is leaf:  # a leaf's node: nothing comes after it
            i = index.get(id(fn.variable))
            if i is not None:
                reached.add(i)
            continue
        stack.extend([next_fn for next_fn, _ in fn.next_functions if next_fn is not None])
    return [i for i in range(len(index)) if i not in reached]


@functools.cache
def _accumulate_grad_type() -> type:
    """The class of autograd's leaf nodes (``AccumulateGrad``), whose ``variable`` is the
    parameter: comparing types is faster than asking every node for an attribute it lacks."""
    leaf = torch.ones(1, requires_grad=True)
    return type(leaf.expand(1).grad_fn.next_functions[0][0])  # type: ignore[union-attr]


def start_used_counts(
    used: set[int], n: int, device: torch.device, group: Any
) -> tuple[Any, torch.Tensor]:
    """Per parameter, how many ranks used it since the last sync (``used``: those this rank
    did): one small all-reduce, torch's ``local_used_map``, launched without waiting (torch
    launches it as the last bucket's gradients are in, so it travels beside that bucket's
    all-reduce). Returns (its work, the counts it will hold)."""
    marks = bytearray(n or 1)  # frombuffer refuses an empty buffer
    for i in used:
        marks[i] = 1
    flags = torch.frombuffer(marks, dtype=torch.uint8)[:n].to(device=device, dtype=torch.int32)
    return dist.all_reduce(flags, group=group, async_op=True), flags


def used_counts(
    used: set[int], n: int, device: torch.device, group: Any, started: Any = None
) -> torch.Tensor:
    """:func:`start_used_counts` (or its result ``started``, if launched already), waited for."""
    work, flags = started or start_used_counts(used, n, device, group)
    work.wait()
    return flags


def globally_unused(used: set[int], n: int, device: torch.device, group: Any) -> set[int]:
    """Parameters no rank used since the last sync. Their ``.grad`` stays untouched, as in
    torch."""
    return unused_of(used_counts(used, n, device, group))


def unused_of(counts: torch.Tensor) -> set[int]:
    return {i for i, c in enumerate(counts.tolist()) if c == 0}
