"""dplab.ddp.layout.fill against the operations torch's reducer runs on each gradient.

torch's ``mark_variable_ready_dense`` puts ``grad × (1/N)`` into the slot (``at::mul_out``), or
divides the slot in place (``bucket_view.div_(N)``) when ``.grad`` already is it. dplab fills a
whole bucket at once, by one of two ways chosen by the gradients' sizes (``per_gradient``), and
divides a bucket of views in one call. Each way must give torch's bits: compared here with
``torch.mul(grad, 1/N)`` and ``grad / N`` element for element, tolerance 0.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dplab.ddp.layout import SMALL_GRADIENT, fill, lay_out, per_gradient


def _params(numels: list[int]) -> list[tuple[str, nn.Parameter]]:
    return [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(numels)]


def _with_grads(params: list[tuple[str, nn.Parameter]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g) * 3.7 for _, p in params]
    for (_, p), grad in zip(params, grads, strict=True):
        p.grad = grad.clone()
    return grads


SMALL = [SMALL_GRADIENT // 4] * 9  # averages below the rule: one copy and one multiply
LARGE = [SMALL_GRADIENT * 2, SMALL_GRADIENT]  # above: one mul per gradient


@pytest.mark.parametrize("numels", [SMALL, LARGE], ids=["copy-then-scale", "mul-per-gradient"])
@pytest.mark.parametrize("world_size", [2, 3, 7])
def test_fill_gives_torchs_mul_out_bits(numels, world_size):
    params = _params(numels)
    layout = lay_out(params, [list(range(len(params)))], grads_as_views=False)
    assert per_gradient(layout.member_views[0]) == (numels is LARGE)
    grads = _with_grads(params, seed=world_size)
    fill(layout, params, 0, grads_as_views=False, world_size=world_size)
    for i, grad in enumerate(grads):
        expected = torch.mul(grad, 1.0 / world_size)  # at::mul_out(slot, grad, 1/N)
        assert torch.equal(layout.views[i], expected), f"slot {i}, N = {world_size}"
        assert torch.equal(params[i][1].grad, grad), ".grad itself must not change"


@pytest.mark.parametrize("all_views", [True, False], ids=["every-slot-a-view", "one-copied"])
@pytest.mark.parametrize("world_size", [2, 3, 7])
def test_fill_divides_views_as_torchs_div(all_views, world_size):
    """With ``gradient_as_bucket_view`` a ``.grad`` that is its slot is divided in place, the
    whole bucket in one call when every slot is one; a ``.grad`` replaced by the user (not its
    slot) is copied in times 1/N and becomes the slot."""
    params = _params([300, 5, 1000, 64])
    layout = lay_out(params, [[0, 1, 2, 3]], grads_as_views=True)
    grads = _with_grads(params, seed=10 + world_size)
    for i, (_, p) in enumerate(params):  # what a first step leaves: every .grad its slot
        layout.views[i].copy_(grads[i])
        p.grad = layout.views[i]
    if not all_views:
        params[2][1].grad = grads[2].clone()  # a .grad of its own, as after a user's assignment
    fill(layout, params, 0, grads_as_views=True, world_size=world_size)
    for i, grad in enumerate(grads):
        copied = not all_views and i == 2
        expected = torch.mul(grad, 1.0 / world_size) if copied else grad / world_size
        assert torch.equal(layout.views[i], expected), f"slot {i}, N = {world_size}"
        assert params[i][1].grad.data_ptr() == layout.views[i].data_ptr()


def test_the_rule_is_the_average_gradient_size():
    at = [torch.empty(SMALL_GRADIENT), torch.empty(SMALL_GRADIENT)]
    below = [torch.empty(SMALL_GRADIENT * 2 - 2), torch.empty(1)]
    assert per_gradient(at)
    assert not per_gradient(below)
