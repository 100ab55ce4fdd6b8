"""§7 A straggler: one slow rank sets every rank's pace, and hides in the step times.

The all-reduce is a barrier: no rank leaves it before the slowest has arrived. So every rank's
step is as long as the slow one's, and the per-rank step times look equal. What differs is the
*wait*: the fast ranks sit in the all-reduce (their exposed communication grows by the delay)
while the straggler, arriving last, waits least. The per-rank timeline shows it, and
:func:`dplab.doctor.find_straggler` names the rank and by how much.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dplab import _checks
from dplab.ddp import DDP
from dplab.failures._common import mlp
from dplab.trace import StepTrace, Tracer


def straggler_steps(
    *, slow_rank: int | None, delay_ms: float = 40.0, steps: int = 6, warmup: int = 1
) -> list[StepTrace]:
    """Rank function: traced dplab.DDP steps; ``slow_rank`` sleeps ``delay_ms`` in backward.

    The sleep sits in the loss's gradient hook, the first thing backward runs, so every
    gradient of the slow rank is ``delay_ms`` late, as on a slower GPU or a busier host.
    ``slow_rank=None``: no rank is slowed (the control).
    """
    steps = _checks.check_positive_int("steps", steps)
    delay_s = _checks.check_positive("delay_ms", delay_ms) / 1e3
    rank = dist.get_rank()
    tracer = Tracer()
    model = DDP(mlp(64, 4), tracer=tracer)
    opt = tracer.watch(torch.optim.SGD(model.parameters(), lr=1e-3))
    for step in range(warmup + steps):
        if step == warmup:
            tracer.clear()
        torch.manual_seed(10 * step + rank)
        loss = model(torch.randn(16, 64)).pow(2).mean()
        if rank == slow_rank:
            loss.register_hook(lambda g: (time.sleep(delay_s), g)[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return list(tracer.steps)
