"""Buckets as memory: one flat buffer per bucket, and each parameter's view of its slot in it.

:mod:`dplab.ddp.buckets` decides *which* gradients share an all-reduce (a plan: lists of parameter
indices, in buffer order). This module gives a plan its memory, as torch's reducer does: a zeroed
flat buffer per bucket (one dtype and device each), and for every parameter a view of its slot,
shaped like the parameter. Gradients are copied into the views (:func:`fill`), scaled by 1/N
(:func:`scale`), the buffer is all-reduced as one tensor, and the averages are copied back out of
the views (:func:`copy_out`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

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


def sizes_and_keys(params: Named) -> tuple[list[int], list[tuple[torch.dtype, torch.device]]]:
    """Each parameter's bytes and (dtype, device): what the bucket rules cut by."""
    return (
        [p.numel() * p.element_size() for _, p in params],
        [(p.dtype, p.device) for _, p in params],
    )


def static_plan(
    params: Named, order: list[int], *, bucket_cap_mb: float, first_bucket_cap_mb: float
) -> list[list[int]]:
    """The textbook cut: buckets filled over ``order`` with caps ``[first, cap]``."""
    nbytes, keys = sizes_and_keys(params)
    rows = [(params[i][0], 0, nbytes[i], keys[i]) for i in order]
    plan = bucket_plan(rows, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
    return [[order[j] for j in bucket] for bucket in plan]


def torch_plan(
    params: Named,
    order: list[int] | None,
    *,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    find_unused: bool,
) -> list[list[int]]:
    """torch's buckets: at construction (``order`` None), or rebuilt over ``order``."""
    nbytes, keys = sizes_and_keys(params)
    caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": first_bucket_cap_mb}
    if order is None:
        return torch_initial_buckets(nbytes, keys, find_unused_parameters=find_unused, **caps)
    return rebuilt_buckets(order, nbytes, keys, **caps)


def per_bucket_plan(params: Named, caps: list[int]) -> list[list[int]]:
    """torch's buckets under ``bucket_cap_mb_list``: registration order cut with ``caps``
    (bytes; one per bucket, the last repeated), then reversed."""
    nbytes, keys = sizes_and_keys(params)
    return list(reversed(assign_buckets(nbytes, keys, caps)))


def lay_out(params: Named, plan: list[list[int]], *, grads_as_views: bool) -> Layout:
    """Give each bucket of ``plan`` a flat buffer and each parameter a view of its slot.

    With ``grads_as_views`` (torch's ``gradient_as_bucket_view``) an existing ``.grad`` is
    copied into its new slot and replaced by it, so gradients survive a rebuild, as in torch."""
    n = len(params)
    bucket_of, views = [0] * n, [torch.empty(0)] * n
    all_offsets: list[list[int]] = []
    buffers: list[torch.Tensor] = []
    buckets: list[Bucket] = []
    for b, members in enumerate(plan):
        first = params[members[0]][1]
        numel = sum(params[i][1].numel() for i in members)
        buffer = torch.zeros(numel, dtype=first.dtype, device=first.device)
        offset, offsets = 0, []
        for i in members:
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
    ptrs = [view.data_ptr() for view in views]
    member_params = [[params[i][1] for i in members] for members in plan]
    member_views = [[views[i] for i in members] for members in plan]
    return Layout(
        plan, bucket_of, all_offsets, buffers, views, ptrs, buckets, member_params, member_views
    )


def fill(layout: Layout, params: Named, b: int, state: Any, *, grads_as_views: bool) -> None:
    """torch's mark_variable_ready_dense, for a whole bucket: its gradients into their slots.

    A ``.grad`` that already is its slot (``gradient_as_bucket_view``) stays in place and is
    noted in ``state`` (a :class:`~dplab.ddp.backward_state.BackwardState`) for :func:`scale`;
    the others are copied with one ``_foreach_copy_`` (one call per bucket, not per gradient),
    and with ``grads_as_views`` become views of their slots from then on. A parameter with no
    ``.grad`` (unused) contributes zeros."""
    if not grads_as_views:  # the common case: every .grad its own tensor, so copy them all
        grads = [p.grad for p in layout.member_params[b]]
        try:
            same_dtype = {g.dtype for g in grads} == {layout.buffers[b].dtype}
        except AttributeError:  # a None .grad: the loop below zeroes its slot
            same_dtype = False
        if same_dtype:
            torch._foreach_copy_(layout.member_views[b], grads)
            return
    dst, src = [], []
    for i in layout.members[b]:
        grad, view = params[i][1].grad, layout.views[i]
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == layout.view_ptrs[i]:
            state.in_place[i] = True
            state.in_place_count[b] += 1
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
    if dst:
        torch._foreach_copy_(dst, src)
        if grads_as_views:
            for i in layout.members[b]:
                if params[i][1].grad is not None:
                    params[i][1].grad = layout.views[i]


def scale(layout: Layout, b: int, state: Any, world_size: int) -> None:
    """Bucket ``b`` times 1/N (copied gradients) or / N (in-place ones), as torch does.

    torch scales each gradient as it goes: ``grad * (1/N)`` into the slot when it copies,
    ``slot / N`` in place when ``.grad`` already is the slot. Here the same operation is applied
    to the whole bucket: the same bits per element, one call per bucket."""
    n, buffer, count = world_size, layout.buffers[b], state.in_place_count[b]
    if count == 0:
        buffer.mul_(1.0 / n)
    elif count == len(layout.members[b]):
        buffer.div_(n)
    else:  # mixed: the first step after zero_grad(set_to_none=True) with views
        for i in layout.members[b]:
            if state.in_place[i]:
                layout.views[i].div_(n)
            else:
                layout.views[i].mul_(1.0 / n)


def copy_out(
    layout: Layout, params: Named, unused: set[int], no_grad: set[int], *, grads_as_views: bool
) -> None:
    """torch's finalize: averages back into ``.grad`` (a copy, or the view itself).

    A parameter no rank used keeps its ``.grad`` untouched (None stays None, as in torch, so
    optimizers skip it); one only other ranks used gets their average. ``no_grad``: those that
    had no ``.grad`` when their bucket was filled."""
    if grads_as_views:
        # Every gradient that came in already is its view (fill made it so); only those that
        # had none need pointing at theirs.
        for i in no_grad - unused:
            params[i][1].grad = layout.views[i]
        return
    if not unused:
        try:  # the common case, one call: every parameter has a .grad to copy into
            torch._foreach_copy_([p.grad for _, p in params], layout.views)
            return
        except TypeError:  # a None .grad: the loop below gives it a tensor of its own
            pass
    dst, src = [], []
    for i, (_, p) in enumerate(params):
        if i in unused:
            continue
        view = layout.views[i]
        if p.grad is None:
            p.grad = torch.empty_like(p).copy_(view)
        else:
            dst.append(p.grad)
            src.append(view)
    if dst:
        torch._foreach_copy_(dst, src)
