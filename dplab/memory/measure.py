"""Measure memory on real tensors: the bytes a training step holds, and what autograd saves.

Model state is measured by walking what is alive after one optimizer step — the model's
parameters and their ``.grad``, and every tensor the optimizer keeps — and adding up the bytes of
each *storage* once. Counting storages, not tensors, is what makes the sum honest: a gradient that
is a view into a DDP bucket, or a weight shared by two layers, occupies memory once.

Activations are measured with ``torch.autograd.graph.saved_tensors_hooks``: every tensor an
operation saves for its backward passes through the hook, and the unique storages among them are
the activation memory (parameters and buffers, saved by reference, are model state and excluded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dplab.memory.gpt import MEASURED_GPT, measured_gpt, random_batch
from dplab.memory.mixed import MixedPrecisionOptimizer
from dplab.memory.recipes import PARTS, check_optimizer, check_precision
from dplab.models import Block, TinyGPT, lm_loss

MEASURE_PARTS = (*PARTS, "buffers")


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    st = t.untyped_storage()
    nbytes = st.nbytes()
    if nbytes == 0:
        return None
    return (st.data_ptr(), nbytes)


def storage_bytes_by_part(parts: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes per part, each storage counted once, in the first part (in order) that holds it."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    for part, tensors in parts.items():
        total = 0
        for t in tensors:
            key = _storage_key(t)
            if key is None or key in seen:
                continue
            seen.add(key)
            total += key[1]
        out[part] = total
    return out


def held_tensors(model: nn.Module, optimizer: Any) -> dict[str, list[torch.Tensor]]:
    """What a model and its optimizer hold, by part: weights, grads, master weights, optimizer
    state, buffers. Works for :class:`MixedPrecisionOptimizer` and any ``torch.optim`` optimizer
    (whose state tensors — moments, momentum buffers, step counters — are optimizer state)."""
    params = list(model.parameters())
    held: dict[str, list[torch.Tensor]] = {part: [] for part in MEASURE_PARTS}
    held["weights"] = params
    held["grads"] = [p.grad for p in params if p.grad is not None]
    if isinstance(optimizer, MixedPrecisionOptimizer):
        for part, tensors in optimizer.state_tensors().items():
            held[part].extend(tensors)
    else:
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps one
        for state in inner.state.values():
            held["optimizer_state"].extend(v for v in state.values() if torch.is_tensor(v))
    held["buffers"] = list(model.buffers())
    return held


@dataclass
class MeasuredState:
    """Bytes one replica holds after an optimizer step, by part, and per parameter."""

    n_params: int
    parts: dict[str, int]  # weights, grads, master_weights, optimizer_state, buffers
    precision: str = ""
    optimizer: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def state_bytes(self) -> int:
        """Model state: everything but the (non-parameter) buffers."""
        return sum(self.parts[p] for p in PARTS)

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / self.n_params

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_params": self.n_params,
            "parts": dict(self.parts),
            "precision": self.precision,
            "optimizer": self.optimizer,
            "state_bytes": self.state_bytes,
            "bytes_per_param": self.bytes_per_param,
            **self.extra,
        }


def measure_held(model: nn.Module, opt: Any, **meta: Any) -> MeasuredState:
    """Measure what ``model`` and its optimizer ``opt`` hold right now."""
    n = sum(p.numel() for p in model.parameters())
    parts = storage_bytes_by_part(held_tensors(model, opt))
    return MeasuredState(n_params=n, parts=parts, **meta)


def make_recipe(
    model: nn.Module, precision: str = "mixed", optimizer: str = "adam", *, lr: float = 1e-3
) -> tuple[nn.Module, Any]:
    """Cast ``model`` for a recipe and build its optimizer.

    ``fp32`` and pure ``bf16`` use torch's own optimizers (their state takes the parameters'
    dtype); ``mixed`` and ``mixed_fp32_grads`` use :class:`MixedPrecisionOptimizer` over bf16
    parameters.
    """
    precision = check_precision(precision)
    optimizer = check_optimizer(optimizer)
    # 16-bit recipes keep bf16 parameters (bf16 needs no loss scaling, unlike fp16)
    model = model.to(torch.float32 if precision == "fp32" else torch.bfloat16)
    if precision in ("mixed", "mixed_fp32_grads"):
        accum = torch.float32 if precision == "mixed_fp32_grads" else None
        return model, MixedPrecisionOptimizer(
            model.parameters(), optimizer=optimizer, lr=lr, grad_accum_dtype=accum
        )
    params = model.parameters()
    if optimizer == "adam":
        return model, torch.optim.AdamW(params, lr=lr, foreach=False)
    momentum = 0.9 if optimizer == "momentum" else 0.0
    return model, torch.optim.SGD(params, lr=lr, momentum=momentum, foreach=False)


def train_step(
    model: nn.Module,
    optimizer: Any,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Forward and backward each micro-batch (gradients add up), then one optimizer step.

    Gradients are left in place after the step: at the end of a step they are part of what a
    rank holds, which is what the measurement wants to see.
    """
    loss_fn = loss_fn or lm_loss
    total = 0.0
    accumulate = isinstance(optimizer, MixedPrecisionOptimizer) and optimizer.main_grads is not None
    for x, y in batches:
        loss = loss_fn(model, x, y) / len(batches)
        loss.backward()
        if accumulate:
            optimizer.accumulate()
        total += float(loss.detach())
    optimizer.step()
    return total


