"""DP at scale: the closed-form comms-bound rule, what-if profiles, and the simulator's verdict.

The rule (§8c) is two lines of arithmetic. A dense model of P parameters costs about 6·P FLOPs
per token in a training step (2·P forward, 4·P backward); a device that trains D tokens per step
at F FLOP/s computes for 6·P·D / F seconds. Its ring all-reduce sends 2(N−1)/N · b · P bytes (b
bytes per gradient element) over a link of β seconds per byte. So the step is compute-bound
when D ≥ F·β · (N−1)/N · b / 3: the hardware's FLOPs per byte times the bytes the model moves per
FLOP. P cancels. :class:`CommsRule` holds the arithmetic; the simulator (NCCL's algorithms,
buckets, overlap) is the check beside it.
"""

from __future__ import annotations

import dataclasses
import math
from numbers import Real

from dplab.sim.link import Link
from dplab.sim.profile import BackwardProfile, ParamTiming
from dplab.sim.validation import validation_bands
from dplab.trace import StepTrace

__all__ = [
    "FLOPS_PER_PARAM_TOKEN",
    "WORLD_SIZES",
    "CommsRule",
    "accumulated_step_ms",
    "comm_time_ms",
    "crossover_world_size",
    "error_band_line",
    "faster_compute",
    "rule_profile",
    "verdict",
]

# Forward 2 FLOPs per weight per token (a multiply and an add), backward 4 (the gradient with
# respect to the layer's input and to its weight): Kaplan et al. 2020, §2.1.
FLOPS_PER_PARAM_TOKEN = 6
_DTYPES = {1: "float8", 2: "bfloat16", 4: "float32", 8: "float64"}


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class CommsRule:
    """One device of a DP job: its FLOP/s, its link, the gradient's element size, the world size.

    ``flops_per_s``: what the device computes (a datasheet peak, or a measured rate);
    ``beta_s_per_byte``: its link's seconds per byte (1 / bandwidth, §3.7's β);
    ``grad_bytes``: bytes per gradient element all-reduced (2 in bf16, 4 in fp32).
    """

    flops_per_s: float
    beta_s_per_byte: float
    grad_bytes: int = 2
    world_size: int = 1024

    def __post_init__(self) -> None:
        _positive("flops_per_s", self.flops_per_s)
        _positive("beta_s_per_byte", self.beta_s_per_byte)
        if self.grad_bytes not in (1, 2, 4, 8):
            raise ValueError(f"grad_bytes must be 1, 2, 4 or 8, got {self.grad_bytes!r}")
        n = self.world_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"world_size must be an int >= 2 (one rank sends nothing), got {n!r}")

    @classmethod
    def from_bandwidth(
        cls, flops_per_s: float, link_gbit_s: float, *, grad_bytes: int = 2, world_size: int = 1024
    ) -> CommsRule:
        """A device on a NIC of ``link_gbit_s`` gigabits per second, one way."""
        beta = 1 / (_positive("link_gbit_s", link_gbit_s) * 1e9 / 8)
        return cls(flops_per_s, beta, grad_bytes, world_size)

    @property
    def ring_factor(self) -> float:
        """2(N−1)/N: the bytes a rank sends per byte of the all-reduced tensor."""
        return 2 * (self.world_size - 1) / self.world_size

    @property
    def flops_per_byte(self) -> float:
        """The hardware's side: F·β, the FLOPs the device computes while its link sends a byte."""
        return self.flops_per_s * self.beta_s_per_byte

    @property
    def bytes_per_flop(self) -> float:
        """The model's side: bytes all-reduced per FLOP of one token, 2(N−1)/N·b·P / (6·P)."""
        return self.ring_factor * self.grad_bytes / FLOPS_PER_PARAM_TOKEN

    @property
    def threshold_tokens(self) -> float:
        """D*: the tokens per device per step above which T_compute ≥ T_comm (any P)."""
        return self.flops_per_byte * self.bytes_per_flop

    def compute_s(self, n_params: float, tokens: float) -> float:
        """T_compute of one step: 6·P·D / F."""
        return FLOPS_PER_PARAM_TOKEN * n_params * tokens / self.flops_per_s

    def comm_s(self, n_params: float) -> float:
        """T_comm of one step's all-reduce, bandwidth term only: 2(N−1)/N · b · P · β."""
        return self.ring_factor * self.grad_bytes * n_params * self.beta_s_per_byte

    def compute_bound(self, tokens: float) -> bool:
        """Whether ``tokens`` per device per step reach the threshold."""
        return tokens >= self.threshold_tokens

    def accumulation_steps(self, micro_batch_tokens: float) -> int:
        """The fewest micro-batches of ``micro_batch_tokens`` per step (one all-reduce, §3.5's
        ``no_sync``) that make the step compute-bound."""
        return max(1, math.ceil(self.threshold_tokens / _positive("tokens", micro_batch_tokens)))


