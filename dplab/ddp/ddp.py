"""dplab.DDP: data parallelism as torch's DistributedDataParallel does it, in one readable file.

The life of one training step on every rank:

1. ``forward`` runs the local micro-batch through the replica (the replicas started equal: the
   constructor broadcast rank 0's parameters and buffers).
2. ``loss.backward()`` produces gradients roughly last layer first. Each parameter has a
   post-accumulate-grad hook; when the last gradient of a bucket is in, the bucket's flat buffer
   is divided by the world size and its all-reduce is *launched asynchronously*, while autograd
   goes on computing the gradients of earlier layers. That is the overlap.
3. Buckets are launched strictly in bucket order, so every rank issues the same sequence of
   collectives even if its gradients arrive in a slightly different order.
4. At the end of backward an autograd-engine callback waits for every bucket. When
   ``loss.backward()`` returns, every ``.grad`` holds the average over ranks: the global-batch
   gradient. No extra call is needed before ``optimizer.step()``.

Gradients live in the buckets: each parameter's ``.grad`` is a view into its bucket's flat buffer
(torch's ``gradient_as_bucket_view=True``). Autograd accumulates into that view in place, so the
all-reduce works on the gradients where they are: no copy into the bucket before the
collective and no copy back after it, and one set of gradient memory instead of two. Only after
``zero_grad(set_to_none=True)`` does autograd hand over a fresh tensor; the hook then copies it
into the bucket once and points ``.grad`` back at the view.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab._nested import tensors_in
from dplab.ddp.buckets import bucket_plan, check_cap_mb
from dplab.trace.bucket import Bucket
from dplab.trace.observer import NullObserver, StepObserver


class DDP(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves globally averaged gradients.

    Args:
        bucket_cap_mb: bucket size limit in MiB (torch's default 25).
        first_bucket_cap_mb: limit of the first bucket of each dtype (torch's default 1 MiB),
            which holds the last layers' gradients: small, so their all-reduce starts early.
        process_group: defaults to the world.
        tracer: a :class:`dplab.Tracer` to record every step's timeline.
        find_unused_parameters: allow parameters that get no gradient in a step (found by
            walking the autograd graph after forward, as torch does); otherwise such a
            parameter is an error naming it.
        rebuild_buckets: after the first step, rebuild the buckets in the order gradients
            actually became ready (rank 0's order, so all ranks agree), as torch does.
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) before every
            forward, as torch does.
    """

    # Teaching variants override this flag, _plan and _launch (NaiveDDP, PerParameterDDP below).
    launch_when_ready = True

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        process_group: Any = None,
        tracer: Any = None,
        find_unused_parameters: bool = False,
        rebuild_buckets: bool = False,
        broadcast_buffers: bool = True,
    ):
        super().__init__()
        self.bucket_cap_mb = check_cap_mb("bucket_cap_mb", bucket_cap_mb)
        self.first_bucket_cap_mb = check_cap_mb("first_bucket_cap_mb", first_bucket_cap_mb)
        if not dist.is_initialized():
            raise RuntimeError("dplab.DDP needs torch.distributed: run it inside dplab.launch")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        nccl = dist.get_backend(self.process_group) == "nccl"
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._src = dist.get_global_rank(self.process_group, 0)  # rank 0 of the group
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers

        named = list(module.named_parameters())  # a tied parameter appears once
        self._check_same_parameters(named)
        self._broadcast_from_rank0([p.detach() for _, p in named] + list(module.buffers()))

        self._params = [(name, p) for name, p in named if p.requires_grad]
        if not self._params:
            raise ValueError(
                f"{type(module).__name__} has no trainable parameters: nothing to all-reduce"
            )
        self._index = {id(p): i for i, (_, p) in enumerate(self._params)}
        # Small bookkeeping collectives travel on the device the backend wants.
        self._comm_device = self._params[0][1].device if nccl else torch.device("cpu")
        # Gradients arrive last layer first, so buckets are cut from the reversed list.
        self._build_buckets(order=list(reversed(range(len(self._params)))), in_given_order=False)
        self._rebuild_pending = rebuild_buckets
        self._ready_order: list[int] = []
        self._synced_once = False

        self._sync = True  # toggled by no_sync(); read at forward time, as torch does
        self._sync_this_backward = True
        self._used_since_sync: set[int] = set()
        self._unused_this_backward: list[int] = []
        self._reset_backward_state()
        for i, (_, p) in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

        self.tracer = tracer
        self._observer: StepObserver = tracer if tracer is not None else NullObserver()
        self._observer.attach(self)

    # -- construction --------------------------------------------------------------------------

    def _check_same_parameters(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Every rank must hold the same parameters, or the all-reduces would mix up tensors."""
        mine = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in named]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        reference = everyone[0]
        for rank, theirs in enumerate(everyone[1:], start=1):
            if theirs == reference:
                continue
            for i in range(max(len(reference), len(theirs))):
                a = reference[i] if i < len(reference) else None
                b = theirs[i] if i < len(theirs) else None
                if a != b:
                    raise ValueError(
                        f"parameters differ across ranks at position {i}: rank 0 has "
                        f"{_describe(a)} but rank {rank} has {_describe(b)}"
                    )

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Make every replica start from rank 0's weights (one broadcast per dtype/device)."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for group in groups.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            if self.world_size > 1:
                dist.broadcast(flat, src=self._src, group=self.process_group)
            offset = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _plan(self, order: list[int], in_given_order: bool) -> list[list[int]]:
        rows = [
            (self._params[i][0], p.numel(), p.numel() * p.element_size(), (p.dtype, p.device))
            for i in order
            for p in [self._params[i][1]]
        ]
        return bucket_plan(
            rows,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            in_given_order=in_given_order,
        )

    def _build_buckets(self, *, order: list[int], in_given_order: bool) -> None:
        """Cut buckets over ``order`` and give each a flat buffer that the grads view."""
        plan = [[order[j] for j in bucket] for bucket in self._plan(order, in_given_order)]
        self._bucket_params: list[list[int]] = plan
        self._bucket_of = [0] * len(self._params)
        self.bucket_buffers: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = [torch.empty(0)] * len(self._params)
        buckets = []
        for b, members in enumerate(plan):
            first = self._params[members[0]][1]
            numel = sum(self._params[i][1].numel() for i in members)
            buffer = torch.zeros(numel, dtype=first.dtype, device=first.device)
            offset = 0
            for i in members:
                p = self._params[i][1]
                view = buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                self._bucket_of[i] = b
                self._views[i] = view
                if p.grad is not None:  # keep gradients across a rebuild
                    view.copy_(p.grad)
                    p.grad = view
            self.bucket_buffers.append(buffer)
            buckets.append(
                Bucket(
                    index=b,
                    param_names=tuple(self._params[i][0] for i in members),
                    numel=numel,
                    nbytes=numel * buffer.element_size(),
                    dtype=first.dtype,
                    device=first.device,
                )
            )
        self.buckets: list[Bucket] = buckets

    def _rebuild_from_ready_order(self) -> None:
        """Rebuild once, in the order rank 0 saw gradients arrive (a collective: all agree)."""
        order = torch.full((len(self._params),), -1, dtype=torch.int64)
        if self.rank == 0 and len(self._ready_order) == len(self._params):
            order[:] = torch.tensor(self._ready_order)
        order = order.to(self._comm_device)
        dist.broadcast(order, src=self._src, group=self.process_group)
        if (order < 0).any():
            return  # rank 0 did not see every gradient: keep the buckets we have
        self._build_buckets(order=order.cpu().tolist(), in_given_order=True)
        self._observer.buckets_changed(self)

    # -- forward -------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._rebuild_pending and self._synced_once:
            self._rebuild_pending = False
            self._rebuild_from_ready_order()
        if self.broadcast_buffers and self.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                self._broadcast_from_rank0(buffers)
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        self._observer.forward_start()
        out = self.module(*args, **kwargs)
        self._sync_this_backward = self._sync
        if self.find_unused_parameters and self._sync:
            self._unused_this_backward = self._unreachable_params(out)
        self._observer.forward_end(out)
        return out

    def _unreachable_params(self, out: Any) -> list[int]:
        """Trainable parameters the autograd graph of ``out`` never reaches (torch's search)."""
        seen: set[Any] = set()
        reached: set[int] = set()
        stack = [t.grad_fn for t in tensors_in(out) if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)
            if variable is not None and id(variable) in self._index:
                reached.add(self._index[id(variable)])
            stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
        return [i for i in range(len(self._params)) if i not in reached]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes of forwards run in here communicate
        nothing. The next synchronising backward all-reduces the sum, once per bucket."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- backward ------------------------------------------------------------------------------

    def _reset_backward_state(self) -> None:
        self._callback_queued = False
        self._ready = [False] * len(self._params)
        self._pending = [len(members) for members in self._bucket_params]
        self._next_bucket = 0
        self._works: list[Any] = []
        self._no_grad: set[int] = set()

    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            self._grad_ready(i, param)

        return hook

    def _grad_ready(self, i: int, param: torch.Tensor) -> None:
        view = self._views[i]
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)  # first backward after zero_grad(set_to_none=True)
            param.grad = view
        self._observer.grad_ready(i)
        if self.find_unused_parameters:
            self._used_since_sync.add(i)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if self._sync_this_backward:
                for j in self._unused_this_backward:
                    self._mark_unused_ready(j)
        if self._sync_this_backward:
            self._mark_ready(i)

    def _mark_unused_ready(self, i: int) -> None:
        """A parameter this forward did not use: its bucket slot holds what it has (its grads
        from earlier no_sync micro-batches) or zeros, so its bucket can go without it."""
        p, view = self._params[i][1], self._views[i]
        if p.grad is None:
            view.zero_()
            self._no_grad.add(i)
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        if self._ready[i]:
            raise RuntimeError(
                f"parameter {self._params[i][0]!r} received its gradient twice in one backward "
                "(reentrant backward is not supported by dplab.DDP)"
            )
        self._ready[i] = True
        if self._rebuild_pending:
            self._ready_order.append(i)
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._observer.bucket_ready(b)
            if self.launch_when_ready:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch every bucket that is ready, in bucket order, and stop at the first that isn't."""
        while self._next_bucket < len(self._pending) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, b: int) -> None:
        buffer = self.bucket_buffers[b]
        buffer.div_(self.world_size)  # sum of (g_i / N) over ranks = the average
        self._observer.allreduce_start(b)
        work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        self._works.append(work)
        self._observer.allreduce_launched(b, work, buffer.numel() * buffer.element_size())

    def _end_of_backward(self) -> None:
        """Engine callback: every gradient is in. Launch what is left, wait, and reset."""
        self._observer.backward_end(synced=self._sync_this_backward)
        if not self._sync_this_backward:
            self._reset_backward_state()
            return
        try:
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            if missing:
                names = [self._params[i][0] for i in missing]
                raise RuntimeError(
                    f"dplab.DDP: these parameters got no gradient in this backward: {names}. "
                    "Every rank must all-reduce every bucket; if the model does not use every "
                    "parameter in every step, wrap it with find_unused_parameters=True."
                )
            self._launch_ready_buckets()  # the naive variant launches everything here
            for work in self._works:
                work.wait()
            if self.find_unused_parameters:
                self._share_unused()
        finally:
            self._used_since_sync = set()
            self._unused_this_backward = []
            self._reset_backward_state()
        self._synced_once = True
        self._observer.wait_end()

    def _share_unused(self) -> None:
        """A parameter no rank used keeps ``.grad = None`` (as in torch, so optimizers skip it);
        one that only other ranks used gets their average."""
        used = torch.zeros(len(self._params), device=self._comm_device)
        used[sorted(self._used_since_sync)] = 1
        dist.all_reduce(used, group=self.process_group)
        for i in self._no_grad:
            if used[i] > 0:
                self._params[i][1].grad = self._views[i]

    # -- teaching aids -------------------------------------------------------------------------

    def bucket_of(self, name: str) -> int:
        """The bucket index that holds parameter ``name``."""
        for i, (n, _) in enumerate(self._params):
            if n == name:
                return self._bucket_of[i]
        raise KeyError(f"no trainable parameter named {name!r}")


class PerParameterDDP(DDP):
    """Teaching variant: every gradient its own asynchronous all-reduce (no buckets).

    The overlap is there, but a model with hundreds of tensors pays hundreds of collective
    latencies: the latency-bound end of the bucket-size trade-off.
    """

    def _plan(self, order: list[int], in_given_order: bool) -> list[list[int]]:
        return [[j] for j in range(len(order))]


class NaiveDDP(PerParameterDDP):
    """Teaching variant: wait for the whole backward, then all-reduce gradient after gradient.

    Nothing overlaps: every millisecond of communication is exposed.
    """

    launch_when_ready = False

    def _launch(self, b: int) -> None:
        super()._launch(b)
        self._works[-1].wait()  # blocking, one at a time


def _describe(entry: Any) -> str:
    if entry is None:
        return "no parameter there"
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad else ", frozen"
    return f"{name!r} {list(shape)} {dtype}{frozen}"
