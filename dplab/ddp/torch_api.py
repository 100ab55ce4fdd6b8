"""The parts of torch's DistributedDataParallel API that are not the gradient mechanism.

Mixed into :class:`dplab.ddp.ddp.DDP`, so that ``ddp.py`` stays the step a learner reads: the
static helpers torch's users call on the class, comm-hook and buffer-hook registration,
``no_sync``, ``_set_static_graph``, copying and pickling, and the re-wrap guard's ``detached``.
Each follows torch 2.13's ``torch/nn/parallel/distributed.py``; where torch's method reaches
into its C++ ``Reducer``, ``ddp.reducer`` answers what dplab has of it
(:mod:`dplab.ddp.reducer_view`) and refuses the rest by name.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch import nn

from dplab.ddp.comm_hooks import check_comm_hook
from dplab.ddp.reducer_view import ReducerView
from dplab.ddp.replicas import broadcast_from
from dplab.ddp.rewrap import remove_hooks
from dplab.trace.observer import NullObserver

_NOT_PICKLED = ("process_group", "_lock", "_handles", "_st", "_comm_hook", "_comm_hook_state")


class TorchApiMixin:
    """torch's DDP methods around the mechanism (see the module docstring)."""

    # -- on the class, as torch's users call them ------------------------------------------------

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, params_and_buffers_to_ignore: list[str]
    ) -> None:
        """torch's way to keep parameters and buffers out of DDP (by fully qualified name):
        they are neither broadcast nor reduced. Call it before wrapping."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, param in module.named_parameters():
            if name in params_and_buffers_to_ignore:
                param._ddp_ignored = True
        for name, buffer in module.named_buffers():
            if name in params_and_buffers_to_ignore:
                buffer._ddp_ignored = True

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Iterator:
        """The parameters DDP manages (those not ignored), as torch lists them."""
        for param in module.named_parameters() if named_params else module.parameters():
            if not hasattr(param, "_ddp_ignored"):
                yield param

    @property
    def reducer(self) -> ReducerView:
        """What torch's tests read from its C++ Reducer (:mod:`dplab.ddp.reducer_view`)."""
        return ReducerView(self)

    def _build_params_for_reducer(self) -> tuple[list[nn.Parameter], list[bool]]:
        """The parameters DDP reduces, in index order, and whether each expects a sparse
        gradient: what torch hands its reducer, and what dplab.DDP reduces."""
        params = [p for _, p in self._params]
        return params, [i in self._sparse for i in range(len(params))]

    def _build_debug_param_to_name_mapping(self, parameters: list[Any]) -> dict[int, str]:
        """Index in ``parameters`` → the name torch reports for it (``"{module}.{param}"``, as
        torch spells it: a root module's own parameter is ``".name"``). Every parameter DDP
        reduces must be in ``parameters`` and nothing else, else ``ValueError`` (torch's)."""
        index = {id(p): i for i, p in enumerate(parameters)}
        names: dict[int, str] = {}
        for prefix, sub in self.module.named_modules():
            for name, param in sub.named_parameters(recurse=False):
                fqn = f"{prefix}.{name}"
                if not param.requires_grad or fqn in self._ignored:
                    continue
                if id(param) not in index:
                    self._log_and_throw(
                        ValueError,
                        f"Param with name {fqn} found in module parameters, but not DDP "
                        "parameters. This indicates a bug in DDP, please report an issue to "
                        "PyTorch.",
                    )
                names[index[id(param)]] = fqn
        if len(names) != len({id(p) for p in parameters}):
            self._log_and_throw(
                ValueError,
                "Expected param to name mapping to cover all parameters, but got conflicting "
                f"lengths: {len({id(p) for p in parameters})} vs {len(names)}. This indicates "
                "a bug in DDP, please report an issue to PyTorch.",
            )
        return names

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """torch's switch for cloning the forward's outputs in its ``_DDPSink`` autograd
        function. dplab.DDP has no sink and never clones an output (what ``False`` asks for;
        torch's ``test_ddp_sink_noclone`` checks no ``aten::clone`` runs), so the value is
        only kept."""
        self._ddp_sink_clone = bool(val)

    def _default_broadcast_coalesced(
        self, bufs: Any = None, bucket_size: Any = None, authoritative_rank: int = 0
    ) -> None:
        """torch's buffer broadcast (what a buffer hook may call): ``bufs`` (default: the
        module's buffers) from group rank ``authoritative_rank``."""
        tensors = self._current_buffers() if bufs is None else list(bufs)
        if self.world_size > 1:
            src = dist.get_global_rank(self.process_group, authoritative_rank)
            broadcast_from(tensors, src, self.process_group)

    # -- hooks ------------------------------------------------------------------------------------

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch's contract: ``hook(state, bucket) -> torch.futures.Future`` replaces each
        bucket's all-reduce; the Future's value (a tensor, or a list of one) is the reduced
        bucket. Buckets are not divided by the world size first: the hook does that."""
        try:
            check_comm_hook(hook)
            if self._comm_hook is not None or self._mixed is not None:  # mixed: torch's own hook
                raise RuntimeError(
                    "register_comm_hook or register_builtin_comm_hook can only be called once."
                )
        except (TypeError, ValueError, RuntimeError) as e:
            self._logging.error(f"{type(e)}: {e}")
            raise
        self._logging.data["comm_hook"] = getattr(hook, "__qualname__", repr(hook))
        self._comm_hook, self._comm_hook_state = hook, state

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's C++ hooks by name (``dist.BuiltinCommHookType``): ALLREDUCE and
        FP16_COMPRESS run as torch's Python hooks of the same arithmetic."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        self.register_comm_hook(self.process_group, hooks[comm_hook_type])
        self._logging.data["comm_hook"] = str(comm_hook_type)

    def _register_buffer_comm_hook(
        self, state: object, hook: Callable[..., Any], comm_hook_location: Any = None
    ) -> None:
        """torch's buffer hook: ``hook(state, {name: buffer})`` syncs the buffers in place of
        the broadcast from rank 0, before or after the forward (``comm_hook_location``, torch's
        ``_BufferCommHookLocation``; default after). A hook may return futures: they are
        awaited at the end of the backward, as torch does."""
        from torch.nn.parallel.distributed import _BufferCommHookLocation

        if not callable(hook):
            raise AssertionError(f"hook must be callable, got {type(hook).__name__}")
        where = _BufferCommHookLocation.POST_FORWARD
        self._buffer_hook = (
            hook,
            state,
            where if comm_hook_location is None else comm_hook_location,
        )

    # -- no_sync, static graph ------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes of forwards run in here communicate
        nothing. The next synchronising backward all-reduces the sum, once per bucket."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _set_static_graph(self) -> None:
        """torch's way in to ``static_graph=True`` after construction, before the first step."""
        if self.static_graph:
            warnings.warn(
                "You've set static_graph to be True, no need to set it again.", stacklevel=2
            )
            return
        if self._logging.iterations > 0:
            self._log_and_throw(
                RuntimeError,
                "set_static_graph() should be called before training loop starts and after "
                "DistributedDataParallel is constructed.",
            )
        self.static_graph = True
        self._logging.data["static_graph"] = 1
        self._rebuild_pending = not self.static_buckets  # torch rebuilds under static graph
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, "
                "`_set_static_graph` will detect unused parameters automatically, so you do not "
                "need to set find_unused_parameters=true, just be sure these unused parameters "
                "will not change during training loop while calling `_set_static_graph`.",
                stacklevel=2,
            )

    # -- the re-wrap guard ------------------------------------------------------------------------

    @property
    def detached(self) -> bool:
        """Whether a newer wrapper of the same module took over (this one's hooks are gone)."""
        return self._detached is not None

    def _detach(self, why: str) -> None:
        """Remove this wrapper's hooks; using it afterwards is an error that says ``why``."""
        remove_hooks(self._handles)
        self._detached = why

    def _remove_autograd_hooks(self) -> None:
        """torch's name for taking the gradient hooks off (the wrapper stops reducing)."""
        self._detach("its autograd hooks were removed (_remove_autograd_hooks)")

    # -- copy, pickle, torch.save (torch's __getstate__/__setstate__) -----------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What a copy keeps: the module, the arguments, the buckets' plan. Like torch, a wrapper
        over the default group only; the group, the hooks, a registered comm hook and the tracer
        are not copied (the copy gets its own hooks, and records nothing)."""
        if not self._by_default_group:
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default "
                "process group. That is, when you have called init_process_group and have not "
                "passed process_group argument to DDP constructor"
            )
        state = {k: v for k, v in self.__dict__.items() if k not in _NOT_PICKLED}
        state.update(tracer=None, _watching=False, _observer=NullObserver())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild on the default group: fresh bucket buffers, hooks on the copy's parameters."""
        nn.Module.__setstate__(self, state)
        self.process_group = dist.group.WORLD
        self._join_group()
        self._comm_hook, self._comm_hook_state = None, None
        self._build_buckets(self._bucket_params)
        self._start_hooks()
        self._sync_this_backward = False  # the copy's first backward follows no forward of it

    # -- teaching aids ---------------------------------------------------------------------------

    def bucket_of(self, name: str) -> int:
        """The bucket index that holds parameter ``name``."""
        for i, (n, _) in enumerate(self._params):
            if n == name:
                return self._bucket_of[i]
        raise KeyError(f"no trainable parameter named {name!r}")
