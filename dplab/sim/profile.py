"""``BackwardProfile``: what one rank's compute looks like, measured once, reused for any fabric.

The simulator needs, for every trainable parameter, *when* in backward its gradient is ready
and how many bytes it has; plus how long forward, backward and the optimizer take. None of this
depends on bucketing or on the link, so one real measurement serves every bucket cap, world
size and fabric the simulator is asked about.

It is measured on real ranks (:func:`measure_profile` runs :func:`profile_rank` on every rank of
a :func:`dplab.launch` or a :class:`dplab.Cluster`), so each rank computes while the others do,
as in a real step: on a small CPU box the ranks share cores, and a profile taken on one lone
process would be too fast. Plain post-accumulate-grad hooks stamp each gradient; nothing is
communicated during the timed steps. Several steps are timed; each step counts as its slowest
rank (a collective waits for the last rank), and every number is the median over steps.

On a machine whose CPU cores both compute and move the bytes (gloo on CPU), an all-reduce in
flight slows the backward that runs beside it, and the backward slows the all-reduce. The same
rank function measures that too (:class:`~dplab.sim.contention.Contention`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dplab._checks import check_nonneg
from dplab._units import MIB
from dplab.sim.contention import Contention, contention_rank
from dplab.trace.observer import NullObserver

FORMAT = "dplab.backward_profile/1"


@dataclass(frozen=True)
class ParamTiming:
    """One trainable parameter: its size and when (ms after backward starts) its grad is ready."""

    name: str
    numel: int
    nbytes: int
    dtype: str
    ready_ms: float

    def __post_init__(self) -> None:
        for key in ("numel", "nbytes"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"parameter {self.name!r}: {key} must be an int > 0, got {v!r}")
        object.__setattr__(self, "ready_ms", check_nonneg(f"{self.name!r} ready_ms", self.ready_ms))


@dataclass(frozen=True)
class BackwardProfile:
    """A measured step's compute, per parameter. ``params`` are in registration order.

    ``divide_ms_per_mib``: DDP divides each bucket by the world size on the compute thread just
    before launching its all-reduce (so that the sum is the average); this is what that costs.
    """

    model: str
    params: tuple[ParamTiming, ...]
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    divide_ms_per_mib: float = 0.0
    contention: Contention | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.params:
            raise ValueError(f"profile of {self.model!r} has no parameters (params is empty)")
        object.__setattr__(self, "params", tuple(self.params))
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"profile names a parameter twice: {dup}")
        for key in ("forward_ms", "backward_ms", "optimizer_ms", "divide_ms_per_mib"):
            object.__setattr__(self, key, check_nonneg(key, getattr(self, key)))
        last = max(p.ready_ms for p in self.params)
        if last > self.backward_ms * (1 + 1e-9) + 1e-9:
            raise ValueError(
                f"a gradient is ready at {last:.3f} ms, after backward ends "
                f"({self.backward_ms:.3f} ms)"
            )

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params)

    def bucket_rows(self) -> list[tuple[str, int, int, str]]:
        """``(name, numel, nbytes, key)`` in reverse registration order, as DDP buckets them."""
        return [(p.name, p.numel, p.nbytes, p.dtype) for p in reversed(self.params)]

    # -- JSON ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "forward_ms": self.forward_ms,
            "backward_ms": self.backward_ms,
            "optimizer_ms": self.optimizer_ms,
            "divide_ms_per_mib": self.divide_ms_per_mib,
            "contention": self.contention.to_dict() if self.contention else None,
            "params": [asdict(p) for p in self.params],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Any) -> BackwardProfile:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"not a backward profile (expected format {FORMAT!r}, got {found!r})")
        try:
            params = tuple(
                ParamTiming(str(p["name"]), p["numel"], p["nbytes"], str(p["dtype"]), p["ready_ms"])
                for p in d["params"]
            )
            contention = Contention.from_dict(d["contention"]) if d.get("contention") else None
            return cls(
                model=str(d["model"]),
                params=params,
                forward_ms=d["forward_ms"],
                backward_ms=d["backward_ms"],
                optimizer_ms=d["optimizer_ms"],
                divide_ms_per_mib=d.get("divide_ms_per_mib", 0.0),
                contention=contention,
                meta=dict(d.get("meta", {})),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed backward profile: {e!r}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> BackwardProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))


class GradTimer(NullObserver):
    """A :class:`~dplab.trace.StepObserver` that keeps when each gradient was ready.

    ``start`` is when backward began (the output's gradient was computed), ``marks[i]`` when
    trainable parameter ``i``'s gradient was accumulated, ``end`` the autograd engine's final
    callback. The same calls the Tracer draws a timeline from, kept as raw clock marks.
    """

    def __init__(self, clock: Any, n_params: int):
        self.clock = clock
        self.marks: list[Any] = [None] * n_params
        self.start: Any = None
        self.end: Any = None

    def reset(self) -> None:
        self.marks = [None] * len(self.marks)
        self.start = self.end = None

    def forward_end(self, output: Any) -> None:
        from dplab._nested import tensors_in  # torch: the simulator's import stays without it

        tensor = next((t for t in tensors_in(output) if t.requires_grad), None)
        if tensor is not None:
            tensor.register_hook(self._backward_starts)

    def _backward_starts(self, grad: Any) -> None:
        self.start = self.clock.now()

    def grad_ready(self, index: int) -> None:
        self.marks[index] = self.clock.now()

    def backward_end(self, *, synced: bool) -> None:
        self.end = self.clock.now()


# ---------------------------------------------------------------------------------------------
# Measuring on ranks


def profile_rank(
    model: str = "tiny-gpt",
    *,
    batch_size: int = 8,
    steps: int = 8,
    warmup: int = 2,
    seed: int = 0,
    contention_repeats: int = 5,
) -> dict[str, Any]:
    """Run on every rank: time ``steps`` training steps with no communication; return raw data.

    Each step starts at a barrier so the ranks compute at the same time, as in a DDP step.
    The optimizer is SGD, as :func:`dplab.ddp.measure_ddp` uses. With
    ``contention_repeats`` > 0, on CPU ranks and more than one of them, it then runs the
    contention probe (:func:`~dplab.sim.contention.contention_rank`).
    """
    import torch
    import torch.distributed as dist

    from dplab.ddp import DDP
    from dplab.launch import device
    from dplab.models import make_batch, make_model
    from dplab.trace.tracer import pick_clock

    rank = dist.get_rank()
    dev = device()
    # Host clocks on CPU; CUDA events on GPU (the host only enqueues kernels there).
    clock = pick_clock(dist.get_backend(), dev)
    net = make_model(model, seed=seed).to(dev)
    params = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in params], lr=1e-3)
    timer = GradTimer(clock, len(params))
    # DDP's own hooks tell the timer when each gradient is ready (the seam the Tracer uses);
    # every step runs under no_sync, so nothing is all-reduced: compute alone is measured.
    ddp = DDP(net, tracer=timer)
    samples = _time_steps(ddp, opt, timer, clock, params, model, batch_size, seed, warmup, steps)
    divide = _divide_ms_per_mib(sum(p.numel() for _, p in params), clock, dev)
    out: dict[str, Any] = {
        "params": [
            {
                "name": n,
                "numel": p.numel(),
                "nbytes": p.numel() * p.element_size(),
                "dtype": str(p.dtype).removeprefix("torch."),
            }
            for n, p in params
        ],
        "samples": samples,
        "divide_ms_per_mib": divide[1:],
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "device": str(params[0][1].device),
    }
    if contention_repeats > 0 and dev.type == "cpu" and dist.get_world_size() > 1:
        # One rank sends nothing, so there is nothing to probe. The probe measures gloo's
        # threads stealing CPU cores from backward. On a GPU the slowdown comes from NCCL's
        # kernels sharing the SMs and memory bandwidth, which this probe cannot see; the
        # simulator's GPU default, free overlap, is an assumption there.
        backward_ms = statistics.median(s["backward_ms"] for s in samples)
        batch = make_batch(model, batch_size, seed=seed + 7919 + rank)
        # A fresh copy of the model: the probe's backward should not run DDP's hooks.
        probe = make_model(model, seed=seed).to(dev)
        out["contention"] = contention_rank(probe, batch, backward_ms, contention_repeats)
    return out


def _time_steps(
    ddp: Any, opt: Any, timer: GradTimer, clock: Any, params: list, model: str,
    batch_size: int, seed: int, warmup: int, steps: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Time ``warmup + steps`` compute-only steps (all under ``no_sync``); keep the last
    ``steps``: forward, backward and optimizer times, and when each gradient was ready."""
    import torch.distributed as dist

    from dplab.models import make_batch

    rank, dev = dist.get_rank(), next(ddp.parameters()).device
    samples = []
    for step in range(warmup + steps):
        x, y = (t.to(dev) for t in make_batch(model, batch_size, seed=seed + 1000 * step + rank))
        timer.reset()
        dist.barrier()
        t0 = clock.now()
        with ddp.no_sync():
            loss = ddp(x, y)
            t1 = clock.now()
            loss.backward()
        t2 = clock.now()
        opt.step()
        t3 = clock.now()
        opt.zero_grad(set_to_none=False)
        clock.settle([])  # on GPU: wait for the events, after the step
        missing = [params[i][0] for i, m in enumerate(timer.marks) if m is None]
        if missing:
            raise RuntimeError(f"these parameters got no gradient, cannot profile them: {missing}")
        if step >= warmup:
            start = timer.start
            samples.append(
                {
                    "forward_ms": clock.ms(t1, t0),
                    "backward_start_ms": clock.ms(start, t0),
                    "backward_ms": clock.ms(timer.end or t2, start),
                    "optimizer_ms": clock.ms(t3, t2),
                    "ready_ms": [clock.ms(m, start) for m in timer.marks],
                }
            )
    return samples


def _divide_ms_per_mib(numel: int, clock: Any, dev: Any) -> list[float]:
    """DDP's division of the gradients by the world size, ms per MiB (first of 5 dropped)."""
    import torch
    import torch.distributed as dist

    flat = torch.ones(numel, device=dev)
    divide = []
    for _ in range(5):
        dist.barrier()  # every rank divides at once, as in a DDP step
        t0 = clock.now()
        flat.div_(dist.get_world_size())
        t1 = clock.now()
        clock.settle([])
        divide.append(clock.ms(t1, t0) / (flat.numel() * 4 / MIB))
    return divide


def slowest_rank(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One step as every rank sees it: the slowest rank decides.

    A bucket's all-reduce cannot finish before every rank has launched it, so what a DDP step
    waits for is, per gradient, the *last* rank to have it. Times are from each rank's step
    start (the barrier), which the ranks leave together: forward lasts until the last rank
    starts backward, a gradient is ready when it is ready on every rank, backward ends when
    it ends on every rank.
    """
    forward = max(s["backward_start_ms"] for s in steps)
    ready = [
        max(s["backward_start_ms"] + s["ready_ms"][i] for s in steps) - forward
        for i in range(len(steps[0]["ready_ms"]))
    ]
    return {
        "forward_ms": forward,
        "backward_ms": max(s["backward_start_ms"] + s["backward_ms"] for s in steps) - forward,
        "optimizer_ms": statistics.median(s["optimizer_ms"] for s in steps),
        "ready_ms": ready,
    }


def profile_from_ranks(
    model: str, results: Sequence[dict[str, Any]], *, meta: dict[str, Any] | None = None
) -> BackwardProfile:
    """Combine the ranks step by step (:func:`slowest_rank`), then take medians over steps."""
    if not results:
        raise ValueError("no rank results to build a profile from")
    first = results[0]
    n_steps = len(first["samples"])
    if n_steps == 0 or any(len(r["samples"]) != n_steps for r in results):
        raise ValueError("every rank must time the same number of steps (>= 1)")
    samples = [slowest_rank([r["samples"][k] for r in results]) for k in range(n_steps)]

    def med(key: str) -> float:
        return statistics.median(s[key] for s in samples)

    params = tuple(
        ParamTiming(
            p["name"],
            p["numel"],
            p["nbytes"],
            p["dtype"],
            statistics.median(s["ready_ms"][i] for s in samples),
        )
        for i, p in enumerate(first["params"])
    )
    contention = None
    if all("contention" in r for r in results):
        contention = Contention.from_probe([r["contention"] for r in results])
    each_rank = [s["backward_ms"] for r in results for s in r["samples"]]
    info = {
        "world_size": first["world_size"],
        "backend": first["backend"],
        "device": first["device"],
        "steps_timed": n_steps,
        "combined": "per step, the slowest rank; then medians over steps",
        "backward_ms_one_rank_median": statistics.median(each_rank),
        "backward_ms_one_rank_min_max": [min(each_rank), max(each_rank)],
    }
    info.update(meta or {})
    return BackwardProfile(
        model=model,
        params=params,
        forward_ms=med("forward_ms"),
        backward_ms=med("backward_ms"),
        optimizer_ms=med("optimizer_ms"),
        divide_ms_per_mib=statistics.median(v for r in results for v in r["divide_ms_per_mib"]),
        contention=contention,
        meta=info,
    )


def merge_runs(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several :func:`profile_rank` calls (each a list by rank) as one result per rank.

    Lets a benchmark spread a profile over time, interleaved with what it measures, so that
    both see the machine in the same moods.
    """
    if not runs:
        raise ValueError("no profile runs to merge")
    merged = []
    for rank in range(len(runs[0])):
        parts = [run[rank] for run in runs]
        out = dict(
            parts[0],
            samples=[s for p in parts for s in p["samples"]],
            divide_ms_per_mib=[v for p in parts for v in p["divide_ms_per_mib"]],
        )
        if all("contention" in p for p in parts):
            probe = dict(parts[0]["contention"])
            for key, value in probe.items():
                if isinstance(value, list) and key != "sizes":
                    probe[key] = [v for p in parts for v in p["contention"][key]]
            out["contention"] = probe
        merged.append(out)
    return merged


def measure_profile(
    model: str = "tiny-gpt",
    *,
    world_size: int = 2,
    batch_size: int = 8,
    steps: int = 8,
    warmup: int = 2,
    seed: int = 0,
    contention_repeats: int = 5,
    cluster: Any = None,
    command: str = "",
) -> BackwardProfile:
    """Measure a :class:`BackwardProfile` on ``world_size`` ranks (or on a warm Cluster)."""
    import dplab
    from dplab.env import machine_info
    from dplab.models import MODELS

    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    checks = (("steps", steps, 1), ("warmup", warmup, 0), ("batch_size", batch_size, 1))
    for name, value, low in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    kwargs = {
        "batch_size": batch_size,
        "steps": steps,
        "warmup": warmup,
        "seed": seed,
        "contention_repeats": contention_repeats,
    }
    if cluster is not None:
        results = cluster.run(profile_rank, model, **kwargs)
    else:
        results = dplab.launch(profile_rank, world_size, args=(model,), kwargs=kwargs)
    meta = {
        "batch_size": batch_size,
        "optimizer": "SGD",
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command or f"dplab.sim.measure_profile({model!r}, world_size={len(results)})",
    }
    return profile_from_ranks(model, results, meta=meta)