def rule_profile(
    shape: BackwardProfile, n_params: float, tokens: float, rule: CommsRule
) -> BackwardProfile:
    """A what-if profile: ``shape``'s measured order and spacing of gradients in backward, scaled
    to a model of ``n_params`` parameters and ``rule.grad_bytes`` per gradient, whose compute is
    the rule's 6·P·D / F (forward 2·P·D / F, backward twice that; no optimizer time).

    It answers "what would the simulator say about the step the rule describes?": the compute
    is the rule's assumption, the buckets, the algorithms and the overlap are the simulator's.
    """
    scale = _positive("n_params", n_params) / shape.n_params
    forward_ms = 2 * n_params * _positive("tokens", tokens) / rule.flops_per_s * 1e3
    backward_ms = 2 * forward_ms
    k = backward_ms / shape.backward_ms if shape.backward_ms > 0 else 0.0
    params = tuple(
        ParamTiming(
            p.name,
            max(1, round(p.numel * scale)),
            max(1, round(p.numel * scale)) * rule.grad_bytes,
            _DTYPES[rule.grad_bytes],
            min(p.ready_ms * k, backward_ms),
        )
        for p in shape.params
    )
    meta = {**shape.meta, "what_if": f"{n_params:.3g} parameters, {tokens:,.0f} tokens, rule"}
    return BackwardProfile(
        f"{shape.model} scaled to {n_params:.3g}", params, forward_ms, backward_ms, 0.0, meta=meta
    )


def accumulated_step_ms(trace: StepTrace, micro_batches: int) -> float:
    """The step of ``micro_batches`` micro-batches like ``trace``'s with one all-reduce (§3.5's
    ``no_sync``): the first A−1 only compute (forward and backward), the last is ``trace``.

    The all-reduce, and what of it is exposed, stays the same; the compute grows A times: that is
    why accumulation is the cheap cure for a comms-bound step.
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    m = trace.metrics
    return (micro_batches - 1) * (m.t_forward_ms + m.t_backward_ms) + m.t_step_ms


def error_band_line() -> str:
    """The fabric model's error by message size, leave-one-source-out on the published runs the
    repository carries (docs/fabric-validation.md has the study), as one line to read beside a
    prediction."""
    bands = validation_bands()
    return "Fabric's median error, by all-reduce size: " + "; ".join(
        f"{b.band} {b.median_error:.0%}" for b in bands
    )


WORLD_SIZES = tuple(2**k for k in range(11))  # 1 .. 1,024


def faster_compute(profile: BackwardProfile, speedup: float) -> BackwardProfile:
    """The profile with every compute time divided by ``speedup`` (a what-if, not a
    measurement; the meta says so)."""
    if isinstance(speedup, bool) or not isinstance(speedup, Real) or not speedup > 0:
        raise ValueError(f"compute speed-up must be a number > 0, got {speedup!r}")
    if speedup == 1:
        return profile
    k = float(speedup)
    return dataclasses.replace(
        profile,
        params=tuple(dataclasses.replace(p, ready_ms=p.ready_ms / k) for p in profile.params),
        forward_ms=profile.forward_ms / k,
        backward_ms=profile.backward_ms / k,
        optimizer_ms=profile.optimizer_ms / k,
        meta={**profile.meta, "compute_speedup": k},
    )


def comm_time_ms(profile: BackwardProfile, link: Link, world_size: int) -> float:
    """All-reduce time of every gradient, bucketed or not (bandwidth term), on ``link``:
    the least communication a step of this model can have, at this world size."""
    return link.allreduce_s(profile.total_bytes, world_size) * 1e3


def crossover_world_size(
    profile: BackwardProfile, link: Link, sizes: tuple[int, ...] = WORLD_SIZES
) -> int | None:
    """The smallest world size in ``sizes`` at which even one all-reduce of all the gradients
    takes longer than the step's compute: from there on no overlap can hide the comm."""
    compute = profile.forward_ms + profile.backward_ms + profile.optimizer_ms
    for n in sizes:
        if n > 1 and comm_time_ms(profile, link, n) > compute:
            return n
    return None


def verdict(trace: StepTrace) -> str:
    """Compute-bound or comms-bound, in words and numbers."""
    m = trace.metrics
    if m.t_comm_ms >= m.t_compute_ms:
        kind = "comms-bound: T_comm ≥ T_compute, no bucketing can hide it"
    elif m.exposed_comm_ms > 0.05 * m.t_step_ms:
        kind = "compute-bound, but part of the comm is exposed"
    else:
        kind = "compute-bound, comm hidden under backward"
    return (
        f"{kind}. Step {m.t_step_ms:,.1f} ms; T_compute {m.t_compute_ms:,.1f} ms, "
        f"T_comm {m.t_comm_ms:,.1f} ms, exposed {m.exposed_comm_ms:,.1f} ms "
        f"({len(trace.buckets)} buckets)."
    )
