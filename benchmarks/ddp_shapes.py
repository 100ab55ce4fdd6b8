"""dplab.DDP against torch's DistributedDataParallel on the shapes and knobs a practitioner uses.

One training step (forward, backward, SGD step, zero_grad) of the same model, weights and
arguments under each DDP, on 2 gloo ranks. Every (shape, DDP) pair is interleaved with all the
others in one shuffled order both ranks share, every timed step starts at a barrier, and the
first steps (bucket rebuild, static graph's first iteration) are warm-up. Reported: the median
step of each and the ratio dplab / torch with a 95% bootstrap interval. Goal: each <= 1.05,
the median over shapes <= 1.00 (issue 41).

    python benchmarks/ddp_shapes.py [--steps 30] [--only NAME ...] [--profile NAME]
                                    [--host-overhead NAME]

``--profile NAME`` prints torch.profiler's top operators of one step of that shape, for dplab
and for torch, where a ratio above 1 needs explaining. ``--host-overhead NAME`` runs that shape
on one rank with one thread, where no peer and no second core blur the clock: the difference of
the median steps is what dplab's Python costs over torch's C++ reducer, and a wall clock around
dplab.DDP's functions says where it is spent.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from _stats import interleaved, machine, median_ratio
from torch import nn

import dplab
import dplab.ddp.ddp as ddp_module
from dplab.models import make_batch, make_model


class Tiny(nn.Module):
    """800 tiny parameters: 400 Linear(4, 4) in a chain (the per-gradient cost shows)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(400)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(x), y)


class Big(nn.Module):
    """One 64 MiB parameter (4096 x 4096 float32): one bucket, bandwidth-bound."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4096, 4096) * 0.01)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(x @ self.w, y)


def _fp16(ddp: nn.Module) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)


def _tiny_gpt(
    ddp_kwargs: dict, *, hook: Callable | None = None, micro: int = 1
) -> tuple[Callable, Callable, dict, Callable | None, int]:
    """A tiny-gpt shape (batch 8 per rank) with these DDP arguments: the knobs' shared model."""
    return (
        lambda: make_model("tiny-gpt"),
        lambda r: make_batch("tiny-gpt", 8, seed=r),
        ddp_kwargs,
        hook,
        micro,
    )


# name -> (model factory, batch factory, DDP kwargs, after-wrap setup, micro-batches)
SHAPES: dict[str, tuple[Callable, Callable, dict, Callable | None, int]] = {
    "gpt-7m defaults": (
        lambda: make_model("gpt-7m"),
        lambda r: make_batch("gpt-7m", 4, seed=r),
        {},
        None,
        1,
    ),
    "800 tiny parameters": (
        lambda: (torch.manual_seed(0), Tiny())[1],
        lambda r: (torch.randn(8, 4), torch.randn(8, 4)),
        {},
        None,
        1,
    ),
    "one 64 MiB parameter": (
        lambda: (torch.manual_seed(0), Big())[1],
        lambda r: (torch.randn(4, 4096), torch.randn(4, 4096)),
        {},
        None,
        1,
    ),
    "find_unused_parameters": _tiny_gpt({"find_unused_parameters": True}),
    "fp16-compress hook": _tiny_gpt({}, hook=_fp16),
    "gradient_as_bucket_view": _tiny_gpt({"gradient_as_bucket_view": True}),
    "4 micro-batches, no_sync": _tiny_gpt({}, micro=4),
    "static_graph": _tiny_gpt({"static_graph": True}),
}


