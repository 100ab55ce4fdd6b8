"""dplab.DDP: torch's DistributedDataParallel, same arguments and behaviour, in readable Python.

The life of one training step on every rank (torch's reducer, step by step):

1. ``forward`` runs the local micro-batch through the replica. The replicas started equal: the
   constructor broadcast rank 0's parameters and buffers. Before a forward that follows a
   synchronising one, rank 0's buffers (BatchNorm statistics) are broadcast again.
2. ``loss.backward()`` produces gradients roughly last layer first. Each parameter has a
   post-accumulate-grad hook that notes its gradient is in. When a bucket's last gradient is
   in, the gradients go into their slots of the bucket's flat buffer times 1/N in one or two
   calls (torch's default, ``gradient_as_bucket_view=False``: ``.grad`` stays its own tensor),
   or are divided in place when ``.grad`` already *is* a view of the bucket
   (``gradient_as_bucket_view=True``; a sparse gradient is its own bucket, divided in place),
   and its all-reduce is launched asynchronously while autograd goes on with earlier layers.
   That is the overlap.
3. Buckets are launched strictly in bucket order, so every rank issues the same sequence of
   collectives even if its gradients arrive in a slightly different order.
4. At the end of backward an autograd-engine callback waits for the buckets in order, copying
   each one's averages back into ``.grad`` as it completes. When ``loss.backward()`` returns,
   every ``.grad`` holds the global-batch gradient. No extra call is needed before
   ``optimizer.step()``.

Buckets are torch's (:mod:`dplab.ddp.buckets`): one bucket per dtype/device in iteration 0, then
a rebuild, once, in the order rank 0's gradients became ready. The lessons' textbook variant
(reverse-order buckets from step 0) is the dplab-only ``static_buckets=True``, which passing
``first_bucket_cap_mb`` selects; :mod:`dplab.ddp.textbook` is the same mechanism without torch's
features, for reading.

Beside it, one module each: torch's argument checks, bucket ``plans`` and memory (``layout``),
``replicas``, the hooks' ``backward_state``, the re-wrap guard ``rewrap``, ``comm_hooks``,
``buffer_sync``, ``static_graph``'s errors, ``join`` (uneven inputs), ``logging_data``,
``mixed_precision``, the rest of torch's API (``torch_api``, ``reducer_view``); the teaching
``variants`` build on this class.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab._nested import tensors_in
from dplab.ddp.arguments import (
    check_devices,
    check_wrappable,
    refuse_unsupported,
    resolve_group,
    sparse_parameters,
    sync_buffers_flags,
    to_device,
)
from dplab.ddp.backward_state import (
    BackwardState,
    output_hook,
    param_hook,
    start_used_counts,
    unreachable,
    unused_of,
    used_counts,
)
from dplab.ddp.buffer_sync import BufferSyncMixin
from dplab.ddp.comm_hooks import GradBucket, run_comm_hook, wait_bucket
from dplab.ddp.join import JoinMixin
from dplab.ddp.layout import copy_out, fill, lay_out, tensor_bytes
from dplab.ddp.logging_data import LoggingData, LoggingMixin
from dplab.ddp.mixed_precision import MixedPrecision
from dplab.ddp.plans import PlanMixin
from dplab.ddp.replicas import broadcast_from, check_same_parameters
from dplab.ddp.rewrap import claim, remove_hooks
from dplab.ddp.static_graph import changed_graph_error, unfinished_error, unused_error
from dplab.ddp.torch_api import TorchApiMixin
from dplab.trace.bucket import Bucket
from dplab.trace.observer import NullObserver, StepObserver


class DDP(TorchApiMixin, LoggingMixin, PlanMixin, BufferSyncMixin, JoinMixin, nn.Module):
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
        broadcast_buffers: bool | None = None,
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
        batched_grad_copy: bool = False,  # torch's; speed only: dplab copies with _foreach_copy_
        forward_sync_buffers: bool | None = None,
        *,
        tracer: Any = None,
        first_bucket_cap_mb: float | None = None,
        static_buckets: bool | None = None,
        rebuild_buckets: bool | None = None,
    ):
        super().__init__()
        refuse_unsupported(
            {
                "delay_all_reduce_named_params": delay_all_reduce_named_params,
                "param_to_hook_all_reduce": param_to_hook_all_reduce,
            },
            check_reduction=check_reduction,
        )
        self.forward_sync_buffers, init_sync_buffers = sync_buffers_flags(
            broadcast_buffers, forward_sync_buffers
        )
        if not dist.is_initialized():
            raise RuntimeError("dplab.DDP needs torch.distributed: run it inside dplab.launch")
        self.module = module
        self.device_mesh = device_mesh
        self.process_group = resolve_group(process_group, device_mesh)
        self._by_default_group = process_group is None and device_mesh is None
        self.dim = dim
        self.find_unused_parameters = bool(find_unused_parameters)
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = False
        self.require_backward_grad_sync = True  # toggled by no_sync(), read at forward
        self.require_forward_param_sync = True  # was the last forward a synchronising one?
        named = self._select_parameters(module, device_ids, output_device)
        self._choose_buckets(
            bucket_cap_mb, bucket_cap_mb_list, first_bucket_cap_mb, static_buckets, rebuild_buckets
        )
        self._join_group()
        if init_sync:
            check_same_parameters(named, self.process_group)
            buffers = self._current_buffers() if init_sync_buffers else []
            self._broadcast_from_rank_0([p.detach() for _, p in named] + buffers)
        self.mixed_precision = mixed_precision
        self._mixed = (
            None
            if mixed_precision is None
            else MixedPrecision(mixed_precision, module, self._ignored, self.world_size)
        )
        # Full-precision gradients cannot be views of low-precision buckets.
        self._grads_as_views = self.gradient_as_bucket_view and self._mixed is None
        self._comm_hook: Callable | None = None
        self._comm_hook_state: Any = None
        self._buffer_hook: tuple | None = None
        self._detached: str | None = None
        self._static_requested = bool(static_graph)  # torch: one bucket per dtype at first
        self._build_buckets(self._initial_plan())
        self._ready_order: list[int] = []
        self._last_ready_order: list[int] = []
        self._order_recorded = False
        self._static_counts: list[int] | None = None  # static graph: hooks per parameter
        self._static_unused: list[int] = []
        self._static_unused_set: set[int] = set()
        self._static_global_unused: set[int] = set()
        self._unused_this_iteration: list[int] = []
        self._log_times = False  # this iteration's times go to the logging data
        self._unfinished: str | None = None  # the last backward left parameters unreduced
        self._buckets_reduced = 0  # in the last synchronising backward (torch's logging data)
        self._used_counts = torch.zeros(len(self._params), dtype=torch.int32)  # ranks per param
        self._graph_static = True  # no forward has changed the set of unused parameters yet
        self._unused_this_backward_last: list[int] = []
        self._start_hooks()
        self._logging = LoggingData()
        self._logging.construction(self, *self._bucket_bytes())
        if static_graph:
            self._set_static_graph()
        self.tracer = tracer
        self._watching = tracer is not None  # else every observer call is skipped, not made
        self._observer: StepObserver = tracer if tracer is not None else NullObserver()
        self._observer.attach(self)

    # -- construction --------------------------------------------------------------------------

    def _select_parameters(
        self, module: nn.Module, device_ids: Any, output_device: Any
    ) -> list[tuple[str, nn.Parameter]]:
        """The parameters and buffers DDP keeps in sync (all but the ignored ones), and of those
        the trainable parameters it reduces. Returns every kept parameter, frozen ones too."""
        self._ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.parameters_to_ignore = self._ignored  # torch's name
        check_wrappable(module)
        named = self._kept_parameters()
        self._current_buffers()
        self._params = [(n, p) for n, p in named if p.requires_grad]
        sparse = sparse_parameters(module)
        self._sparse = frozenset(i for i, (_, p) in enumerate(self._params) if id(p) in sparse)
        if not self._params:
            raise RuntimeError(
                f"{type(module).__name__} has no trainable parameters: nothing to all-reduce "
                "(DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient)"
            )
        self.device_ids, self.output_device = check_devices(self._params, device_ids, output_device)
        self.device = self._params[0][1].device
        return named

    def _join_group(self) -> None:
        """This rank's place in the group, and where small bookkeeping collectives travel."""
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._src = dist.get_global_rank(self.process_group, 0)  # rank 0 of the group
        nccl = dist.get_backend(self.process_group) == "nccl"
        self._comm_device = self.device if nccl else torch.device("cpu")

    def _start_hooks(self) -> None:
        """Fresh per-step state, one hook per parameter, and the re-wrap guard's claim."""
        self._index = {id(p): i for i, (_, p) in enumerate(self._params)}
        self._lock = threading.Lock()
        self._generation = 0
        self._sync_this_backward = True
        self._used_since_sync: set[int] = set()
        self._unused_this_backward: list[int] = []
        self._reset_backward_state()
        claim(self)
        me = weakref.ref(self)
        self._handles = [
            p.register_post_accumulate_grad_hook(param_hook(me, i))
            for i, (_, p) in enumerate(self._params)
        ]
        weakref.finalize(self, remove_hooks, self._handles)

    def _broadcast_from_rank_0(self, tensors: list[torch.Tensor]) -> None:
        if self.world_size > 1:
            broadcast_from(tensors, self._src, self.process_group)

    def _build_buckets(self, plan: list[list[int]]) -> None:
        """Give each bucket a flat buffer and each parameter a view of its slot in it."""
        dtype = None if self._mixed is None else self._mixed.param_dtype
        views, sparse = self._grads_as_views, self._sparse
        layout = lay_out(self._params, plan, grads_as_views=views, sparse=sparse, dtype=dtype)
        self._layout = layout
        self._bucket_params = layout.members
        self._bucket_of = layout.bucket_of
        self.bucket_buffers: list[torch.Tensor] = layout.buffers
        self.buckets: list[Bucket] = layout.buckets

    # -- forward -------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._detached is not None:
            raise RuntimeError(f"this dplab.DDP was detached: {self._detached}")
        if self._st.open:
            self._recover()  # the last backward died (an exception in it): start clean
        if self._unfinished is not None:
            message, self._unfinished = self._unfinished, None
            self._log_and_throw(RuntimeError, message)
        grad_enabled = torch.is_grad_enabled()
        sync = grad_enabled and self.require_backward_grad_sync
        if sync:
            self._logging.before_forward(self)
            self._log_times = self._logging.sampled()
        self._notify_join()  # a collective only inside an enabled torch Join context
        if grad_enabled and self._rebuild_pending and self._order_recorded:
            self._rebuild_from_ready_order()
        if self._buffer_hook_at(post_forward=False):
            self._sync_buffers()
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        if self.device_ids:
            args, kwargs = to_device((args, kwargs), self.device)
        if self._mixed is not None:
            self._mixed.to_low()
            args, kwargs = self._mixed.cast_inputs((args, kwargs))
        if grad_enabled and self._watching:
            self._observer.forward_start()
        out = self.module(*args, **kwargs)
        if self._mixed is not None and not grad_enabled:
            self._mixed.to_full()  # no backward will follow to put full precision back
        if self._buffer_hook_at(post_forward=True):
            self._sync_buffers()
        self.require_forward_param_sync = sync
        if not grad_enabled:
            return out
        self._generation += 1
        self._sync_this_backward = sync
        if sync:
            tensors = [t for t in tensors_in(out) if t.grad_fn is not None]
            if self.static_graph:  # no search: the first iteration's unused ones (or none yet)
                self._unused_this_backward = self._static_unused
            elif self.find_unused_parameters:
                with torch.autograd.profiler.record_function("search_unused_parameters"):
                    unused = unreachable(tensors, self._index)
                if self._graph_static and self._logging.iterations > 1:  # torch: the same set
                    self._graph_static = unused == self._unused_this_backward_last
                self._unused_this_backward = self._unused_this_backward_last = unused
            me, generation = weakref.ref(self), self._generation
            for t in tensors:
                t.register_hook(output_hook(me, generation))
        if self._watching:
            self._observer.forward_end(out)
        return out

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # -- backward ------------------------------------------------------------------------------

    def _reset_backward_state(self) -> None:
        self._st = BackwardState(len(self._params), [len(m) for m in self._bucket_params])

    def _recover(self) -> None:
        """The previous backward raised before its end: wait for what it launched (so no
        collective still writes into a bucket) and forget its half-done state."""
        for work in [*self._st.works, self._st.used[0] if self._st.used else None]:
            with contextlib.suppress(Exception):
                if work is not None:
                    work.wait()
        if self._mixed is not None:
            self._mixed.to_full()
        missing = [i for i, ready in enumerate(self._st.ready) if not ready]
        if not self._order_recorded:
            self._ready_order = []
        self._used_since_sync = set()
        self._reset_backward_state()
        if self.static_graph and self._static_counts is not None:  # torch's error, then clean
            names = [self._params[i][0] for i in missing]
            self._log_and_throw(RuntimeError, unfinished_error(self.rank, missing, names))

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
        """Parameter ``i``'s gradient is in. This runs once per gradient, so it only keeps
        count: the gradients are copied into their bucket when the bucket is full
        (:func:`~dplab.ddp.layout.fill`), in one call per bucket."""
        with self._lock:
            if not self._sync_this_backward:
                if self.find_unused_parameters and param.grad is not None:
                    self._used_since_sync.add(i)
                if self._watching:
                    self._observer.grad_ready(i)
                    self._queue_end_of_backward()  # only to tell the observer backward ended
                return
            st = self._st
            if not st.got_grad and self._log_times:
                self._logging.record("backward_compute_start")
            st.got_grad = True
            if not st.queued:
                st.open = True
                self._queue_end_of_backward()
            if not st.unused_marked:
                st.unused_marked = True
                for j in self._unused_this_backward:
                    self._mark_unused_ready(j)
            if (self.find_unused_parameters or self.static_graph) and param.grad is not None:
                self._used_since_sync.add(i)  # torch: an undefined gradient is not a use
            if self._watching:
                self._observer.grad_ready(i)
            if self.static_graph and not self._static_hit(i):
                return  # more gradients of this parameter are still to come
            self._mark_ready(i)

    def _static_hit(self, i: int) -> bool:
        """Static graph: count parameter ``i``'s gradient; is it now ready? In the first
        iteration nothing is ready before the end (all buckets are reduced then, as torch's
        delayed all-reduce); afterwards, when the first iteration's count is reached."""
        st = self._st
        if not st.hits:
            st.hits = [0] * len(self._params)
        st.hits[i] += 1
        if self._static_counts is None:
            if st.hits[i] == 1:
                st.order.append(i)
            return False
        expected = self._static_counts[i]
        if st.hits[i] > expected or i in self._static_unused_set:
            self._log_and_throw(RuntimeError, changed_graph_error(self._params[i][0]))
        return st.hits[i] == expected

    def _mark_unused_ready(self, i: int) -> None:
        """Unreachable in this backward: its slot gets its ``.grad`` (from no_sync) or zeros."""
        if self._params[i][1].grad is None:
            self._st.no_grad.add(i)
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        st = self._st
        if st.ready[i]:
            raise RuntimeError(
                f"parameter {self._params[i][0]!r} received its gradient twice in one backward: "
                "it is used both inside and outside a reentrant checkpoint, or in two forwards "
                "before one backward (torch's DDP refuses this too; wrap with static_graph=True)"
            )
        st.ready[i] = True
        st.ready_order.append(i)
        if self._rebuild_pending and not self._order_recorded:
            self._ready_order.append(i)
        b = self._bucket_of[i]
        st.pending[b] -= 1
        if st.pending[b] == 0:
            if self._watching:
                self._observer.bucket_ready(b)
            if self.launch_when_ready:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch every bucket that is ready, in bucket order, and stop at the first that isn't."""
        st = self._st
        while st.next_bucket < len(st.pending) and st.pending[st.next_bucket] == 0:
            b = st.next_bucket
            if self._skips(b):
                st.works.append(None)
            else:
                self._launch(b)
            st.next_bucket += 1
        if st.next_bucket == len(st.pending) and st.used is None and self._searches():
            n, group = len(self._params), self.process_group
            st.used = start_used_counts(self._used_since_sync, n, self._comm_device, group)

    def _searches(self) -> bool:
        """Does this backward count unused parameters (find-unused, or static graph's first)?"""
        if self.static_graph:
            return self._static_counts is None
        return self.find_unused_parameters

    def _skips(self, b: int) -> bool:
        """torch's ``skip_all_reduce_unused_params``: a bucket that holds only parameters this
        rank's forward did not reach is not all-reduced, and their ``.grad`` stays as it is
        (``Reducer::should_skip_all_reduce_bucket``). The choice is this rank's own: the ranks
        must agree on which parameters go unused, or their collectives stop matching."""
        if not self.skip_all_reduce_unused_params or not self._unused_this_backward:
            return False
        unused = set(self._unused_this_backward)
        return all(i in unused for i in self._bucket_params[b])

    def _launch(self, b: int) -> None:
        if self._log_times:
            self._logging.record("comm_start", first=True)
        views, n = self._grads_as_views, self._divide_by()
        fill(self._layout, self._params, b, grads_as_views=views, world_size=n)
        self._observer.allreduce_start(b)
        try:
            work, nbytes = self._start_collective(b)
        except BaseException:
            self._observer.allreduce_failed(b)
            raise
        self._st.works.append(work)
        self._observer.allreduce_launched(b, work, nbytes)

    def _divide_by(self) -> int:
        """What each gradient is divided by before the all-reduce: the world size (the ranks
        still in, under ``join``), or 1 when a comm hook owns the whole reduction (as torch;
        mixed precision is one: torch runs it as a comm hook that divides after the sum)."""
        n = self._divisor()
        return 1 if self._comm_hook is not None or self._mixed is not None else n

    def _start_collective(self, b: int) -> tuple[Any, int]:
        """Bucket ``b``'s all-reduce, or the comm hook's collective: (its future, bytes sent)."""
        if self._comm_hook is not None:
            bucket = GradBucket.of(self._layout, self._params, b)
            return run_comm_hook(
                self._comm_hook, self._comm_hook_state, bucket, count=self._watching
            )
        buffer = self.bucket_buffers[b]
        if self._mixed is not None:
            buffer = self._st.outputs[b] = self._mixed.start_reduction(buffer)
        work: Any = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        return work, tensor_bytes(buffer)

    def _end_of_backward(self) -> None:
        """Engine callback: every gradient is in. Launch what is left, wait, copy out, reset.

        A backward that gave no parameter a gradient (``torch.autograd.grad`` of the input, a
        GAN generator step through a frozen discriminator) is not a sync, as in torch: nothing
        is reduced, and the forward's own backward may still come. A backward that did reduce
        is the forward's only synchronising one: a second (``retain_graph=True``) accumulates
        locally, as torch's reducer, which expects no more hooks after it finalized."""
        with self._lock:
            synced = self._sync_this_backward and self._st.got_grad
            if synced and self._log_times:
                self._logging.record("backward_compute_end")
            if self._watching:
                self._observer.backward_end(synced=synced)
            if not synced:
                self._reset_backward_state()
                return
            try:
                self._finish_sync_backward()
            finally:
                self._unused_this_backward = []
                self._sync_this_backward = False
                self._reset_backward_state()
        if self._watching:
            self._observer.wait_end()

    def _finish_sync_backward(self) -> None:
        st = self._st
        first_static = self.static_graph and self._static_counts is None
        for i in st.order if first_static else ():
            self._mark_ready(i)  # static graph's first iteration: all at the end, first-come order
        missing = [i for i, ready in enumerate(st.ready) if not ready]
        if missing and self.static_graph and not first_static:
            names = [self._params[i][0] for i in missing]
            self._log_and_throw(RuntimeError, unfinished_error(self.rank, missing, names))
        if missing and not (self.find_unused_parameters or self.static_graph):
            # torch's timing: this step stays unreduced, the next forward raises the error
            names = [self._params[i][0] for i in missing]
            self._unfinished = unused_error(self.rank, missing, names)
            return
        # Reachable from an output the loss left out: no gradient came, as for an unused one.
        st.unused_marked = True
        for i in missing:
            self._mark_unused_ready(i)
        self._launch_ready_buckets()  # the naive variant launches everything here
        unused = None if self._searches() else self._static_global_unused
        skipped: set[int] = set()
        for b, work in enumerate(st.works):  # torch's finalize_backward: bucket by bucket
            if work is None:
                skipped.update(self._bucket_params[b])
                continue
            wait_bucket(work, self.bucket_buffers[b], b, hooked=self._comm_hook is not None)
            if unused is None and not self._used_since_sync.issuperset(self._bucket_params[b]):
                # torch's finalize_bucket_dense waits for the counts only at a parameter this
                # rank left unused: one it used is used globally, whatever the counts say.
                unused = self._wait_used_counts()
            if self._mixed is None:
                views, gone = self._grads_as_views, set() if unused is None else unused
                copy_out(self._layout, self._params, b, gone, st.no_grad, grads_as_views=views)
        if self._log_times:
            self._logging.record("comm_end")
        unused = self._wait_used_counts() if unused is None else unused
        self._used_since_sync = set()
        if first_static:
            self._static_counts = st.hits or [0] * len(self._params)
            self._static_unused, self._static_unused_set = missing, set(missing)
            self._static_global_unused = unused
        self._unused_this_iteration = list(self._unused_this_backward) + missing
        self._last_ready_order = st.ready_order
        self._buckets_reduced = len(st.works) - st.works.count(None)
        if self._mixed is not None:
            grads = self._mixed.averaged(st.outputs, self._layout, self._params, unused | skipped)
            self._mixed.to_full(grads)
        self._wait_buffer_futures()
        if self._rebuild_pending and not self._order_recorded and self._ready_order:
            self._order_recorded = True

    def _wait_used_counts(self) -> set[int]:
        """The used-counts all-reduce (launched beside the last bucket, or now), waited for:
        the parameters no rank used since the last sync."""
        n, group, used = len(self._params), self.process_group, self._used_since_sync
        self._used_counts = used_counts(used, n, self._comm_device, group, started=self._st.used)
        return unused_of(self._used_counts)


__all__ = ["DDP"]
