"""The bucket rules of "build your own DDP" (notebook 08b), written once.

The exercise asks for buckets of *at most* ``bucket_size_mb`` MiB (:func:`greedy_plan`): the
checker (:mod:`~dplab.exercises.my_ddp`) judges the learner's buckets by it and the reference
answer (:mod:`~dplab.exercises.my_ddp_solutions`) cuts its buckets with it. torch's reducer
closes a bucket once it *reaches* the cap (:func:`close_at_cap_plan`), so its buckets may exceed
the cap by one tensor; the checker uses that rule only to recognise an answer that followed it.
``tests/test_my_ddp.py`` checks both rules against torch's own bucket assignment.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def greedy_plan(nbytes: Sequence[int], cap_bytes: float) -> list[list[int]]:
    """Cut ``nbytes`` (already in bucketing order) into consecutive runs of at most
    ``cap_bytes`` each; a tensor bigger than the cap gets a bucket of its own."""
    plan: list[list[int]] = []
    total = 0.0
    for i, size in enumerate(nbytes):
        if plan and total + size <= cap_bytes:
            plan[-1].append(i)
            total += size
        else:
            plan.append([i])
            total = size
    return plan


def close_at_cap_plan(nbytes: Sequence[int], cap_bytes: float) -> list[list[int]]:
    """torch's reducer rule: add a tensor, close the bucket once it reaches the cap."""
    plan: list[list[int]] = [[]]
    total = 0.0
    for i, size in enumerate(nbytes):
        plan[-1].append(i)
        total += size
        if total >= cap_bytes:
            plan.append([])
            total = 0.0
    return [b for b in plan if b]


def expected_buckets(module: nn.Module, cap_bytes: float) -> list[list[str]]:
    """The buckets the exercise asks for: trainable parameters in reverse registration order,
    cut greedily at ``cap_bytes``; names as ``named_parameters`` gives them."""
    trainable = [(n, p.numel() * p.element_size()) for n, p in module.named_parameters()
                 if p.requires_grad][::-1]  # fmt: skip
    plan = greedy_plan([size for _, size in trainable], cap_bytes)
    return [[trainable[i][0] for i in members] for members in plan]


__all__ = ["close_at_cap_plan", "expected_buckets", "greedy_plan"]
