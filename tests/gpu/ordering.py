"""Stream ordering of a bucket's collective, checked with a stand-in that is slow on purpose.

On one GPU, NCCL at world size 1 launches no kernel for an in-place all-reduce: there is nothing
to race. The stand-in is a comm hook (torch's contract: it gets the bucket, returns a Future)
that does what NCCL does, slowly: on a side stream it waits for the launching stream, sleeps
(``torch.cuda._sleep``) and then scales the bucket by ``FACTOR`` (what a sum over ``FACTOR``
ranks of equal gradients gives), and it completes its Future on that side stream. The step is
right only if DDP's wait makes the stream that copies the bucket back into ``.grad`` (and with
it the optimizer) wait for the side stream. Parameters after a few SGD steps are compared with
a reference that scales the gradients synchronously.

Two negative controls prove the check can fail:

- ``complete_early``: the Future is completed on the launching stream *before* the side stream's
  work, so waiting on it orders nothing: the optimizer reads unscaled gradients;
- ``no_launch_wait``: the side stream does not wait for the launching stream, while the compute
  stream is held back (a slow backward between the two layers): the stand-in scales a bucket
  before the gradients are in it.

Everything is device-agnostic: :class:`ImmediateStreams` runs the same code on CPU with no
asynchrony at all, where the negative controls cannot be told apart (``judge`` then says so):
the CPU tests run the logic, a GPU run proves it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import dplab

FACTOR = 4.0  # a power of two: scaling is exact, so the reference can match bit for bit
VARIANTS = ("honest", "complete_early", "no_launch_wait")
MATCH_TOL = 1e-6  # honest run vs reference: largest parameter difference
CAUGHT = 1e-4  # a negative control counts as caught above this


class ImmediateStreams:
    """No streams: every op runs at once, in program order (CPU)."""

    device = torch.device("cpu")

    def current(self) -> Any:
        return None

    def side(self) -> Any:
        return None

    def wait(self, waiter: Any, producer: Any) -> None:
        pass

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def sleep(self, ms: float) -> None:
        pass

    def future(self) -> torch.futures.Future:
        return torch.futures.Future()


class CudaStreams:
    """Real CUDA streams on ``device``; ``sleep`` spins a kernel on the current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = torch.cuda.Stream(device=device)
        self._cycles_per_ms = _calibrate_sleep(device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def side(self) -> Any:
        return self._side

    def wait(self, waiter: Any, producer: Any) -> None:
        waiter.wait_stream(producer)

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def sleep(self, ms: float) -> None:
        torch.cuda._sleep(int(ms * self._cycles_per_ms))

    def future(self) -> torch.futures.Future:
        return torch.futures.Future(devices=[self.device])


def _calibrate_sleep(device: torch.device) -> float:
    """Cycles of ``torch.cuda._sleep`` per millisecond on this GPU (measured with events)."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # warm the kernel up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return cycles / max(start.elapsed_time(end), 1e-3)


def stand_in_hook(streams: Any, variant: str, sleep_ms: float) -> Callable:
    """A comm hook that plays a slow all-reduce on a side stream (see the module docstring)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")

    # unannotated: torch's hook check accepts only its own GradBucket/Future annotations
    def hook(state, bucket):
        buffer = bucket.buffer()
        launcher, side = streams.current(), streams.side()
        if variant != "no_launch_wait":
            streams.wait(side, launcher)
        future = streams.future()
        if variant == "complete_early":
            future.set_result(buffer)  # marked done on the launching stream: orders nothing
        with streams.on(side):
            streams.sleep(sleep_ms)
            buffer.mul_(FACTOR)
            if variant != "complete_early":
                future.set_result(buffer)  # on CUDA: an event on the side stream, after the work
        return future

    return hook


class SlowBackward(torch.autograd.Function):
    """Identity whose backward first holds the current stream for ``ms`` (no-op on CPU)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sleep: Callable[[float], None], ms: float):
        ctx.sleep, ctx.ms = sleep, ms
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        if ctx.ms > 0:
            ctx.sleep(ctx.ms)
        return grad.clone(), None, None


class TwoLayers(nn.Module):
    """Two 1 MiB layers with a slow backward between them: two buckets at a 1 MiB cap."""

    def __init__(self, sleep: Callable[[float], None], ms: float, width: int = 512):
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)
        self._sleep, self._ms = sleep, ms

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = SlowBackward.apply(torch.tanh(self.first(x)), self._sleep, self._ms)
        return nn.functional.mse_loss(self.second(h), y)


def make_batches(steps: int, width: int = 512, batch: int = 32) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
        for _ in range(steps)
    ]


def reference_params(streams: Any, steps: int, lr: float = 0.1) -> list[torch.Tensor]:
    """Plain training, gradients scaled by FACTOR in program order: what an honest run gives."""
    torch.manual_seed(1)
    model = TwoLayers(lambda ms: None, 0.0).to(streams.device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in make_batches(steps):
        model(x.to(streams.device), y.to(streams.device)).backward()
        for p in model.parameters():
            p.grad.mul_(FACTOR)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def stand_in_ddp(
    streams: Any, variant: str, sleep_ms: float, *, slow_backward_ms: float, tracer: Any = None
) -> Any:
    """The two-layer model in dplab.DDP (two buckets at a 1 MiB cap) with the stand-in hook."""
    torch.manual_seed(1)
    model = TwoLayers(streams.sleep, slow_backward_ms).to(streams.device)
    ddp = dplab.DDP(model, bucket_cap_mb=1.0, tracer=tracer)
    ddp.register_comm_hook(None, stand_in_hook(streams, variant, sleep_ms))
    return ddp


def run_variant(
    streams: Any, variant: str, *, steps: int = 3, sleep_ms: float = 20.0, lr: float = 0.1
) -> float:
    """dplab.DDP (this rank's world, e.g. 1) with the stand-in hook: the largest parameter
    difference from :func:`reference_params` after ``steps`` steps."""
    # The slow backward outlasts the stand-in's own sleep, so a side stream that does not wait
    # scales the first layer's bucket while its gradients are still being made: with equal
    # sleeps (the first H200 run, 2026-12-04) the two finished together and the control was blind.
    ddp = stand_in_ddp(streams, variant, sleep_ms, slow_backward_ms=3 * sleep_ms)
    model = ddp.module
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for x, y in make_batches(steps):
        ddp(x.to(streams.device), y.to(streams.device)).backward()
        opt.step()  # on the current stream, right after backward returns
        opt.zero_grad()
    if streams.device.type == "cuda":
        torch.cuda.synchronize(streams.device)
    ours = [p.detach() for p in model.parameters()]
    want = reference_params(streams, steps, lr)
    return max((a - b).abs().max().item() for a, b in zip(ours, want, strict=True))


def judge(diffs: dict[str, float]) -> dict[str, Any]:
    """The honest run must match; each negative control must be caught. Raises if not."""
    missing = [v for v in VARIANTS if v not in diffs]
    if missing:
        raise ValueError(f"no result for {missing}")
    if not diffs["honest"] <= MATCH_TOL:
        raise AssertionError(
            f"with every wait in place the parameters differ by {diffs['honest']:.3g} "
            f"(> {MATCH_TOL}): the bucket's collective is not ordered before the optimizer"
        )
    blind = [v for v in VARIANTS[1:] if not diffs[v] > CAUGHT]
    if blind:
        raise AssertionError(
            f"negative control(s) {blind} not caught (differences {diffs}): this run cannot "
            "tell a missing wait from a present one, so the honest match proves nothing"
        )
    return {"diffs": diffs, "match_tol": MATCH_TOL, "caught_above": CAUGHT}
