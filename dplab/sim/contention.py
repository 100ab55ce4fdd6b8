"""``Contention``: what overlap costs when the same CPU cores compute and move the bytes.

On a GPU, NCCL's copies and the NIC work beside the compute kernels, and an all-reduce hidden
under backward is nearly free. On this CPU box it is not: gloo's threads need the same two
cores that the ranks' backward passes keep busy. Two things happen, both measured here:

- the all-reduce gets slower. Mostly its *latency*: a gloo thread that must wait for a busy
  core to wake it pays milliseconds per ring step instead of ~0.3 ms. Its per-byte cost rises
  less. So the busy link is described by two factors, on α and on β;
- backward gets slower, because the cycles gloo uses come out of its core.

The probe (:func:`contention_rank`, run on every rank): a helper thread runs back-to-back
all-reduces of two sizes (256 KiB and 4 MiB, the sizes buckets have) while the main thread
runs a real backward; the same train runs alone, and the backward runs alone; repeated,
interleaved, medians. The all-reduces that finished inside backward give the busy α and β
(two sizes, two unknowns; when a short backward lets only one size finish inside it, one
factor for both), the train alone the quiet ones, and the longer backward (each busy
backward against the solo one of the same repeat) the compute slowdown.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from numbers import Real
from typing import Any

from dplab._units import KIB, MIB
from dplab.collectives.cost import ring_time

PROBE_SIZES = (256 * KIB, 4 * MIB)


def _factor(name: str, value: Any, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Contention:
    """Slowdowns while an all-reduce and backward compute run at the same time.

    - ``compute_slowdown``: backward progresses at ``1 / (1 + compute_slowdown)`` of its solo
      speed while an all-reduce is in flight (0: unaffected).
    - ``alpha_factor``, ``beta_factor``: meanwhile the all-reduce costs ``alpha_factor``·α per
      ring step and ``beta_factor``·β per byte (1, 1: unaffected).

    ``probe`` keeps the medians they came from.
    """

    compute_slowdown: float = 0.0
    alpha_factor: float = 1.0
    beta_factor: float = 1.0
    probe: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "compute_slowdown", _factor("compute_slowdown", self.compute_slowdown, 0.0)
        )
        object.__setattr__(self, "alpha_factor", _factor("alpha_factor", self.alpha_factor, 1.0))
        object.__setattr__(self, "beta_factor", _factor("beta_factor", self.beta_factor, 1.0))

    def busy_seconds(self, nbytes: float, world_size: int, link: Any) -> float:
        """The ring all-reduce time of ``nbytes`` over ``link`` while backward computes."""
        return ring_time(
            nbytes,
            world_size,
            link.alpha_s * self.alpha_factor,
            link.beta_s_per_byte * self.beta_factor,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Contention:
        return cls(
            d.get("compute_slowdown", 0.0),
            d.get("alpha_factor", 1.0),
            d.get("beta_factor", 1.0),
            dict(d.get("probe", {})),
        )

    @classmethod
    def from_probe(cls, results: Sequence[dict[str, Any]]) -> Contention:
        """Pool every rank's probe and solve for the factors (see the module docstring)."""
        world_size = results[0]["world_size"]
        small, large = results[0]["sizes"]
        medians: dict[str, float] = {}
        for key in ("solo_small", "solo_large", "busy_small", "busy_large"):
            values = [v for r in results for v in r[key]]
            if values:
                medians[key] = statistics.median(values)
            elif key.startswith("solo"):
                raise ValueError(f"the contention probe got no {key.replace('_', ' ')} all-reduces")
        for key in ("solo_backward", "busy_backward", "overlap"):
            medians[key] = statistics.median(v for r in results for v in r[key])
        # Each busy backward ran right next to a solo one (same repeat): their difference is
        # blind to the machine's drift from minute to minute, which the two medians are not.
        medians["lost"] = statistics.median(
            busy - solo
            for r in results
            for busy, solo in zip(r["busy_backward"], r["solo_backward"], strict=True)
        )
        share = min(max(medians["lost"] / max(medians["overlap"], 1e-9), 0.0), 0.9)
        busy_sizes = [n for n in ("small", "large") if f"busy_{n}" in medians]
        if len(busy_sizes) == 2:
            a_solo, b_solo = _alpha_beta(
                small, large, medians["solo_small"], medians["solo_large"], world_size
            )
            a_busy, b_busy = _alpha_beta(
                small, large, medians["busy_small"], medians["busy_large"], world_size
            )
            alpha_factor, beta_factor = a_busy / a_solo, b_busy / b_solo
        elif busy_sizes:
            # A short backward can end before any large all-reduce does: one size cannot
            # separate α from β, so both take that size's slowdown.
            n = busy_sizes[0]
            alpha_factor = beta_factor = medians[f"busy_{n}"] / medians[f"solo_{n}"]
        else:
            alpha_factor = beta_factor = 1.0  # nothing finished inside backward to compare
        return cls(
            compute_slowdown=share / (1 - share),
            alpha_factor=max(alpha_factor, 1.0),
            beta_factor=max(beta_factor, 1.0),
            probe={
                "sizes": [small, large],
                "world_size": world_size,
                "medians_ms": medians,
                "busy_sizes_seen": busy_sizes,
            },
        )


