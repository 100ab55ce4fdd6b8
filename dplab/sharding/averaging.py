"""Did the ranks average their gradients, or sum them? A check for torch's own bug.

Data parallelism is right only if every rank ends with the *mean* of the ranks' gradients: then
N ranks on N micro-batches take the step one process takes on the whole batch. Some torch
releases' FSDP2 on gloo summed instead (pytorch issue 162338: the reduce-scatter's AVG was not
applied on gloo), and nothing crashes when that happens: the model trains with an N-times-too-big
gradient, which an SGD step turns into an N-times-too-big update. So the lesson compares the
gradient with the single-process global-batch gradient and, when they differ, says by what
factor: a factor of N is that bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# float64 gradients: only the order of the sums may differ (observed ~1e-16 relative)
TOLERANCE = 1e-9

FIX = (
    "this torch's sharded data parallelism summed the gradients instead of averaging them "
    "(pytorch issue 162338: FSDP2 on gloo). Upgrade torch; until then divide by the world size "
    "yourself (model.set_gradient_divide_factor(world_size) on the root FSDP module, or "
    "p.grad.div_(world_size) after backward), and check again with this cell."
)


@dataclass(frozen=True)
class Averaging:
    """The verdict on one run's gradient against the global-batch gradient."""

    world_size: int
    max_diff: float  # max |gradient - global-batch gradient|
    ratio: float  # least-squares factor: gradient ≈ ratio × global-batch gradient
    message: str

    @property
    def averaged(self) -> bool:
        return self.max_diff <= TOLERANCE

    @property
    def summed(self) -> bool:
        """The gradient is N times the mean: the ranks summed (issue 162338 when under FSDP2)."""
        return not self.averaged and abs(self.ratio - self.world_size) < 1e-6 * self.world_size


def check_averaging(grads: torch.Tensor, reference: torch.Tensor, world_size: int) -> Averaging:
    """Compare a rank's (full, flat) gradient with the global-batch ``reference`` gradient."""
    if grads.shape != reference.shape:
        raise ValueError(
            f"gradient has {grads.numel()} elements, the reference {reference.numel()}"
        )
    g, ref = grads.double(), reference.double()
    max_diff = float((g - ref).abs().max()) if g.numel() else 0.0
    ratio = float(g.dot(ref) / ref.dot(ref)) if ref.abs().sum() > 0 else float("nan")
    if max_diff <= TOLERANCE:
        message = (
            f"averaged: equal to the global-batch gradient (max |diff| {max_diff:.1e} "
            f"<= {TOLERANCE:.0e})"
        )
    elif abs(ratio - world_size) < 1e-6 * world_size and world_size > 1:
        message = f"summed: the gradient is {ratio:.3f} x the mean on {world_size} ranks — {FIX}"
    else:
        message = (
            f"wrong: max |diff| {max_diff:.3e} from the global-batch gradient "
            f"(best factor {ratio:.4f})"
        )
    return Averaging(world_size, max_diff, ratio, message)
