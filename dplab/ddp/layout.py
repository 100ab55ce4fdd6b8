"""Buckets as memory: one flat buffer per bucket, and each parameter's view of its slot in it.

:mod:`dplab.ddp.buckets` decides *which* gradients share an all-reduce (a plan: lists of parameter
indices, in buffer order). This module gives a plan its memory, as torch's reducer does: a flat
buffer per bucket (one dtype and device each), and for every parameter a view of its slot, shaped
like the parameter. Gradients go into the views times 1/N (:func:`fill`), the buffer is
all-reduced as one tensor, and the averages are copied back out of the views (:func:`copy_out`).

A sparse gradient (``nn.Embedding(sparse=True)``) cannot be flattened with others: its bucket
holds it alone, and *is* the gradient (torch's ``mark_variable_ready_sparse``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dplab.ddp.buckets import assign_buckets, bucket_plan, rebuilt_buckets, torch_initial_buckets
from dplab.trace.bucket import Bucket

Named = list[tuple[str, nn.Parameter]]


class Layout(NamedTuple):
    """A plan with its memory. Lists indexed by bucket, or by parameter (registration order)."""

    members: list[list[int]]  # per bucket: its parameters' indices, in buffer order
    bucket_of: list[int]  # per parameter: its bucket
    offsets: list[list[int]]  # per bucket: each member's first element in the buffer
    buffers: list[torch.Tensor]  # per bucket: the flat buffer that is all-reduced
    views: list[torch.Tensor]  # per parameter: its slot, shaped like it
    view_ptrs: list[int]  # per parameter: its slot's address (is .grad the slot itself?)
    buckets: list[Bucket]  # per bucket: the public record (names, bytes, dtype)
    member_params: list[list[torch.Tensor]]  # per bucket: its parameters, in buffer order
    member_views: list[list[torch.Tensor]]  # per bucket: their slots, in the same order
    sparse: frozenset[int]  # parameters whose gradients are sparse (each alone in its bucket)


def sizes_and_keys(params: Named) -> tuple[list[int], list[tuple[torch.dtype, torch.device]]]:
    """Each parameter's bytes and (dtype, device): what the bucket rules cut by."""
    return (
        [p.numel() * p.element_size() for _, p in params],
        [(p.dtype, p.device) for _, p in params],
    )


