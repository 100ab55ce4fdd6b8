"""§1 Unused parameters: a branch skips a layer, and torch's DDP fails on the *next* step.

DDP launches a bucket's all-reduce when every gradient in it is ready. A parameter that took no
part in the loss never becomes ready, so its bucket is never reduced and the step never
finishes; torch notices only when the next forward starts ("Expected to have finished reduction
in the prior iteration..."). With ``TORCH_DISTRIBUTED_DEBUG=INFO`` (or DETAIL) the message names
the parameters. ``find_unused_parameters=True`` fixes it by walking the autograd graph from the
outputs after every forward and marking what it cannot reach as ready; that walk is paid every
step, and buckets are then never rebuilt in gradient-ready order.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dplab import _checks
from dplab.failures._common import first_line, mlp, short_group

_NAMED = re.compile(r"Parameters which did not receive grad for rank \d+: (?P<names>.*)")


class SkipNet(nn.Module):
    """``inp -> (skip, when used) -> head``: the skip layer takes part only when asked."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(width, width)
        self.skip = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, use_skip: bool = True) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if use_skip:
            h = torch.tanh(self.skip(h))
        return self.head(h)


@dataclass(frozen=True)
class UnusedParameters:
    """One rank's run of ``steps`` steps that never use ``skip``.

    ``error`` is torch's whole message (None when every step ran), ``failed_at_step`` the step
    whose forward raised it, ``named`` the parameters the message names (empty unless the
    debug level is INFO or DETAIL).
    """

    steps_done: int
    error: str | None
    failed_at_step: int | None
    named: tuple[str, ...]

    @property
    def headline(self) -> str:
        return first_line(RuntimeError(self.error)) if self.error else "no error"


def unused_parameters(
    *, find_unused: bool, steps: int = 3, debug: str = "INFO", group_timeout_s: float = 5.0
) -> UnusedParameters:
    """Rank function: train SkipNet with the skip layer never used, under torch's DDP."""
    steps = _checks.check_positive_int("steps", steps)
    result = UnusedParameters(steps, None, None, ())
    with short_group(group_timeout_s, debug=debug) as group:
        model = TorchDDP(SkipNet(), process_group=group, find_unused_parameters=find_unused)
        for step in range(steps):
            try:
                model(torch.randn(4, 8), use_skip=False).sum().backward()
            except RuntimeError as e:
                match = _NAMED.search(str(e))
                named = tuple(sorted(n.strip() for n in match["names"].split(","))) if match else ()
                result = UnusedParameters(step, str(e), step, named)
                break
        del model  # a DDP must not outlive its group (see short_group)
    return result


@dataclass(frozen=True)
class FindUnusedCost:
    """What ``find_unused_parameters=True`` costs a model whose parameters are all used.

    ``forward_ms``: median forward time (the graph walk runs at the end of forward) with the
    flag off and on; ``rebuilt``: whether torch rebuilt its buckets in gradient-ready order
    (``has_rebuilt_buckets`` of its own logging data), with the flag off and on.
    """

    forward_ms: dict[bool, float]
    rebuilt: dict[bool, bool]

    @property
    def ratio(self) -> float:
        return self.forward_ms[True] / self.forward_ms[False]


def find_unused_cost(
    *, steps: int = 15, depth: int = 24, group_timeout_s: float = 10.0
) -> FindUnusedCost:
    """Rank function: forward time and bucket rebuild with the flag off and on, interleaved."""
    steps = _checks.check_positive_int("steps", steps)
    times: dict[bool, list[float]] = {False: [], True: []}
    with short_group(group_timeout_s) as group:
        models = {
            flag: TorchDDP(
                mlp(32, depth), process_group=group, find_unused_parameters=flag, bucket_cap_mb=1
            )
            for flag in (False, True)
        }
        x = torch.randn(4, 32)
        for _ in range(steps):  # interleaved, so a busy moment costs both the same
            for flag, model in models.items():
                start = time.perf_counter()
                out = model(x)
                times[flag].append((time.perf_counter() - start) * 1e3)
                out.sum().backward()
        rebuilt = {
            flag: bool(m._get_ddp_logging_data().get("has_rebuilt_buckets", 0))
            for flag, m in models.items()
        }
        del models, model, out  # a DDP must not outlive its group (see short_group)
    return FindUnusedCost({f: statistics.median(t[1:]) for f, t in times.items()}, rebuilt)
