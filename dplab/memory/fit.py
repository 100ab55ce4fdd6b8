"""Does it fit? Per-rank memory (model state + activations) against one GPU, with the reason.

The reason is a sentence built from the numbers, e.g. "7.00 B params × 16 B = 112 GB > 85.9 GB
(an H100's 80 GiB): does not fit on an H100 at any data-parallel size". Plain DP cannot fix a
model whose state does not fit one GPU, because its bytes per rank do not depend on the world
size; ZeRO can, and :func:`min_world_size` says from how many ranks on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dplab._checks import check_world_size
from dplab._units import GB
from dplab.memory.activations import check_recompute, gpt_activation_bytes
from dplab.memory.presets import GPU, ModelConfig, get_gpu, get_model, gpt_shape_for
from dplab.memory.recipes import PARTS, bytes_per_param, check_optimizer, check_precision
from dplab.memory.state import (
    SHARDED_FROM,
    STAGE_LABELS,
    StateBytes,
    check_n_params,
    check_zero_stage,
    state_bytes,
)


def fmt_num(x: float) -> str:
    """Three significant figures, thousands separated: 7.00, 31.4, 112, 1,120."""
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:#.3g}".rstrip(".")


def fmt_gb(nbytes: float) -> str:
    """Bytes as decimal gigabytes (1 GB = 10^9 bytes), the unit of the published figures."""
    return f"{fmt_num(nbytes / GB)} GB"


def fmt_params(n: int) -> str:
    """A parameter count in billions (``7.00 B params``) or, below a billion, millions."""
    if n >= 10**9:
        return f"{fmt_num(n / 1e9)} B params"
    return f"{fmt_num(n / 1e6)} M params"


def _article(word: str) -> str:
    return "an" if word[:1].upper() in "AEFHILMNORSX" else "a"


@dataclass(frozen=True)
class Fit:
    """One rank's memory against one GPU, and whether (and why) it fits."""

    model: ModelConfig
    n_params: int
    gpu: GPU
    state: StateBytes
    activations: int
    micro_batch: int
    seq_len: int
    recompute: str
    min_world_size: int | None  # smallest world size at this ZeRO stage that fits; None: never

    @property
    def total(self) -> int:
        return self.state.total + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu.capacity_bytes

    @property
    def headroom(self) -> int:
        """Bytes to spare (negative: bytes too many)."""
        return self.gpu.capacity_bytes - self.total

    def parts(self) -> dict[str, int]:
        """Per-rank bytes by part, activations included (what the stacked bars draw)."""
        return {**self.state.as_dict(), "activations": self.activations}

    @property
    def reason(self) -> str:
        return verdict(self)


def _capacity_phrase(gpu: GPU) -> str:
    return f"{fmt_gb(gpu.capacity_bytes)} ({_article(gpu.short_name)} {gpu.short_name}'s " + (
        f"{gpu.memory_gib} GiB)"
    )


def verdict(fit: Fit) -> str:
    """One sentence, every number in it computed: does this rank fit, and if not, why not."""
    gpu, st = fit.gpu, fit.state
    short = gpu.short_name
    cap = _capacity_phrase(gpu)
    per_param = bytes_per_param(st.precision, st.optimizer).total
    params = fmt_params(fit.n_params)
    recompute = "" if fit.recompute == "none" else f", {fit.recompute} recomputation"
    act = (
        f" + {fmt_gb(fit.activations)} of activations (micro-batch {fit.micro_batch} × "
        f"{fit.seq_len:,} tokens{recompute})"
    )
    if st.zero_stage == 0:
        state = f"{params} × {per_param} B = {fmt_gb(st.total)}"
        if st.total > gpu.capacity_bytes:
            return (
                f"{state} > {cap}: does not fit on {_article(short)} {short} at any "
                "data-parallel size — every rank holds the whole copy."
            )
        if not fit.fits:
            return (
                f"{state}{act} = {fmt_gb(fit.total)} > {cap}: does not fit; a smaller "
                "micro-batch (with accumulation) or recomputation shrinks the activations, "
                "more data-parallel ranks do not."
            )
        copies = (
            f"each of the {st.world_size:,} ranks holds this same copy"
            if st.world_size > 1
            else "every rank added would hold this same copy"
        )
        return (
            f"{state}{act} = {fmt_gb(fit.total)} ≤ {cap}: fits, with "
            f"{fmt_gb(fit.headroom)} to spare — and {copies}."
        )
    where = f"With {STAGE_LABELS[st.zero_stage]} over {st.world_size:,} ranks, {params} cost"
    state = f"{fmt_gb(st.total)} of model state per rank"
    head = f"{where} {state}{act} = {fmt_gb(fit.total)}"
    if fit.fits:
        return f"{head} ≤ {cap}: fits, with {fmt_gb(fit.headroom)} to spare."
    if fit.min_world_size is None:
        return (
            f"{head} > {cap}: does not fit at any world size — what this stage leaves "
            "unsharded (plus activations) is already too big."
        )
    return (
        f"{head} > {cap}: does not fit at {st.world_size:,} ranks; it needs at least "
        f"{fit.min_world_size:,} ranks."
    )