def _alpha_beta(
    small: int, large: int, t_small: float, t_large: float, world_size: int
) -> tuple[float, float]:
    """α (ms per step) and β (ms per byte) of a ring through two (size, time) points, > 0."""
    steps = 2 * (world_size - 1)
    per_byte = 2 * (world_size - 1) / world_size
    beta = max((t_large - t_small) / (per_byte * (large - small)), 1e-15)
    alpha = max((t_small - per_byte * small * beta) / steps, 1e-9)
    return alpha, beta


def contention_rank(
    net: Any, batch: tuple[Any, Any], backward_ms: float, repeats: int = 5
) -> dict[str, Any]:
    """Run on every rank: the probe. ``net`` is the profiled model, ``batch`` its input."""
    import torch
    import torch.distributed as dist

    x, y = batch
    small, large = PROBE_SIZES
    bufs = [torch.zeros(small // 4), torch.zeros(large // 4)]

    def train(n: int, record: list[tuple[int, float, float]], t0: float) -> None:
        for i in range(n):
            start = time.perf_counter()
            dist.all_reduce(bufs[i % 2])
            record.append((i % 2, (start - t0) * 1e3, (time.perf_counter() - t0) * 1e3))

    # Size the train to last about half a backward when busy (about 3x its quiet time).
    quiet: list[tuple[int, float, float]] = []
    dist.barrier()
    train(4, quiet, time.perf_counter())
    pair_ms = sum(e - s for _, s, e in quiet[2:])
    n = torch.tensor([2 * max(2, math.ceil(backward_ms / 2 / 3 / max(pair_ms, 1e-3)))])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)  # every rank must run the same train
    n_ops = int(n.item())

    def backward(with_train: bool) -> tuple[float, list[tuple[int, float, float]]]:
        record: list[tuple[int, float, float]] = []
        dist.barrier()
        loss = net(x, y)
        t0 = time.perf_counter()
        helper = threading.Thread(target=train, args=(n_ops, record, t0)) if with_train else None
        if helper:
            helper.start()
        loss.backward()
        t1 = (time.perf_counter() - t0) * 1e3
        if helper:
            helper.join()
        net.zero_grad(set_to_none=False)
        return t1, record

    out: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "sizes": [small, large],
        **{k: [] for k in ("solo_small", "solo_large", "busy_small", "busy_large")},
        **{k: [] for k in ("solo_backward", "busy_backward", "overlap")},
    }
    backward(False)
    for r in range(repeats):
        for what in ("alone", "train", "both") if r % 2 == 0 else ("both", "train", "alone"):
            if what == "alone":
                out["solo_backward"].append(backward(False)[0])
            elif what == "train":
                record: list[tuple[int, float, float]] = []
                dist.barrier()
                train(n_ops, record, time.perf_counter())
                for size, s, e in record:
                    out["solo_large" if size else "solo_small"].append(e - s)
            else:
                b, record = backward(True)
                out["busy_backward"].append(b)
                out["overlap"].append(min(b, record[-1][2]))
                for size, s, e in record:
                    if e <= b:  # finished while backward still ran
                        out["busy_large" if size else "busy_small"].append(e - s)
    return out
