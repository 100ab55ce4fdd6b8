"""Watching a learner's DDP on a rank without asking them to instrument anything.

While a :class:`Watch` is installed, the rank's ``torch.distributed.all_reduce`` (and
``all_reduce_coalesced``) and ``Work.wait`` are wrapped: every call is noted (when, how big,
which tensor, synchronous or not, from inside backward or not) and then passed on unchanged.
A gradient hook on every trainable parameter, registered *before* the learner's class is built
(so it runs before the learner's own hooks), notes when each gradient was computed. That is
enough to tell, afterwards, whether an all-reduce left while backward was still computing,
whether backward ever sat blocked in a collective, which collective carried which bucket, and
whether every asynchronous all-reduce was waited for before the optimizer step.

Every event gets a sequence number from one counter, so "before" and "after" are exact
orderings, never timing guesses; the ``perf_counter_ns`` stamps are only for drawing.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (hooks, callbacks)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class Collective:
    """One all-reduce the learner launched."""

    seq: int
    t_ns: int
    numel: int
    nbytes: int
    async_op: bool
    in_backward: bool
    ready: frozenset[int]  # trainable parameters whose gradient was computed by then
    grad_of: int | None  # the parameter whose .grad this tensor is, if it is one
    param_of: int | None  # the parameter whose *weights* this tensor is, if it is one
    done_ns: list[Any] = field(default_factory=lambda: [None])
    waited_seq: int | None = None


@dataclass
class Blocking:
    """A moment the rank's main thread sat waiting for a collective."""

    seq: int
    what: str  # "all_reduce(async_op=False)" or "wait()"
    in_backward: bool


@dataclass
class StepRecord:
    """What happened in one training step, in sequence numbers (and times for drawing)."""

    marks: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (seq, t_ns)
    grads: list[tuple[int, int, int]] = field(default_factory=list)  # (index, seq, t_ns)
    collectives: list[Collective] = field(default_factory=list)
    blocking: list[Blocking] = field(default_factory=list)


class Watch:
    """Install on a rank around the learner's training loop; read ``steps`` afterwards."""

    def __init__(self, module: nn.Module):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.frozen = [p for p in module.parameters() if not p.requires_grad]
        self._counter = itertools.count()
        self.steps: list[StepRecord] = []
        self._current: StepRecord | None = None
        self._ready: set[int] = set()
        self._works: dict[int, tuple[Any, Collective]] = {}
        self._originals: list[tuple[Any, str, Any]] = []
        self._hooks = [p.register_hook(self._grad_hook(i)) for i, p in enumerate(self.params)]

    # -- marks -----------------------------------------------------------------------------------

    def _next(self) -> tuple[int, int]:
        return next(self._counter), time.perf_counter_ns()

    def start_step(self) -> None:
        self._current = StepRecord()
        self.steps.append(self._current)
        self._ready = set()
        self.mark("start")

    def mark(self, name: str) -> None:
        if self._current is not None:
            self._current.marks[name] = self._next()

    def _grad_hook(self, index: int):
        def hook(grad: torch.Tensor) -> None:
            seq, t = self._next()
            self._ready.add(index)
            if self._current is not None:
                self._current.grads.append((index, seq, t))

        return hook

    # -- the wrapped calls -----------------------------------------------------------------------

    def install(self) -> Watch:
        ar, arc, wait = c10d.all_reduce, getattr(c10d, "all_reduce_coalesced", None), dist.Work.wait
        wrapped_ar = self._wrap_all_reduce(ar, coalesced=False)
        for owner in (dist, c10d):
            self._patch(owner, "all_reduce", wrapped_ar)
        if arc is not None:
            wrapped_arc = self._wrap_all_reduce(arc, coalesced=True)
            for owner in (dist, c10d):
                if hasattr(owner, "all_reduce_coalesced"):
                    self._patch(owner, "all_reduce_coalesced", wrapped_arc)
        self._patch(dist.Work, "wait", self._wrap_wait(wait))
        return self

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals = []
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def _identify(self, tensor: torch.Tensor) -> tuple[int | None, int | None]:
        ptr = tensor.data_ptr()
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None and g.data_ptr() == ptr and g.numel() == tensor.numel():
                return i, None
        for i, p in enumerate(self.params):
            start = p.untyped_storage().data_ptr()
            if start <= ptr < start + p.untyped_storage().nbytes():
                return None, i
        return None, None

    def _wrap_all_reduce(self, original: Any, *, coalesced: bool):
        watch = self

        def all_reduce(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args else kwargs.get("tensors" if coalesced else "tensor")
            # all_reduce(tensor, op, group, async_op) and all_reduce_coalesced(tensors, ...)
            async_op = kwargs.get("async_op", args[3] if len(args) > 3 else False)
            tensors = list(tensor) if coalesced else [tensor]
            grad_of, param_of = (None, None)
            if len(tensors) == 1:
                grad_of, param_of = watch._identify(tensors[0])
            seq, t = watch._next()
            record = Collective(
                seq=seq,
                t_ns=t,
                numel=sum(x.numel() for x in tensors),
                nbytes=sum(x.numel() * x.element_size() for x in tensors),
                async_op=bool(async_op),
                in_backward=in_backward(),
                ready=frozenset(watch._ready),
                grad_of=grad_of,
                param_of=param_of,
            )
            if watch._current is not None:
                watch._current.collectives.append(record)
            work = original(*args, **kwargs)
            if work is None:  # synchronous: the main thread waited for it, right here
                record.done_ns[0] = time.perf_counter_ns()
                record.waited_seq = record.seq
                if watch._current is not None:
                    watch._current.blocking.append(
                        Blocking(record.seq, "all_reduce(async_op=False)", record.in_backward)
                    )
            else:
                box = record.done_ns
                work.get_future().then(lambda _: box.__setitem__(0, time.perf_counter_ns()))
                watch._works[id(work)] = (work, record)
            return work

        return all_reduce

    def _wrap_wait(self, original: Any):
        watch = self

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            seq, _ = watch._next()
            entry = watch._works.get(id(work))
            if entry is not None and entry[0] is work:
                if entry[1].waited_seq is None:
                    entry[1].waited_seq = seq
                if watch._current is not None:
                    watch._current.blocking.append(Blocking(seq, "wait()", in_backward()))
            return original(work, *args, **kwargs)

        return wait

    def settle(self, timeout_s: float = 1.0) -> None:
        """Completion callbacks run on gloo's threads, maybe just after ``wait()`` returned."""
        deadline = time.monotonic() + timeout_s
        pending = [c for s in self.steps for c in s.collectives]
        while any(c.done_ns[0] is None for c in pending) and time.monotonic() < deadline:
            time.sleep(0.0005)