def _step_of(net: nn.Module, batch: tuple, micro: int) -> Callable[[], None]:
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    x, y = batch

    def step() -> None:
        for _ in range(micro - 1):
            with net.no_sync():
                net(x, y).backward()
        net(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


def _wrap(which: str, name: str) -> tuple[nn.Module, tuple, int]:
    model_fn, batch_fn, kwargs, setup, micro = SHAPES[name]
    cls = dplab.DDP if which == "dplab" else nn.parallel.DistributedDataParallel
    net = cls(model_fn(), **kwargs)
    if setup is not None:
        setup(net)
    return net, batch_fn(dist.get_rank()), micro


# A shape whose step is under this gets more timed steps (up to 4x ``--steps``), so that every
# shape is timed for about as long: a 20 ms step is noisier than a 400 ms one.
STEP_MS_FOR_BASE_COUNT = 100.0


def repeats_by_step_time(step_ms: dict[tuple[str, str], float], steps: int) -> dict:
    """Timed steps per (DDP, shape): ``steps`` times 100 ms over the shape's slower DDP's step,
    rounded, between 1 and 4. Both DDPs of a shape get the same count."""
    out = {}
    for which, name in step_ms:
        ms = max(step_ms[("dplab", name)], step_ms[("torch", name)])
        out[(which, name)] = steps * min(4, max(1, round(STEP_MS_FOR_BASE_COUNT / ms)))
    return out


def race(names: list[str], steps: int) -> dict:
    """On every rank: each shape under each DDP, all steps interleaved; fast shapes get more
    steps (:func:`repeats_by_step_time`, from the slowest rank's time of one warm step)."""
    torch.manual_seed(dist.get_rank())
    nets = {(w, n): _wrap(w, n) for n in names for w in ("dplab", "torch")}
    steps_of = {key: _step_of(*nets[key]) for key in nets}
    one = interleaved(steps_of, 1, warmup=3)
    slowest = torch.tensor([one[key][0] for key in steps_of], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    step_ms = dict(zip(steps_of, slowest.tolist(), strict=True))
    return interleaved(steps_of, repeats_by_step_time(step_ms, steps), warmup=0)


def profile(name: str, steps: int) -> dict:
    """torch.profiler's top operators over ``steps`` steps of one shape, for each DDP."""
    out = {}
    for which in ("dplab", "torch"):
        step = _step_of(*_wrap(which, name))
        for _ in range(3):
            step()
        with torch.profiler.profile() as prof:
            for _ in range(steps):
                step()
        out[which] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return out


# dplab.DDP's functions that --host-overhead times, in the order a step reaches them. They
# nest: a hook (_on_grad) that completes a bucket holds its _launch (fill, then
# _start_collective), and DDP.forward holds the model's forward.
CLOCKED = {
    "DDP.forward": (dplab.DDP, "forward"),
    "model forward": (None, "forward"),
    "_on_grad (per gradient)": (dplab.DDP, "_on_grad"),
    "_launch (per bucket)": (dplab.DDP, "_launch"),
    "fill": (ddp_module, "fill"),
    "_start_collective": (dplab.DDP, "_start_collective"),
    "_end_of_backward": (dplab.DDP, "_end_of_backward"),
}


@contextlib.contextmanager
def _clocked(model_class: type) -> Iterator[dict[str, float]]:
    """Wrap each of :data:`CLOCKED` (``None``: the model's class) with a wall clock that adds
    to the yielded totals, in seconds; the originals are put back on exit."""
    spent = dict.fromkeys(CLOCKED, 0.0)
    targets = {key: (owner or model_class, name) for key, (owner, name) in CLOCKED.items()}
    saved = {key: getattr(owner, name) for key, (owner, name) in targets.items()}

    def clock(key: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        return timed

    for key, (owner, name) in targets.items():
        setattr(owner, name, clock(key, saved[key]))
    try:
        yield spent
    finally:
        for key, (owner, name) in targets.items():
            setattr(owner, name, saved[key])


def host_overhead(name: str, steps: int) -> dict:
    """On one rank, one thread: both DDPs' median steps, interleaved, then dplab.DDP's steps
    again with a wall clock around its functions (:data:`CLOCKED`; about 0.3 µs a call)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nets = {w: _wrap(w, name) for w in ("dplab", "torch")}
    step_of = {w: _step_of(*nets[w]) for w in nets}
    times = interleaved(step_of, steps, warmup=5)
    with _clocked(type(nets["dplab"][0].module)) as spent:
        for _ in range(steps):
            step_of["dplab"]()
    return {"times": times, "own": {key: s / steps * 1e3 for key, s in spent.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--profile", choices=list(SHAPES))
    p.add_argument("--host-overhead", choices=list(SHAPES))
    args = p.parse_args()
    if args.host_overhead:
        out = dplab.launch(host_overhead, 1, args=(args.host_overhead, args.steps))[0]
        ours, theirs = (statistics.median(out["times"][w]) for w in ("dplab", "torch"))
        print(f"machine: {machine()}; {args.steps} steps each, 1 rank, 1 thread")
        print(f"{args.host_overhead}: dplab {ours:.2f} ms, torch {theirs:.2f} ms a step; "
              f"dplab - torch = {ours - theirs:+.3f} ms ({ours / theirs - 1:+.1%})")  # fmt: skip
        print("dplab.DDP's functions, wall ms a step (nested: see CLOCKED):")
        for where, ms in out["own"].items():
            print(f"  {ms:7.3f}  {where}")
        return
    if args.profile:
        tables = dplab.launch(profile, 2, args=(args.profile, 10), timeout_s=1800)[0]
        for which, table in tables.items():
            print(f"## {which}: {args.profile}\n{table}")
        return
    times = dplab.launch(race, 2, args=(args.only, args.steps), timeout_s=3600)[0]
    print(f"machine: {machine()}; {args.steps} steps per (shape, DDP) or up to 4x that where a "
          "step is under 100 ms, 2 gloo ranks")  # fmt: skip
    print("| shape | steps | dplab median | torch median | dplab / torch (95% CI) |")
    print("|---|---|---|---|---|")
    ratios = []
    for name in args.only:
        ours, theirs = times[("dplab", name)], times[("torch", name)]
        ratio, lo, hi = median_ratio(ours, theirs)
        ratios.append(ratio)
        print(
            f"| {name} | {len(ours)} | {statistics.median(ours):.1f} ms | "
            f"{statistics.median(theirs):.1f} ms | {ratio:.3f} ({lo:.3f}–{hi:.3f}) |"
        )
    print(f"| median over shapes | | | | {statistics.median(ratios):.3f} |")


if __name__ == "__main__":
    main()
