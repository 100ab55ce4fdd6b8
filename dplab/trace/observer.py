"""The seam between a DDP and whoever watches it: the moments of a step, as public calls.

dplab.DDP calls these at the moments the lesson talks about (a gradient is ready, a bucket is
full, its all-reduce starts, backward ends, the wait ends). :class:`dplab.Tracer` turns them into a
timeline; the simulator's profile measurement uses them to learn when each gradient is ready; the
default is :class:`NullObserver`, which does nothing, so an untraced DDP pays one empty method
call per gradient and nothing else.
"""

from __future__ import annotations

from typing import Any, Protocol


class StepObserver(Protocol):
    """What a DDP tells its observer. Every method is called on the rank's main thread."""

    def attach(self, ddp: Any) -> None:
        """The DDP was built (its buckets exist); called once, collectively on every rank."""

    def buckets_changed(self, ddp: Any) -> None:
        """The DDP cut new buckets (the rebuild after the first iteration)."""

    def forward_start(self) -> None:
        """A grad-enabled forward begins."""

    def forward_end(self, output: Any) -> None:
        """That forward returned ``output``."""

    def grad_ready(self, index: int) -> None:
        """The gradient of trainable parameter ``index`` (registration order) was accumulated."""

    def bucket_ready(self, bucket: int) -> None:
        """Bucket ``bucket``'s last gradient is in."""

    def allreduce_start(self, bucket: int) -> None:
        """Bucket ``bucket``'s collective is about to be launched."""

    def allreduce_launched(self, bucket: int, work: Any, nbytes: int) -> None:
        """It was launched: ``work`` completes when it is done; ``nbytes`` were sent."""

    def allreduce_failed(self, bucket: int) -> None:
        """Its launch raised (a comm hook's error, say): no ``allreduce_launched`` follows."""

    def backward_end(self, *, synced: bool) -> None:
        """The autograd engine's final callback runs; ``synced`` unless under ``no_sync``."""

    def wait_end(self) -> None:
        """Every bucket's collective has finished; the gradients are averaged."""


class NullObserver:
    """Watches nothing: the default observer of an untraced DDP."""

    def attach(self, ddp: Any) -> None:
        pass

    def buckets_changed(self, ddp: Any) -> None:
        pass

    def forward_start(self) -> None:
        pass

    def forward_end(self, output: Any) -> None:
        pass

    def grad_ready(self, index: int) -> None:
        pass

    def bucket_ready(self, bucket: int) -> None:
        pass

    def allreduce_start(self, bucket: int) -> None:
        pass

    def allreduce_launched(self, bucket: int, work: Any, nbytes: int) -> None:
        pass

    def allreduce_failed(self, bucket: int) -> None:
        pass

    def backward_end(self, *, synced: bool) -> None:
        pass

    def wait_end(self) -> None:
        pass
