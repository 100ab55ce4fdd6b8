"""Bytes per parameter: what one replica must hold for every parameter it trains.

A training recipe is a *precision* (how weights, gradients and the optimizer's copy are stored)
and an *optimizer* (how many running statistics it keeps per parameter). The model state per
parameter is the sum of four parts, and these four parts are what ZeRO later shards one by one:

========================  =======  =====  ==============  ================================
precision                 weights  grads  master weights  each optimizer statistic
========================  =======  =====  ==============  ================================
``fp32``                  4        4      0 (weights are)  4
``mixed`` (bf16/fp16)     2        2      4                4
``mixed_fp32_grads``      2        2 + 4  4                4
``bf16`` (pure)           2        2      0                2
========================  =======  =====  ==============  ================================

``mixed_fp32_grads`` keeps a persistent fp32 copy of every gradient to accumulate micro-batches
in (Megatron's ``main_grad``); it counts under *grads*. Optimizers keep 0 (SGD), 1 (SGD with
momentum) or 2 (Adam/AdamW: first and second moments) statistics per parameter.

So mixed-precision Adam costs 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter, the ZeRO paper's
"2Ψ + 2Ψ + KΨ with K = 12" (Rajbhandari et al. 2020), and a 7B model needs 112 GB before a
single activation is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

# precision → (weights, grads, master weights, bytes of one optimizer statistic)
PRECISIONS: dict[str, tuple[int, int, int, int]] = {
    "fp32": (4, 4, 0, 4),
    "mixed": (2, 2, 4, 4),
    "mixed_fp32_grads": (2, 6, 4, 4),
    "bf16": (2, 2, 0, 2),
}

PRECISION_LABELS = {
    "fp32": "fp32",
    "mixed": "mixed precision (bf16 + fp32 master)",
    "mixed_fp32_grads": "mixed precision + fp32 grad accumulation",
    "bf16": "pure bf16",
}

# optimizer → number of per-parameter statistics it keeps
OPTIMIZERS: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}

OPTIMIZER_LABELS = {"sgd": "SGD", "momentum": "SGD + momentum", "adam": "Adam / AdamW"}

# other spellings people type
_OPTIMIZER_ALIASES = {"adamw": "adam", "sgd_momentum": "momentum", "sgd+momentum": "momentum"}
_PRECISION_ALIASES = {"fp16": "mixed", "bf16_mixed": "mixed", "amp": "mixed", "float32": "fp32"}

# The four parts of model state, in the order ZeRO shards them from last to first:
# stage 1 shards the optimizer's (master_weights, optimizer_state), stage 2 also grads,
# stage 3 also weights.
PARTS = ("weights", "grads", "master_weights", "optimizer_state")


def check_precision(precision: object) -> str:
    """The canonical name of a precision, or a ValueError naming the bad value."""
    if isinstance(precision, str):
        key = precision.strip().lower()
        key = _PRECISION_ALIASES.get(key, key)
        if key in PRECISIONS:
            return key
    raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")


def check_optimizer(optimizer: object) -> str:
    """The canonical name of an optimizer, or a ValueError naming the bad value."""
    if isinstance(optimizer, str):
        key = optimizer.strip().lower()
        key = _OPTIMIZER_ALIASES.get(key, key)
        if key in OPTIMIZERS:
            return key
    raise ValueError(
        f"optimizer must be one of {sorted(OPTIMIZERS)} (or 'adamw'), got {optimizer!r}"
    )


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes one replica holds per parameter, split into the parts ZeRO shards."""

    weights: int
    grads: int
    master_weights: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master_weights + self.optimizer_state

    @property
    def optimizer_side(self) -> int:
        """The ZeRO paper's K: what stage 1 shards (master weights + optimizer statistics)."""
        return self.master_weights + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        return {part: getattr(self, part) for part in PARTS}


def bytes_per_param(precision: str = "mixed", optimizer: str = "adam") -> BytesPerParam:
    """Bytes per parameter of a recipe: ``bytes_per_param().total == 16`` (mixed precision Adam).

    >>> bytes_per_param("mixed_fp32_grads", "adam").total
    20
    >>> bytes_per_param("fp32", "sgd").total
    8
    """
    w, g, master, stat = PRECISIONS[check_precision(precision)]
    n_stats = OPTIMIZERS[check_optimizer(optimizer)]
    return BytesPerParam(weights=w, grads=g, master_weights=master, optimizer_state=n_stats * stat)
