"""The DDP a learner reads: data parallelism's whole mechanism, in one class.

Every rank holds a full replica of the model and runs its own slice of the global batch. After
``loss.backward()`` every rank's ``.grad`` must hold the *average* gradient over all ranks, so that
every replica takes the same optimizer step and the replicas stay equal. This class does it as
torch's DistributedDataParallel does, and nothing else:

1. **Buckets.** One all-reduce per gradient pays a collective's latency hundreds of times; one
   all-reduce for the whole model cannot start before backward ends. So gradients share
   buckets of about ``bucket_cap_mb`` MiB, cut over the parameters in *reverse* registration
   order (backward produces the last layer's gradients first), the first bucket smaller
   (``first_bucket_cap_mb``, default ``min(cap, 1 MiB)``) so that communication starts early.
   Each bucket owns one flat buffer: one all-reduce per bucket.
2. **Hooks.** Each parameter carries a post-accumulate-grad hook: once autograd has written its
   ``.grad``, the hook copies it into the parameter's slot in its bucket's buffer.
3. **Launch in bucket order.** When a bucket's last gradient is in, the bucket is scaled by 1/N
   and its all-reduce launched asynchronously, while autograd goes on with earlier layers: that
   is the overlap. Buckets go strictly in index order: gloo and NCCL match collectives by their
   position in each rank's sequence, so every rank must issue the same ones in the same order.
4. **The end-of-backward wait.** The first hook of a backward queues a callback with the autograd
   engine; it runs when backward is done, waits for every all-reduce and copies the averages
   back into ``.grad``. When ``loss.backward()`` returns, the gradients are averaged.
5. **no_sync.** Backward passes of forwards run inside :meth:`TextbookDDP.no_sync` send nothing:
   ``.grad`` accumulates locally, and the next synchronising backward all-reduces the sum.

It tells a :class:`~dplab.trace.observer.StepObserver` (a :class:`dplab.Tracer`) the same moments
in the same order as ``dplab.DDP(static_buckets=True)``, and leaves the same ``.grad``, bit for
bit: ``tests/test_textbook_ddp.py`` pins both, and through dplab.DDP, torch's own DDP.

What it leaves out, and where :class:`dplab.DDP` does it (``dplab/ddp/``):

- torch's buckets: one per dtype in iteration 0, rebuilt once in the order rank 0's gradients
  arrived (``buckets.py``: ``torch_initial_buckets``, ``rebuilt_buckets``; ``ddp.py``).
- ``find_unused_parameters``: parameters a step does not reach (``backward_state.py``: unreachable,
  globally_unused). Here a parameter without a gradient is an error.
- ``gradient_as_bucket_view``: ``.grad`` *is* its bucket slot, no copy (``layout.py``).
- comm hooks (``comm_hooks.py``, ``DDP.register_comm_hook``): another collective in place of the
  all-reduce.
- buffers (BatchNorm statistics) broadcast from rank 0 before forwards, and the check that every
  rank holds the same parameters (``replicas.py``).
- the re-wrap guard: a module wrapped twice detaches its first wrapper instead of carrying two
  sets of hooks (``rewrap.py``).
- reentrant checkpointing, recovery after a backward that raised, and torch's other arguments
  (``ddp.py``, ``arguments.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab.ddp.buckets import DEFAULT_BUCKET_CAP_MB, bucket_plan, check_cap_mb, first_bucket_cap
from dplab.trace.bucket import Bucket
from dplab.trace.observer import NullObserver, StepObserver


class TextbookDDP(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves gradients averaged over all ranks.

    Args:
        module: the replica; rank 0's parameters are copied to every rank here.
        bucket_cap_mb: the bucket cap in MiB (torch's default, 25).
        first_bucket_cap_mb: the first bucket's cap (default ``min(bucket_cap_mb, 1)``).
        process_group: the ranks to average over (default: all of them).
        tracer: a :class:`dplab.Tracer` (any ``StepObserver``) that records every step.
    """

    detached = False  # a Tracer asks; only dplab.DDP's re-wrap guard ever detaches a wrapper

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bucket_cap_mb: float | None = None,
        process_group: Any = None,
        tracer: StepObserver | None = None,
    ):
        super().__init__()
        self.bucket_cap_mb = check_cap_mb("bucket_cap_mb", bucket_cap_mb)
        self.first_bucket_cap_mb = first_bucket_cap(self.bucket_cap_mb, first_bucket_cap_mb)
        if not dist.is_initialized():
            raise RuntimeError("TextbookDDP needs torch.distributed: run it inside dplab.launch")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        # Frozen parameters get no gradient, so they get no bucket slot either.
        self._params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self._params:
            raise ValueError(f"{type(module).__name__} has no trainable parameter to average")

        # The replicas must start equal, or equal gradient steps keep them apart forever.
        rank0 = dist.get_global_rank(self.process_group, 0)
        for p in module.parameters():
            dist.broadcast(p.detach(), src=rank0, group=self.process_group)

        self._build_buckets()
        self.require_backward_grad_sync = True  # no_sync() turns it off; forward reads it
        self._sync = True  # whether the coming backward all-reduces (decided at its forward)
        self._reset()
        for i, (_, p) in enumerate(self._params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))

        self.tracer = tracer
        self._observer: StepObserver = tracer if tracer is not None else NullObserver()
        self._observer.attach(self)

    def _build_buckets(self) -> None:
        """Cut buckets over reverse registration order; give each a flat buffer, each parameter
        a view of its slot in that buffer (gradients are copied there, no new memory per step)."""
        order = list(reversed(range(len(self._params))))  # roughly the order gradients arrive
        # (name, numel, bytes, key): a bucket holds gradients of one dtype on one device.
        rows = [(n, p.numel(), p.numel() * p.element_size(), (p.dtype, p.device))
                for n, p in (self._params[i] for i in order)]  # fmt: skip
        plan = bucket_plan(
            rows, bucket_cap_mb=self.bucket_cap_mb, first_bucket_cap_mb=self.first_bucket_cap_mb
        )
        self.buckets: list[Bucket] = []
        self.bucket_buffers: list[torch.Tensor] = []
        self._members: list[list[int]] = []  # bucket -> its parameters' indices, in buffer order
        self._bucket_of: dict[int, int] = {}  # parameter index -> its bucket
        self._slot: dict[int, torch.Tensor] = {}  # parameter index -> its view of the buffer
        for b, rows_in_bucket in enumerate(plan):
            members = [order[j] for j in rows_in_bucket]
            params = [self._params[i][1] for i in members]
            numel = sum(p.numel() for p in params)
            buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
            offset = 0
            for i, p in zip(members, params, strict=True):
                self._bucket_of[i] = b
                self._slot[i] = buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self._members.append(members)
            self.bucket_buffers.append(buffer)
            names = tuple(self._params[i][0] for i in members)
            nbytes = numel * buffer.element_size()
            self.buckets.append(Bucket(b, names, nbytes, numel, buffer.dtype, buffer.device))

    def _reset(self) -> None:
        """Forget the last backward: every bucket waits for all its gradients again."""
        self._pending = [len(members) for members in self._members]  # gradients still to come
        self._ready: set[int] = set()
        self._next_bucket = 0  # the next bucket to launch: they go strictly in order
        self._works: list[Any] = []  # the launched all-reduces, to wait for at the end
        self._queued = False  # is the end-of-backward callback queued?

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # no backward will follow: nothing to average
            return self.module(*args, **kwargs)
        self._sync = self.require_backward_grad_sync
        self._reset()  # a clean slate, even if the last backward raised halfway
        self._observer.forward_start()
        out = self.module(*args, **kwargs)
        self._observer.forward_end(out)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes of forwards run in here send nothing."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        """Parameter ``i``'s ``.grad`` was just accumulated (autograd calls this, mid-backward)."""
        if not self._queued:  # the first gradient of this backward: get called at its end
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if not self._sync:  # under no_sync: .grad keeps the local sum, nothing is sent
            self._observer.grad_ready(i)
            return
        if i in self._ready:  # its bucket would then launch one gradient short
            raise RuntimeError(
                f"parameter {self._params[i][0]!r} got its gradient twice in one backward "
                "(a reentrant checkpoint? dplab.DDP handles those)"
            )
        self._ready.add(i)
        self._slot[i].copy_(param.grad)
        self._observer.grad_ready(i)
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] > 0:
            return
        self._observer.bucket_ready(b)
        # Launch every full bucket from the next in line, and stop at the first that is not full:
        # a later bucket that filled early waits for the earlier ones (step 3 of the module doc).
        while self._next_bucket < len(self._pending) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, b: int) -> None:
        """Bucket ``b``'s asynchronous all-reduce. All-reduce sums; scaling each rank's share by
        1/N first makes the sum the average (and keeps it in range, in half precision)."""
        buffer = self.bucket_buffers[b]
        buffer.mul_(1.0 / self.world_size)
        self._observer.allreduce_start(b)
        try:
            work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        except BaseException:
            self._observer.allreduce_failed(b)  # no collective to wait for: the tracer moves on
            raise
        self._works.append(work)
        self._observer.allreduce_launched(b, work, buffer.numel() * buffer.element_size())

    def _end_of_backward(self) -> None:
        """Autograd's final callback: every gradient is in. Wait for the all-reduces, copy the
        averages back into ``.grad``."""
        self._observer.backward_end(synced=self._sync)
        try:
            if not self._sync:
                return
            missing = [name for i, (name, _) in enumerate(self._params) if i not in self._ready]
            if missing:  # their buckets never launched: the other ranks would wait for them
                raise RuntimeError(
                    f"TextbookDDP: these parameters got no gradient in this backward: {missing}. "
                    "Every bucket must be all-reduced on every rank; for a model that skips "
                    "parameters use dplab.DDP(find_unused_parameters=True)."
                )
            for work in self._works:  # in launch order, which is bucket order
                work.wait()
            for i, (_, p) in enumerate(self._params):
                p.grad.copy_(self._slot[i])
        finally:
            self._reset()
        self._observer.wait_end()


__all__ = ["TextbookDDP"]