def static_plan(
    params: Named,
    order: list[int],
    *,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    sparse: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """The textbook cut: buckets filled over ``order`` with caps ``[first, cap]``."""
    nbytes, keys = sizes_and_keys(params)
    rows = [(params[i][0], 0, nbytes[i], keys[i]) for i in order]
    plan = bucket_plan(
        rows,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        alone=[i in sparse for i in order],
    )
    return [[order[j] for j in bucket] for bucket in plan]


def torch_plan(
    params: Named,
    order: list[int] | None,
    *,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    find_unused: bool,
    sparse: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """torch's buckets: at construction (``order`` None), or rebuilt over ``order``."""
    nbytes, keys = sizes_and_keys(params)
    caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": first_bucket_cap_mb}
    alone = [i in sparse for i in range(len(params))]
    if order is None:
        return torch_initial_buckets(
            nbytes, keys, find_unused_parameters=find_unused, alone=alone, **caps
        )
    return rebuilt_buckets(order, nbytes, keys, alone=alone, **caps)


def per_bucket_plan(
    params: Named, caps: list[int], sparse: frozenset[int] = frozenset()
) -> list[list[int]]:
    """torch's buckets under ``bucket_cap_mb_list``: registration order cut with ``caps``
    (bytes; one per bucket, the last repeated), then reversed."""
    nbytes, keys = sizes_and_keys(params)
    alone = [i in sparse for i in range(len(params))]
    return list(reversed(assign_buckets(nbytes, keys, caps, alone=alone)))


def lay_out(
    params: Named,
    plan: list[list[int]],
    *,
    grads_as_views: bool,
    sparse: frozenset[int] = frozenset(),
    dtype: torch.dtype | None = None,
) -> Layout:
    """Give each bucket of ``plan`` a flat buffer and each parameter a view of its slot.

    With ``grads_as_views`` (torch's ``gradient_as_bucket_view``) an existing ``.grad`` is
    copied into its new slot and replaced by it, so gradients survive a rebuild, as in torch.
    A sparse parameter's bucket starts as an empty sparse tensor: :func:`fill` puts its
    gradient there. ``dtype``: the buckets' dtype when it is not the parameters' (mixed
    precision's ``param_dtype``)."""
    n = len(params)
    bucket_of, views = [0] * n, [torch.empty(0)] * n
    all_offsets: list[list[int]] = []
    buffers: list[torch.Tensor] = []
    buckets: list[Bucket] = []
    for b, members in enumerate(plan):
        first = params[members[0]][1]
        numel = sum(params[i][1].numel() for i in members)
        if members[0] in sparse:
            buffer = torch.sparse_coo_tensor(
                size=first.shape, dtype=first.dtype, device=first.device, check_invariants=False
            )
        else:
            buffer = torch.zeros(numel, dtype=dtype or first.dtype, device=first.device)
        offset, offsets = 0, []
        for i in members:
            if i in sparse:
                bucket_of[i], views[i] = b, buffer
                offsets.append(0)
                continue
            p = params[i][1]
            view = buffer[offset : offset + p.numel()].view_as(p)
            offsets.append(offset)
            offset += p.numel()
            bucket_of[i], views[i] = b, view
            if grads_as_views and p.grad is not None:
                view.copy_(p.grad)
                p.grad = view
        all_offsets.append(offsets)
        buffers.append(buffer)
        buckets.append(
            Bucket(
                index=b,
                param_names=tuple(params[i][0] for i in members),
                numel=numel,
                nbytes=numel * buffer.element_size(),
                dtype=first.dtype,
                device=first.device,
            )
        )
    ptrs = [0 if i in sparse else view.data_ptr() for i, view in enumerate(views)]
    member_params = [[params[i][1] for i in members] for members in plan]
    member_views = [[views[i] for i in members] for members in plan]
    return Layout(
        plan,
        bucket_of,
        all_offsets,
        buffers,
        views,
        ptrs,
        buckets,
        member_params,
        member_views,
        frozenset(sparse),
    )


def fill(
    layout: Layout,
    params: Named,
    b: int,
    *,
    grads_as_views: bool,
    world_size: int,
) -> None:
    """torch's mark_variable_ready_dense, for a whole bucket when its last gradient is in: its
    gradients into their slots, times 1/N (``world_size`` 1: as they are, when a comm hook owns
    the reduction).

    torch copies each gradient as its hook runs, in C++; dplab waits for the bucket's last one
    and copies them all at once, so that many small gradients take one ``_foreach_copy_`` and
    one multiply of the bucket instead of a call each (:func:`per_gradient` decides). torch
    scales while it copies (``at::mul_out(slot, grad, 1/N)``: one pass over memory), and a
    ``.grad`` that already is its slot (``gradient_as_bucket_view``) is divided in place, the
    whole bucket in one call when every one is; the bits are the same either way. With
    ``grads_as_views`` the others become views of their slots from then on. A parameter with no
    ``.grad`` (unused) contributes zeros."""
    if layout.members[b][0] in layout.sparse:
        _fill_sparse(layout, params, b, world_size)
        return
    if not grads_as_views:  # every .grad its own tensor
        grads = [p.grad for p in layout.member_params[b]]
        try:
            same_dtype = {g.dtype for g in grads} == {layout.buffers[b].dtype}
        except AttributeError:  # a None .grad: the loop below zeroes its slot
            same_dtype = False
        if same_dtype:
            _copy_scaled(layout.member_views[b], grads, layout.buffers[b], world_size)
            return
    dst, src, in_place = [], [], []
    for i in layout.members[b]:
        grad, view = params[i][1].grad, layout.views[i]
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == layout.view_ptrs[i]:
            in_place.append(view)
        elif grad.dtype != view.dtype or grad.device != view.device:
            raise RuntimeError(
                f"parameter {params[i][0]!r} has a {grad.dtype} gradient on {grad.device} but "
                f"its bucket holds {view.dtype} on {view.device}: the module was converted after "
                "it was wrapped (.double(), .half(), .to()). Convert the module first, then wrap "
                "it (torch's DDP would leave that gradient unreduced, silently)."
            )
        else:
            dst.append(view)
            src.append(grad)
    if in_place and world_size != 1:  # torch's bucket_view.div_(N), for each such slot
        if len(in_place) == len(layout.members[b]):
            layout.buffers[b].div_(world_size)  # every slot: the whole bucket in one call
        else:
            for view in in_place:
                view.div_(world_size)
    if dst:
        _copy_scaled(dst, src, None, world_size)
        if grads_as_views:
            for i in layout.members[b]:
                if params[i][1].grad is not None:
                    params[i][1].grad = layout.views[i]


SMALL_GRADIENT = 32768  # elements a gradient, on average: see per_gradient


def per_gradient(dst: list[torch.Tensor]) -> bool:
    """Fill these slots with one ``mul`` per gradient (one pass over memory, a call each), or
    with one ``_foreach_copy_`` and one multiply (two passes, two calls)? A call costs about
    2 µs here and a second pass 8-36 µs a MiB (more when the bucket is too large to stay in
    cache), so a call per gradient pays from 16,384-49,152 elements a gradient on average; the
    rule is the middle of that (``benchmarks/fill_paths.py``, docs/benchmarks.md)."""
    return sum(t.numel() for t in dst) >= SMALL_GRADIENT * len(dst)


def _copy_scaled(
    dst: list[torch.Tensor], src: list[torch.Tensor], buffer: torch.Tensor | None, n: int
) -> None:
    """``dst[k] = src[k] * (1/n)``: per gradient in one pass (``mul`` with ``out=``, torch's
    ``mul_out``), or, for many small ones, one ``_foreach_copy_`` and one multiply of ``buffer``
    (the whole bucket) or of each slot. The product is the same float either way."""
    if n == 1:
        torch._foreach_copy_(dst, src)
        return
    factor = 1.0 / n
    if per_gradient(dst):
        for view, grad in zip(dst, src, strict=True):
            torch.mul(grad, factor, out=view)
        return
    torch._foreach_copy_(dst, src)
    if buffer is not None:
        buffer.mul_(factor)
    else:
        torch._foreach_mul_(dst, factor)


def _fill_sparse(layout: Layout, params: Named, b: int, world_size: int) -> None:
    """torch's mark_variable_ready_sparse: the bucket *is* the gradient, divided in place."""
    (i,) = layout.members[b]
    name, param = params[i]
    grad = param.grad
    if grad is None:
        raise RuntimeError(f"Expected sparse gradient to be defined (parameter {name!r}).")
    if not grad.is_sparse:
        raise RuntimeError(f"Expected variable to have sparse gradient (parameter {name!r}).")
    if world_size != 1:
        grad.div_(world_size)
    layout.buffers[b] = grad
    layout.views[i] = grad


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes an all-reduce of ``t`` carries: a sparse tensor sends its values and indices."""
    if t.is_sparse:
        values, indices = t._values(), t._indices()
        return values.numel() * values.element_size() + indices.numel() * indices.element_size()
    return t.numel() * t.element_size()


def copy_out(
    layout: Layout,
    params: Named,
    b: int,
    unused: set[int],
    no_grad: set[int],
    *,
    grads_as_views: bool,
) -> None:
    """torch's finalize_bucket_dense: bucket ``b``'s averages back into ``.grad`` (a copy, or
    the view itself). Called as each bucket's all-reduce is waited for, as torch's
    finalize_backward does, so the first buckets' copies overlap the last one's all-reduce.

    A parameter no rank used keeps its ``.grad`` untouched (None stays None, as in torch, so
    optimizers skip it); one only other ranks used gets their average. ``no_grad``: those that
    had no ``.grad`` when their bucket was filled."""
    members = layout.members[b]
    if members[0] in layout.sparse:  # reduced in place: the .grad already holds the average
        return
    if grads_as_views:
        # Every gradient that came in already is its view (fill made it so); only those that
        # had none need pointing at theirs.
        for i in members:
            if i in no_grad and i not in unused:
                params[i][1].grad = layout.views[i]
        return
    if not unused:
        try:  # the common case, one call: every parameter has a .grad to copy into
            torch._foreach_copy_([p.grad for p in layout.member_params[b]], layout.member_views[b])
            return
        except TypeError:  # a None .grad: the loop below gives it a tensor of its own
            pass
    dst, src = [], []
    for i in members:
        if i in unused:
            continue
        p, view = params[i][1], layout.views[i]
        if p.grad is None:
            p.grad = torch.empty_like(p).copy_(view)
        else:
            dst.append(p.grad)
            src.append(view)
    if dst:
        torch._foreach_copy_(dst, src)
