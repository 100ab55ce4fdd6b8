"""dplab.DDP: torch's DistributedDataParallel, same arguments and behaviour, in readable Python.

The life of one training step on every rank (torch's reducer, step by step):

1. ``forward`` runs the local micro-batch through the replica. The replicas started equal: the
   constructor broadcast rank 0's parameters and buffers. Before a forward that follows a
   synchronising one, rank 0's buffers (BatchNorm statistics) are broadcast again.
2. ``loss.backward()`` produces gradients roughly last layer first. Each parameter has a
   post-accumulate-grad hook that copies its gradient into its bucket's flat buffer, multiplied
   by 1/N (torch's default, ``gradient_as_bucket_view=False``: ``.grad`` stays its own tensor), or
   divides it in place when ``.grad`` already *is* a view of the bucket
   (``gradient_as_bucket_view=True``). When a bucket's last gradient is in, its all-reduce is
   launched asynchronously, while autograd goes on with earlier layers. That is the overlap.
3. Buckets are launched strictly in bucket order, so every rank issues the same sequence of
   collectives even if its gradients arrive in a slightly different order.
4. At the end of backward an autograd-engine callback waits for every bucket and copies the
   averages back into ``.grad``. When ``loss.backward()`` returns, every ``.grad`` holds the
   global-batch gradient. No extra call is needed before ``optimizer.step()``.

Buckets are torch's (:mod:`dplab.ddp.buckets`): one bucket per dtype/device in iteration 0, then
a rebuild, once, in the order rank 0's gradients became ready. The lessons' textbook variant
(reverse-order buckets from step 0) is the dplab-only ``static_buckets=True``, which passing
``first_bucket_cap_mb`` selects.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab._nested import tensors_in
from dplab.ddp.buckets import (
    DEFAULT_BUCKET_CAP_MB,
    assign_buckets,
    bucket_plan,
    check_cap_mb,
    first_bucket_cap,
    rebuilt_buckets,
    torch_first_bucket_cap,
    torch_initial_buckets,
)
from dplab.ddp.comm_hooks import GradBucket, check_comm_hook, count_sent_bytes, hook_result
from dplab.trace.bucket import Bucket
from dplab.trace.observer import NullObserver, StepObserver

# id(parameter) -> (weakref to it, weakref to the DDP whose hooks it carries). A module wrapped
# again (a re-run notebook cell) detaches the old wrapper instead of stacking a second set of
# hooks on the same parameters (which halves every gradient, silently).
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_OWNERS_LOCK = threading.Lock()

_NOT_SUPPORTED = {
    "static_graph": False,
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "mixed_precision": None,
    "skip_all_reduce_unused_params": False,
    "bucket_cap_mb_list": None,
}


class DDP(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves globally averaged gradients.

    The arguments are torch's ``DistributedDataParallel``'s, with its defaults and behaviour;
    ``docs/ddp.md`` lists each one and what dplab does with it. dplab-only, keyword-only:

    Args:
        tracer: a :class:`dplab.Tracer` (any :class:`~dplab.trace.observer.StepObserver`) that
            records every step's timeline.
        first_bucket_cap_mb: the textbook variant's first-bucket cap (torch has no such
            argument: its first bucket is 1 MiB only when ``bucket_cap_mb`` is left default).
            Passing it selects ``static_buckets=True`` unless that is given.
        static_buckets: the textbook variant: buckets cut over reverse registration order from
            step 0 with caps ``[first, cap]`` (first = ``first_bucket_cap_mb``, else
            ``min(cap, 1 MiB)``), no rebuild unless ``rebuild_buckets=True``. Default: torch's
            buckets (one per dtype in iteration 0, rebuilt once).
        rebuild_buckets: rebuild once after the first synchronising backward in rank 0's
            gradient-ready order. Default: as torch (yes, unless ``find_unused_parameters``) for
            torch's buckets; no for static ones.
    """

    # Teaching variants override these (NaiveDDP, PerParameterDDP below).
    launch_when_ready = True
    default_static_buckets = False

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        tracer: Any = None,
        first_bucket_cap_mb: float | None = None,
        static_buckets: bool | None = None,
        rebuild_buckets: bool | None = None,
    ):
        super().__init__()
        given = {
            "static_graph": static_graph,
            "delay_all_reduce_named_params": delay_all_reduce_named_params,
            "param_to_hook_all_reduce": param_to_hook_all_reduce,
            "mixed_precision": mixed_precision,
            "skip_all_reduce_unused_params": skip_all_reduce_unused_params,
            "bucket_cap_mb_list": bucket_cap_mb_list,
        }
        for name, default in _NOT_SUPPORTED.items():
            if given[name] is not default and given[name] != default:
                raise NotImplementedError(
                    f"dplab.DDP does not support {name}={given[name]!r} (torch's "
                    f"DistributedDataParallel does); leave it at {default!r}. See docs/ddp.md."
                )
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is "
                "deprecated. Please avoid using it.",
                FutureWarning,
                stacklevel=2,
            )
        if not dist.is_initialized():
            raise RuntimeError("dplab.DDP needs torch.distributed: run it inside dplab.launch")
        self.module = module
        self.process_group = _group(process_group, device_mesh)
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._src = dist.get_global_rank(self.process_group, 0)  # rank 0 of the group
        self.dim = dim
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.batched_grad_copy = bool(batched_grad_copy)  # same results either way
        self.static_graph = False
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_sync_buffers = bool(forward_sync_buffers), True
        else:
            self.forward_sync_buffers = init_sync_buffers = bool(broadcast_buffers)
        self.require_backward_grad_sync = True  # toggled by no_sync(), read at forward
        self.require_forward_param_sync = True  # was the last forward a synchronising one?

        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = [(n, p) for n, p in module.named_parameters() if n not in ignored]
        self._buffers_to_sync = [b for n, b in module.named_buffers() if n not in ignored]
        self._ignored = ignored
        self._params = [(n, p) for n, p in named if p.requires_grad]
        if not self._params:
            raise RuntimeError(
                f"{type(module).__name__} has no trainable parameters: nothing to all-reduce "
                "(DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient)"
            )
        self.device_ids, self.output_device = _devices(self._params, device_ids, output_device)
        self.device = self._params[0][1].device

        # Bucket caps: torch's rule, or the textbook variant's.
        self.static_buckets = (
            (first_bucket_cap_mb is not None or self.default_static_buckets)
            if static_buckets is None
            else bool(static_buckets)
        )
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.bucket_cap_mb = check_cap_mb("bucket_cap_mb", cap)
        if first_bucket_cap_mb is not None or self.static_buckets:
            self.first_bucket_cap_mb = first_bucket_cap(self.bucket_cap_mb, first_bucket_cap_mb)
        else:
            self.first_bucket_cap_mb = torch_first_bucket_cap(bucket_cap_mb)
        if rebuild_buckets is None:
            rebuild_buckets = not self.static_buckets and not self.find_unused_parameters
        self._rebuild_pending = bool(rebuild_buckets)

        nccl = dist.get_backend(self.process_group) == "nccl"
        # Small bookkeeping collectives travel on the device the backend wants.
        self._comm_device = self.device if nccl else torch.device("cpu")
        if init_sync:
            self._check_same_parameters(named)
            state = [p.detach() for _, p in named]
            self._broadcast_from_rank0(state + (self._buffers_to_sync if init_sync_buffers else []))

        self._index = {id(p): i for i, (_, p) in enumerate(self._params)}
        self._lock = threading.Lock()
        self._comm_hook: Callable | None = None
        self._comm_hook_state: Any = None
        self._detached: str | None = None
        self._build_buckets(self._initial_plan())
        self._ready_order: list[int] = []
        self._order_recorded = False
        self._generation = 0
        self._sync_this_backward = True
        self._used_since_sync: set[int] = set()
        self._unused_this_backward: list[int] = []
        self._reset_backward_state()
        self._handles = self._register_hooks()
        weakref.finalize(self, _remove_hooks, self._handles, [id(p) for _, p in self._params])

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
        """Make every replica hold rank 0's values (one broadcast per dtype/device)."""
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

    def _sizes_and_keys(self) -> tuple[list[int], list[tuple[torch.dtype, torch.device]]]:
        params = [p for _, p in self._params]
        return [p.numel() * p.element_size() for p in params], [(p.dtype, p.device) for p in params]

    def _initial_plan(self) -> list[list[int]]:
        """The buckets before the first step, as parameter indices in buffer order."""
        nbytes, keys = self._sizes_and_keys()
        if not self.static_buckets:
            return torch_initial_buckets(
                nbytes,
                keys,
                bucket_cap_mb=self.bucket_cap_mb,
                first_bucket_cap_mb=self.first_bucket_cap_mb,
                find_unused_parameters=self.find_unused_parameters,
            )
        return self._static_plan(list(reversed(range(len(self._params)))))

    def _static_plan(self, order: list[int]) -> list[list[int]]:
        """The textbook cut: buckets filled over ``order`` with caps ``[first, cap]``."""
        nbytes, keys = self._sizes_and_keys()
        rows = [(self._params[i][0], 0, nbytes[i], keys[i]) for i in order]
        plan = bucket_plan(
            rows, bucket_cap_mb=self.bucket_cap_mb, first_bucket_cap_mb=self.first_bucket_cap_mb
        )
        return [[order[j] for j in bucket] for bucket in plan]

    def _rebuilt_plan(self, order: list[int]) -> list[list[int]]:
        """The buckets over ``order``, the order rank 0's gradients became ready."""
        nbytes, keys = self._sizes_and_keys()
        return rebuilt_buckets(
            order,
            nbytes,
            keys,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
        )

    def _build_buckets(self, plan: list[list[int]]) -> None:
        """Give each bucket a flat buffer and each parameter a view of its slot in it."""
        self._bucket_params: list[list[int]] = plan
        n = len(self._params)
        self._bucket_of = [0] * n
        self._offsets: list[list[int]] = []
        self.bucket_buffers: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = [torch.empty(0)] * n
        buckets = []
        for b, members in enumerate(plan):
            first = self._params[members[0]][1]
            numel = sum(self._params[i][1].numel() for i in members)
            buffer = torch.zeros(numel, dtype=first.dtype, device=first.device)
            offset, offsets = 0, []
            for i in members:
                p = self._params[i][1]
                view = buffer[offset : offset + p.numel()].view_as(p)
                offsets.append(offset)
                offset += p.numel()
                self._bucket_of[i] = b
                self._views[i] = view
                if self.gradient_as_bucket_view and p.grad is not None:
                    view.copy_(p.grad)  # keep gradients across a rebuild, as torch does
                    p.grad = view
            self._offsets.append(offsets)
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
        self._view_ptrs = [view.data_ptr() for view in self._views]

    def _register_hooks(self) -> list[Any]:
        """One post-accumulate-grad hook per parameter, holding the DDP only weakly."""
        with _OWNERS_LOCK:
            for _, p in self._params:
                entry = _OWNERS.get(id(p))
                old = entry[1]() if entry is not None and entry[0]() is p else None
                if old is not None and old is not self:
                    old._detach("its module was wrapped again by another dplab.DDP")
                    warnings.warn(
                        "this module was already wrapped by a dplab.DDP; that wrapper is now "
                        "detached (its hooks are removed). Use the new one.",
                        stacklevel=3,
                    )
            me = weakref.ref(self)
            for _, p in self._params:
                _OWNERS[id(p)] = (weakref.ref(p), me)
        return [
            p.register_post_accumulate_grad_hook(_param_hook(me, i))
            for i, (_, p) in enumerate(self._params)
        ]

    @property
    def detached(self) -> bool:
        """Whether a newer wrapper of the same module took over (this one's hooks are gone)."""
        return self._detached is not None

    def _detach(self, why: str) -> None:
        """Remove this wrapper's hooks; using it afterwards is an error that says ``why``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._detached = why

    def _rebuild_from_ready_order(self) -> None:
        """Rebuild once, in the order rank 0 saw gradients arrive (a collective: all agree)."""
        order = torch.full((len(self._params),), -1, dtype=torch.int64)
        if self.rank == 0 and len(self._ready_order) == len(self._params):
            order[:] = torch.tensor(self._ready_order)
        order = order.to(self._comm_device)
        if self.world_size > 1:
            dist.broadcast(order, src=self._src, group=self.process_group)
        self._rebuild_pending = False
        if (order < 0).any():
            return  # rank 0 did not see every gradient: keep the buckets we have
        self._build_buckets(self._rebuilt_plan(order.cpu().tolist()))
        self._reset_backward_state()
        self._observer.buckets_changed(self)

    # -- forward -------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._detached is not None:
            raise RuntimeError(f"this dplab.DDP was detached: {self._detached}")
        if self._st.open:
            self._recover()  # the last backward died (an exception in it): start clean
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self._rebuild_pending and self._order_recorded:
            self._rebuild_from_ready_order()
        if self.will_sync_module_buffers() and self.world_size > 1:
            self._broadcast_from_rank0(self._buffers_to_sync)
        if self.device_ids:
            args, kwargs = _to_device((args, kwargs), self.device)
        sync = grad_enabled and self.require_backward_grad_sync
        if grad_enabled:
            self._observer.forward_start()
        out = self.module(*args, **kwargs)
        self.require_forward_param_sync = sync
        if not grad_enabled:
            return out
        self._generation += 1
        self._sync_this_backward = sync
        if sync:
            tensors = [t for t in tensors_in(out) if t.grad_fn is not None]
            if self.find_unused_parameters:
                self._unused_this_backward = self._unreachable_params(tensors)
            me, generation = weakref.ref(self), self._generation
            for t in tensors:
                t.register_hook(_output_hook(me, generation))
        self._observer.forward_end(out)
        return out

    def will_sync_module_buffers(self) -> bool:
        """torch's rule: buffers are broadcast before a forward that follows a synchronising
        (grad-enabled, not ``no_sync``) one; the first forward counts as following one."""
        return (
            self.require_forward_param_sync
            and self.forward_sync_buffers
            and len(self._buffers_to_sync) > 0
        )

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _unreachable_params(self, roots: list[torch.Tensor]) -> list[int]:
        """Trainable parameters the autograd graph of ``roots`` never reaches (torch's search)."""
        seen: set[Any] = set()
        reached: set[int] = set()
        stack = [t.grad_fn for t in roots]
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
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch's contract: ``hook(state, bucket) -> torch.futures.Future`` replaces each
        bucket's all-reduce; the Future's value (a tensor, or a list of one) is the reduced
        bucket. Buckets are not divided by the world size first: the hook does that."""
        check_comm_hook(hook)
        if self._comm_hook is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        self._comm_hook, self._comm_hook_state = hook, state

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "dplab.DDP does not support join() (uneven inputs); give every rank the same "
            "number of batches. See docs/ddp.md."
        )

    # -- backward ------------------------------------------------------------------------------

    def _reset_backward_state(self) -> None:
        # A plain object, not attributes of this nn.Module: Module.__setattr__ is slow, and the
        # hooks change this state once per gradient.
        self._st = _Step(len(self._params), [len(m) for m in self._bucket_params])

    def _recover(self) -> None:
        """The previous backward raised before its end: wait for what it launched (so no
        collective still writes into a bucket) and forget its half-done state."""
        for work in self._st.works:
            with contextlib.suppress(Exception):
                work.wait()
        if not self._order_recorded:
            self._ready_order = []
        self._used_since_sync = set()
        self._reset_backward_state()

    def _queue_end_of_backward(self) -> None:
        if not self._st.queued:
            self._st.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_output_grad(self, generation: int) -> None:
        """The gradient reached an output of this forward: the user's own backward has begun.

        Queuing the end-of-backward callback here puts it in that backward's graph task, not in
        a reentrant one (``torch.utils.checkpoint(use_reentrant=True)`` runs its own backward,
        whose end is not the end of the step)."""
        with self._lock:
            if generation == self._generation and self._sync_this_backward:
                self._st.open = True
                self._queue_end_of_backward()

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        with self._lock:
            if not self._sync_this_backward:
                if self.find_unused_parameters and param.grad is not None:
                    self._used_since_sync.add(i)
                self._observer.grad_ready(i)
                self._queue_end_of_backward()  # only to tell the observer backward ended
                return
            st = self._st
            if not st.queued:
                st.open = True
                self._queue_end_of_backward()
            if not st.unused_marked:
                st.unused_marked = True
                for j in self._unused_this_backward:
                    self._mark_unused_ready(j)
            if self.find_unused_parameters:
                self._used_since_sync.add(i)
            # The common case of _copy_in, inline: this runs once per gradient.
            if param.grad.data_ptr() == self._view_ptrs[i]:
                st.in_place[i] = True
                st.in_place_count[self._bucket_of[i]] += 1
            else:
                self._copy_in(i, param)
            self._observer.grad_ready(i)
            self._mark_ready(i)

    def _copy_in(self, i: int, param: torch.Tensor) -> None:
        """torch's mark_variable_ready_dense: the gradient into its bucket slot.

        torch scales each gradient as it goes: ``grad * (1/N)`` into the slot when it copies,
        ``slot / N`` in place when ``.grad`` already is the slot. dplab notes which it was and
        applies the same operation to the whole bucket at launch (:meth:`_scale`): the same
        bits per element, one call per bucket instead of one per gradient."""
        grad, view = param.grad, self._views[i]
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == self._view_ptrs[i]:
            self._st.in_place[i] = True
            self._st.in_place_count[self._bucket_of[i]] += 1
        else:
            view.copy_(grad)
            if self.gradient_as_bucket_view:
                param.grad = view

    def _scale(self, b: int) -> None:
        """Bucket ``b`` times 1/N (copied gradients) or / N (in-place ones), as torch does."""
        n = self.world_size
        if n == 1 or self._comm_hook is not None:
            return  # a comm hook owns the whole reduction, division included (as in torch)
        buffer, count = self.bucket_buffers[b], self._st.in_place_count[b]
        if count == 0:
            buffer.mul_(1.0 / n)
        elif count == len(self._bucket_params[b]):
            buffer.div_(n)
        else:  # mixed: the first step after zero_grad(set_to_none=True) with views
            for i in self._bucket_params[b]:
                if self._st.in_place[i]:
                    self._views[i].div_(n)
                else:
                    self._views[i].mul_(1.0 / n)

    def _mark_unused_ready(self, i: int) -> None:
        """A parameter this backward will not reach: its slot holds its ``.grad`` (from earlier
        no_sync micro-batches) or zeros, so its bucket can go without it."""
        if self._params[i][1].grad is None:
            self._st.no_grad.add(i)
        self._copy_in(i, self._params[i][1])
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        if self._st.ready[i]:
            raise RuntimeError(
                f"parameter {self._params[i][0]!r} received its gradient twice in one backward: "
                "it is used both inside and outside a reentrant checkpoint, or backward was "
                "called twice on one forward (torch's DDP refuses this too unless "
                "static_graph=True, which dplab.DDP does not support)"
            )
        st = self._st
        st.ready[i] = True
        if self._rebuild_pending and not self._order_recorded:
            self._ready_order.append(i)
        b = self._bucket_of[i]
        st.pending[b] -= 1
        if st.pending[b] == 0:
            self._observer.bucket_ready(b)
            if self.launch_when_ready:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch every bucket that is ready, in bucket order, and stop at the first that isn't."""
        st = self._st
        while st.next_bucket < len(st.pending) and st.pending[st.next_bucket] == 0:
            self._launch(st.next_bucket)
            st.next_bucket += 1

    def _launch(self, b: int) -> None:
        self._scale(b)
        self._observer.allreduce_start(b)
        try:
            work, nbytes = self._start_collective(b)
        except BaseException:
            self._observer.allreduce_failed(b)
            raise
        self._st.works.append(work)
        self._observer.allreduce_launched(b, work, nbytes)

    def _start_collective(self, b: int) -> tuple[Any, int]:
        """Bucket ``b``'s all-reduce, or the comm hook's collective: (its future, bytes sent)."""
        buffer = self.bucket_buffers[b]
        if self._comm_hook is None:
            work: Any = dist.all_reduce(buffer, group=self.process_group, async_op=True)
            nbytes = buffer.numel() * buffer.element_size()
        else:
            members = self._bucket_params[b]
            bucket = GradBucket(
                b,
                len(self.bucket_buffers),
                buffer,
                self._offsets[b],
                [self._params[i][1].shape for i in members],
                [self._params[i][1] for i in members],
            )
            with count_sent_bytes() as sent:
                work = self._comm_hook(self._comm_hook_state, bucket)
            if not isinstance(work, torch._C.Future):
                raise TypeError(
                    f"comm hook {getattr(self._comm_hook, '__name__', self._comm_hook)!r} "
                    f"returned {type(work).__name__} for bucket {b}; it must return a "
                    "torch.futures.Future"
                )
            nbytes = sent[0]
        return work, nbytes

    def _end_of_backward(self) -> None:
        """Engine callback: every gradient is in. Launch what is left, wait, copy out, reset."""
        with self._lock:
            self._observer.backward_end(synced=self._sync_this_backward)
            if not self._sync_this_backward:
                self._reset_backward_state()
                return
            try:
                self._finish_sync_backward()
            finally:
                self._unused_this_backward = []
                self._reset_backward_state()
        self._observer.wait_end()

    def _finish_sync_backward(self) -> None:
        missing = [i for i, ready in enumerate(self._st.ready) if not ready]
        if missing and not self.find_unused_parameters:
            names = [self._params[i][0] for i in missing]
            raise RuntimeError(
                f"dplab.DDP: these parameters got no gradient in this backward: {names}. "
                "Every rank must all-reduce every bucket; if the model does not use every "
                "parameter in every step, wrap it with find_unused_parameters=True."
            )
        # Reachable from an output the loss left out: no gradient came, as for an unused one.
        self._st.unused_marked = True
        for i in missing:
            self._mark_unused_ready(i)
        self._launch_ready_buckets()  # the naive variant launches everything here
        for b, work in enumerate(self._st.works):
            if self._comm_hook is None:
                work.wait()
                continue
            result = hook_result(work.wait(), b)
            if result is not self.bucket_buffers[b]:
                self.bucket_buffers[b].copy_(result.view(-1))
        unused: set[int] = set()
        if self.find_unused_parameters:
            unused = self._globally_unused()
            self._used_since_sync = set()
        self._copy_out(unused)
        if self._rebuild_pending and not self._order_recorded and self._ready_order:
            self._order_recorded = True

    def _globally_unused(self) -> set[int]:
        """Parameters no rank used since the last sync: their ``.grad`` stays untouched."""
        used = torch.zeros(len(self._params), dtype=torch.int32, device=self._comm_device)
        if self._used_since_sync:
            used[sorted(self._used_since_sync)] = 1
        dist.all_reduce(used, group=self.process_group)
        return {i for i, u in enumerate(used.tolist()) if u == 0}

    def _copy_out(self, unused: set[int]) -> None:
        """torch's finalize: averages back into ``.grad`` (a copy, or the view itself).

        A parameter no rank used keeps its ``.grad`` untouched (None stays None, as in torch, so
        optimizers skip it); one only other ranks used gets their average."""
        if self.gradient_as_bucket_view:
            # Every gradient that came in already is its view (_copy_in made it so); only those
            # that had none need pointing at theirs.
            for i in self._st.no_grad - unused:
                self._params[i][1].grad = self._views[i]
            return
        dst, src = [], []
        for i, (_, p) in enumerate(self._params):
            if i in unused:
                continue
            view = self._views[i]
            if p.grad is None:
                p.grad = torch.empty_like(p).copy_(view)
            else:
                dst.append(p.grad)
                src.append(view)
        if dst:
            torch._foreach_copy_(dst, src)

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

    default_static_buckets = True

    def _initial_plan(self) -> list[list[int]]:
        return [[i] for i in reversed(range(len(self._params)))]

    def _rebuilt_plan(self, order: list[int]) -> list[list[int]]:
        return [[i] for i in order]


class ForwardOrderDDP(DDP):
    """Teaching variant: buckets cut in registration (forward) order, never rebuilt.

    Bucket 0 then holds the first layers, whose gradients backward delivers last. Buckets are
    launched strictly in index order (every rank must issue the same collectives in the same
    sequence), so no all-reduce can start before backward is over: what reverse order avoids.
    """

    default_static_buckets = True

    def _initial_plan(self) -> list[list[int]]:
        return self._static_plan(list(range(len(self._params))))

    def _rebuilt_plan(self, order: list[int]) -> list[list[int]]:
        return self._initial_plan()


class NaiveDDP(PerParameterDDP):
    """Teaching variant: wait for the whole backward, then all-reduce gradient after gradient.

    Nothing overlaps: every millisecond of communication is exposed.
    """

    launch_when_ready = False

    def _launch(self, b: int) -> None:
        super()._launch(b)
        self._st.works[-1].wait()  # blocking, one at a time


# -- helpers ----------------------------------------------------------------------------------


class _Step:
    """The hooks' bookkeeping for one backward (reset at its end, or at the next forward)."""

    __slots__ = (
        "in_place",
        "in_place_count",
        "next_bucket",
        "no_grad",
        "open",
        "pending",
        "queued",
        "ready",
        "unused_marked",
        "works",
    )

    def __init__(self, n_params: int, bucket_sizes: list[int]):
        self.open = False  # a synchronising backward began and has not finished
        self.queued = False  # its end-of-backward callback is queued
        self.unused_marked = False
        self.ready = [False] * n_params
        self.pending = list(bucket_sizes)
        self.next_bucket = 0
        self.works: list[Any] = []
        self.no_grad: set[int] = set()
        self.in_place = [False] * n_params
        self.in_place_count = [0] * len(bucket_sizes)


def _param_hook(ref: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._on_grad(i, param)

    return hook


def _output_hook(ref: weakref.ref, generation: int) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._on_output_grad(generation)

    return hook


def _remove_hooks(handles: list[Any], param_ids: list[int]) -> None:
    """When a DDP is garbage-collected, its parameters keep no hook of it."""
    for handle in handles:
        handle.remove()
    handles.clear()
    with _OWNERS_LOCK:
        for pid in param_ids:
            entry = _OWNERS.get(pid)
            if entry is not None and entry[1]() is None:
                del _OWNERS[pid]


def _group(process_group: Any, device_mesh: Any) -> Any:
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    return process_group if process_group is not None else dist.group.WORLD


def _devices(
    params: list[tuple[str, nn.Parameter]], device_ids: Any, output_device: Any
) -> tuple[list[int] | None, int | None]:
    """torch's checks of ``device_ids``/``output_device``: one device of a one-GPU module."""
    devices = {p.device for _, p in params}
    types = {d.type for d in devices}
    if len(types) != 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but "
            f"input module parameters locate in {types}."
        )
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(
            f"device_ids can only be None or contain a single element, got {device_ids!r}"
        )
    if not device_ids or types == {"cpu"} or len(devices) > 1:
        if device_ids or output_device is not None:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                f"{device_ids}, output_device {output_device}, and module parameters {devices}."
            )
        return None, None
    ids = [torch.device(d if not isinstance(d, int) else f"cuda:{d}").index for d in device_ids]
    (device,) = devices
    if ids[0] != device.index:
        raise ValueError(
            f"device_ids={device_ids!r} but the module's parameters are on {device}: move the "
            "module to that device first (model.to(device_ids[0]))"
        )
    out = ids[0] if output_device is None else torch.device(output_device).index
    if isinstance(output_device, int):
        out = output_device
    return ids, out


def _to_device(obj: Any, device: torch.device) -> Any:
    """Inputs onto the module's device, as torch does with ``device_ids``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(x, device) for x in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _describe(entry: Any) -> str:
    if entry is None:
        return "no parameter there"
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad else ", frozen"
    return f"{name!r} {list(shape)} {dtype}{frozen}"


__all__ = ["DDP", "NaiveDDP", "PerParameterDDP", "assign_buckets"]