def measure_recipe(
    precision: str = "mixed",
    optimizer: str = "adam",
    *,
    model_kwargs: dict[str, Any] | None = None,
    micro_batch: int = 2,
    seq_len: int = 32,
    seed: int = 0,
) -> MeasuredState:
    """Build a :class:`TinyGPT`, train one step with a recipe, measure what it holds."""
    torch.manual_seed(seed)
    model, opt = make_recipe(measured_gpt(**(model_kwargs or {})), precision, optimizer)
    batch = random_batch(model.vocab, micro_batch, seq_len, seed=seed)
    train_step(model, opt, [batch])
    return measure_held(model, opt, precision=precision, optimizer=optimizer)


class SavedTensors:
    """Inside ``with SavedTensors(model) as saved:``, record what autograd saves for backward.

    ``saved.nbytes`` is the bytes of the unique storages saved, excluding the parameters and
    buffers of the modules given (those are model state, not activations). ``saved.by_dtype``
    splits the bytes by dtype.
    """

    def __init__(self, *modules: nn.Module):
        self._exclude = {
            _storage_key(t) for m in modules for t in (*m.parameters(), *m.buffers())
        } - {None}
        self._seen: dict[tuple[int, int], torch.dtype] = {}
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._exclude:
            self._seen.setdefault(key, t.dtype)
        return t

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(key[1] for key in self._seen)

    @property
    def by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, nbytes), dtype in self._seen.items():
            name = str(dtype).removeprefix("torch.")
            out[name] = out.get(name, 0) + nbytes
        return out


def block_saved_bytes(
    seq_len: int,
    micro_batch: int,
    *,
    hidden: int = 64,
    heads: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> SavedTensors:
    """Run one block of the measured GPT forward in training mode; what did it save?"""
    torch.manual_seed(0)
    cfg = dataclasses.replace(MEASURED_GPT, d_model=hidden, n_heads=heads, seq_len=max(seq_len, 1))
    block = Block(cfg).to(device=device, dtype=dtype).train()
    x = torch.randn(micro_batch, seq_len, hidden, dtype=dtype, device=device, requires_grad=True)
    with SavedTensors(block) as saved:
        block(x)
    return saved


def layernorm_stats_bytes(seq_len: int, micro_batch: int, stat_bytes: int) -> int:
    """What Korthikanti leave out: each of a block's two LayerNorms also saves a mean and a
    reciprocal standard deviation per token (bf16 on a CPU, fp32 on CUDA)."""
    return 2 * 2 * seq_len * micro_batch * stat_bytes


def model_saved_bytes(
    model: TinyGPT, micro_batch: int, seq_len: int, *, seed: int = 0
) -> SavedTensors:
    """What a whole :class:`TinyGPT` forward and loss save for backward at one micro-batch."""
    x, y = random_batch(model.vocab, micro_batch, seq_len, seed=seed)
    with SavedTensors(model) as saved:
        model.loss(x, y)
    return saved