def min_world_size(
    n_params: int,
    capacity_bytes: int,
    *,
    activations: int = 0,
    zero_stage: int = 0,
    precision: str = "mixed",
    optimizer: str = "adam",
) -> int | None:
    """The smallest world size at which one rank's state + activations fit, or None if none.

    Plain DP (stage 0) fits at world size 1 or never. A ZeRO stage divides its sharded parts by
    N, so it fits from some N on unless the unsharded parts and the activations alone are too big.
    """
    n = check_n_params(n_params)
    stage = check_zero_stage(zero_stage)
    per_param = bytes_per_param(precision, optimizer)
    sharded = sum(getattr(per_param, p) for p in PARTS if stage >= SHARDED_FROM[p])
    fixed = n * (per_param.total - sharded) + activations
    room = capacity_bytes - fixed
    if room < 0:
        return None
    if sharded == 0:
        return 1
    if room < sharded:  # not even a shard of one parameter fits
        return None
    world = max(1, math.ceil(n * sharded / room))
    while fixed + math.ceil(n / world) * sharded > capacity_bytes:  # ⌈Ψ/N⌉ rounding
        world += 1
    while world > 1 and fixed + math.ceil(n / (world - 1)) * sharded <= capacity_bytes:
        world -= 1
    return world


def fits(
    model: str | ModelConfig | int,
    gpu: str | GPU,
    *,
    precision: str = "mixed",
    optimizer: str = "adam",
    world_size: int = 1,
    zero_stage: int = 0,
    micro_batch: int = 1,
    seq_len: int = 2048,
    recompute: str = "none",
) -> Fit:
    """Per-rank memory of ``model`` trained with a recipe on ``gpu``, and whether it fits.

    ``model`` is a preset key (``"llama2-7b"``), a :class:`ModelConfig`, or a bare parameter
    count; for a bare count the activations use a GPT shape of that size
    (:func:`~dplab.memory.presets.gpt_shape_for`). Activations follow Korthikanti et al. 2022 in
    16-bit (a GPT-3 block; for the Llama presets an estimate with their h, a and layers).
    """
    if isinstance(model, (str, ModelConfig)):
        config = get_model(model)
        n_params = config.n_params
    else:
        n_params = check_n_params(model)
        config = gpt_shape_for(n_params)
    device = get_gpu(gpu)
    precision = check_precision(precision)
    optimizer = check_optimizer(optimizer)
    check_world_size(world_size)
    check_zero_stage(zero_stage)
    recompute = check_recompute(recompute)
    state = state_bytes(
        n_params,
        world_size=world_size,
        zero_stage=zero_stage,
        precision=precision,
        optimizer=optimizer,
    )
    activations = gpt_activation_bytes(
        seq_len, micro_batch, config.hidden, config.heads, config.layers, recompute=recompute
    )
    return Fit(
        model=config,
        n_params=n_params,
        gpu=device,
        state=state,
        activations=activations,
        micro_batch=micro_batch,
        seq_len=seq_len,
        recompute=recompute,
        min_world_size=min_world_size(
            n_params,
            device.capacity_bytes,
            activations=activations,
            zero_stage=zero_stage,
            precision=precision,
            optimizer=optimizer,
        ),
    )
