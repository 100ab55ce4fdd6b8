"""The α-β cost model of all-reduce, nccl-tests' algbw/busbw, and fitting α and β to timings.

A message of b bytes costs ``α + b·β``: α is the per-message latency (software, wire, hops), β
the seconds per byte (1/bandwidth). The ring makes 2(N-1) sequential steps of S/N bytes; the
naive gather-and-broadcast pushes N-1 whole tensors each way through the root's one link.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dplab._checks import check_nonneg, check_positive, check_world_size
from dplab._units import GB


def bus_factor(world_size: int) -> float:
    """2(N-1)/N: bytes each rank sends in a ring all-reduce, per byte of tensor."""
    n = check_world_size(world_size)
    return 2 * (n - 1) / n


def ring_bytes_per_rank(size_bytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``size_bytes``: 2(N-1)/N·S.

    Exact when N divides the element count; otherwise chunks differ by one element.
    """
    return bus_factor(world_size) * check_nonneg("size_bytes", size_bytes)


def naive_bytes_per_rank(size_bytes: float, world_size: int, root: int = 0) -> list[float]:
    """Bytes each rank sends in the naive all-reduce: (N-1)·S at the root, S elsewhere."""
    n = check_world_size(world_size)
    s = check_nonneg("size_bytes", size_bytes)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < n:
        raise ValueError(f"root must be a rank in 0..{n - 1}, got {root!r}")
    if n == 1:
        return [0.0]
    return [(n - 1) * s if r == root else s for r in range(n)]


def ring_time(size_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """α-β time of a ring all-reduce: 2(N-1)·α + 2(N-1)/N · S·β (seconds)."""
    n = check_world_size(world_size)
    s = check_nonneg("size_bytes", size_bytes)
    a, b = check_nonneg("alpha", alpha), check_nonneg("beta", beta)
    return 2 * (n - 1) * a + bus_factor(n) * s * b


def naive_time(size_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """α-β time of gather-to-one + broadcast: 2(N-1)·α + 2(N-1)·S·β.

    The root's one link receives N-1 whole tensors, then sends N-1: they queue on that link.
    The root posts its N-1 receives at once, so part of their latency can overlap; 2(N-1)·α
    is then an upper bound, and for tiny tensors the naive scheme (two rounds) can beat the
    ring (2(N-1) rounds): the latency/bandwidth trade-off behind NCCL's tree algorithms.
    """
    n = check_world_size(world_size)
    s = check_nonneg("size_bytes", size_bytes)
    a, b = check_nonneg("alpha", alpha), check_nonneg("beta", beta)
    return 2 * (n - 1) * (a + s * b)


def algbw(size_bytes: float, time_s: float) -> float:
    """Algorithm bandwidth, bytes/s: S / t (nccl-tests, doc/PERFORMANCE.md)."""
    return check_nonneg("size_bytes", size_bytes) / check_positive("time_s", time_s)


def busbw(size_bytes: float, time_s: float, world_size: int) -> float:
    """Bus bandwidth, bytes/s: algbw · 2(N-1)/N for all-reduce (nccl-tests, PERFORMANCE.md).

    This is the rate at which each rank's link moved data, so it does not fall as N grows and
    can be compared with the hardware's link bandwidth.
    """
    return algbw(size_bytes, time_s) * bus_factor(world_size)


def _messages(n: int) -> float:
    return 2.0 * (n - 1)


# model → (α coefficient, β coefficient per byte), as functions of N
COST_MODELS = {"ring": (_messages, bus_factor), "naive": (_messages, _messages)}


@dataclass(frozen=True)
class AlphaBetaFit:
    """α (s per message) and β (s per byte) fitted to measured all-reduce times."""

    alpha_s: float
    beta_s_per_byte: float
    world_size: int
    model: str
    max_rel_error: float
    median_rel_error: float
    n_points: int

    @property
    def bandwidth_Bps(self) -> float:
        return math.inf if self.beta_s_per_byte == 0 else 1.0 / self.beta_s_per_byte

    @property
    def bandwidth_GBps(self) -> float:
        return self.bandwidth_Bps / GB

    def predict(self, size_bytes: float) -> float:
        """Predicted time (s) of one all-reduce of ``size_bytes`` at this world size."""
        fn = ring_time if self.model == "ring" else naive_time
        return fn(size_bytes, self.world_size, self.alpha_s, self.beta_s_per_byte)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``bandwidth_GBps`` is None when β is 0 (JSON has no infinity)."""
        bw = self.bandwidth_GBps
        return {**asdict(self), "bandwidth_GBps": bw if math.isfinite(bw) else None}


def fit_alpha_beta(
    sizes: Sequence[float], times: Sequence[float], world_size: int, *, model: str = "ring"
) -> AlphaBetaFit:
    """Least-squares α and β (both >= 0) from all-reduce times ``times[i]`` at ``sizes[i]`` bytes.

    The model is :func:`ring_time` (or :func:`naive_time` with ``model="naive"``), linear in α
    and β. Residuals are *relative* (each row weighted by 1/t): sizes span five orders of
    magnitude, and plain least squares would let the largest sizes decide everything, leaving
    α, which only the small sizes can see, to noise. The error reported is relative too.
    """
    import numpy as np

    n = check_world_size(world_size, minimum=2)
    if model not in COST_MODELS:
        raise ValueError(f"model must be one of {sorted(COST_MODELS)}, got {model!r}")
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if s.ndim != 1 or s.shape != t.shape:
        raise ValueError(f"sizes and times must be 1-D and equally long, got {s.shape}, {t.shape}")
    if not np.all(np.isfinite(s)) or np.any(s < 0):
        raise ValueError(f"sizes must be finite and >= 0 bytes, got {list(sizes)!r}")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"times must be finite and > 0 seconds, got {list(times)!r}")
    if len(np.unique(s)) < 2:
        raise ValueError("need at least two distinct sizes to separate α from β")
    messages, per_byte = COST_MODELS[model]
    design = np.column_stack([np.full_like(s, messages(n)), per_byte(n) * s]) / t[:, None]
    target = np.ones_like(t)  # t / t
    coef = _nonneg_lstsq(design, target)
    predicted = design @ coef  # = predicted time / measured time
    rel = np.abs(predicted - 1.0)
    return AlphaBetaFit(
        alpha_s=float(coef[0]),
        beta_s_per_byte=float(coef[1]),
        world_size=n,
        model=model,
        max_rel_error=float(rel.max()),
        median_rel_error=float(np.median(rel)),
        n_points=len(s),
    )


def _nonneg_lstsq(a: Any, b: Any) -> Any:
    """Two-column least squares with both coefficients >= 0 (try all, then each alone)."""
    import numpy as np

    coef = np.linalg.lstsq(a, b, rcond=None)[0]
    if np.all(coef >= 0):
        return coef
    best, best_err = np.zeros(2), math.inf
    for j in range(2):
        col = a[:, j]
        denom = float(col @ col)
        c = np.zeros(2)
        c[j] = max(0.0, float(col @ b) / denom) if denom > 0 else 0.0
        err = float(np.sum((a @ c - b) ** 2))
        if err < best_err:
            best, best_err = c, err
    return best
