"""torch's DDP communication-hook contract, for dplab.DDP: a GradBucket and its rules.

A comm hook replaces the all-reduce of a bucket: ``hook(state, bucket) -> Future`` whose value is
the reduced flat tensor (or a list holding exactly one). torch's shipped hooks
(``torch.distributed.algorithms.ddp_comm_hooks``: ``allreduce_hook``, ``fp16_compress_hook``,
``bf16_compress_hook``, PowerSGD) call only the methods of :class:`GradBucket` below, so they run
unchanged on dplab.DDP. As in torch's reducer, a bucket with a hook is *not* divided by the world
size before the hook: the hook owns the whole reduction.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist


class GradBucket:
    """What a comm hook sees of one bucket (the methods of torch's ``dist.GradBucket``)."""

    def __init__(
        self,
        index: int,
        bucket_count: int,
        buffer: torch.Tensor,
        offsets: list[int],
        shapes: list[torch.Size],
        parameters: list[torch.Tensor],
    ):
        self._index = index
        self._count = bucket_count
        self._buffer = buffer
        self._offsets = offsets
        self._shapes = shapes
        self._parameters = parameters

    @classmethod
    def of(cls, layout: Any, params: list[tuple[str, torch.Tensor]], b: int) -> GradBucket:
        """Bucket ``b`` of a :class:`~dplab.ddp.layout.Layout` over ``params``."""
        members = layout.members[b]
        return cls(
            b,
            len(layout.buffers),
            layout.buffers[b],
            layout.offsets[b],
            [params[i][1].shape for i in members],
            [params[i][1] for i in members],
        )

    def index(self) -> int:
        """The bucket's index: buckets are reduced in index order, the same on every rank."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flattened gradients of the bucket (``set_buffer`` may have replaced it)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view of :meth:`buffer` per parameter, shaped like it."""
        return [
            self._buffer[offset : offset + shape.numel()].view(shape)
            for offset, shape in zip(self._offsets, self._shapes, strict=True)
        ]

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in the order of :meth:`gradients`."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """The last bucket of the iteration (PowerSGD counts iterations on it)."""
        return self._index == self._count - 1

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace what :meth:`buffer` returns for the rest of this hook call (as torch)."""
        self._buffer = buffer


def check_comm_hook(hook: Any) -> None:
    """torch's checks on a hook: callable, ``(state, bucket)``, Future-returning if annotated."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable, got {hook!r}")
    params = inspect.signature(hook).parameters
    try:
        inspect.signature(hook).bind(None, None)
    except TypeError:
        raise TypeError(
            f"a comm hook takes (state, bucket); {getattr(hook, '__name__', hook)!r} takes "
            f"{list(params)}"
        ) from None
    bucket = params.get("bucket")
    if bucket is not None and bucket.annotation not in (
        inspect.Parameter.empty,
        dist.GradBucket,
        GradBucket,
        "dist.GradBucket",
        "GradBucket",
    ):
        raise ValueError(
            "Communication hook: bucket annotation should be dist.GradBucket, got "
            f"{bucket.annotation!r}"
        )
    returns = inspect.signature(hook).return_annotation
    if returns not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        raise ValueError(
            "Communication hook: return annotation should be "
            f"torch.futures.Future[torch.Tensor], got {returns!r}"
        )


def run_comm_hook(
    hook: Callable, state: Any, bucket: GradBucket, *, count: bool = True
) -> tuple[Any, int]:
    """Call ``hook`` on ``bucket`` in place of its all-reduce: (its Future, the bytes its
    collectives carried; 0 unless ``count``: counting patches torch.distributed for the call,
    which only a tracer needs)."""
    sent = [0]
    with count_sent_bytes() if count else contextlib.nullcontext(sent) as sent:
        future = hook(state, bucket)
    if not isinstance(future, torch._C.Future):
        raise RuntimeError(  # torch's PythonCommHook::parseHookResult: a RuntimeError
            f"comm hook {getattr(hook, '__name__', hook)!r} returned {type(future).__name__} "
            f"for bucket {bucket.index()}; it must return a torch.futures.Future"
        )
    return future, sent[0]


def hook_result(value: Any, bucket: int) -> torch.Tensor:
    """A hook's Future value is a tensor or a list of exactly one (torch's parseHookResult)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list | tuple) and len(value) == 1 and isinstance(value[0], torch.Tensor):
        return value[0]
    raise RuntimeError(
        f"comm hook's Future for bucket {bucket} must hold a tensor or a list of exactly one "
        f"tensor, got {type(value).__name__}"
    )


def wait_bucket(work: Any, buffer: torch.Tensor, b: int, *, hooked: bool) -> None:
    """Wait for bucket ``b``'s all-reduce, or its comm hook's Future, whose result is copied
    into ``buffer`` unless the hook reduced in place."""
    if not hooked:
        work.wait()
        return
    result = hook_result(work.wait(), b)
    if result is not buffer:
        buffer.copy_(result if buffer.is_sparse else result.view(-1))


# -- the bytes a hook really sends ------------------------------------------------------------

_COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
)
_counter = threading.local()
_patch_lock = threading.Lock()


def _tensor_bytes(args: tuple, kwargs: dict) -> int:
    first = args[0] if args else next(iter(kwargs.values()), None)
    tensors = first if isinstance(first, list | tuple) else [first]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _counting(name: str, original: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        box = getattr(_counter, "box", None)
        if box is not None:
            box[0] += _tensor_bytes(args, kwargs)
        return original(*args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper._dplab_counting = True  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def count_sent_bytes() -> Iterator[list[int]]:
    """Count the tensor bytes that torch.distributed collectives launched in this block carry.

    The hook's synchronous part launches its collectives here (torch's default, fp16, bf16
    hooks: all of them). A collective a hook launches later, from a Future callback on another
    thread (PowerSGD's second all-reduce), is not in this count.
    """
    box = [0]
    with _patch_lock:
        saved = {}
        for name in _COUNTED:
            fn = getattr(dist, name, None)
            if fn is not None and not getattr(fn, "_dplab_counting", False):
                saved[name] = fn
                setattr(dist, name, _counting(name, fn))
    _counter.box = box
    try:
        yield box
    finally:
        _counter.box = None
        with _patch_lock:
            for name, fn in saved.items():
                setattr(dist, name, fn)
