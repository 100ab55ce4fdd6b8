"""The GPT the memory lesson measures: :class:`dplab.models.TinyGPT`, set up as the paper counts.

Each block: LayerNorm → fused QKV → causal softmax attention (written out, not fused) → dropout →
projection → dropout → residual → LayerNorm → 4h GeLU MLP → dropout → residual, with an untied
head. Small enough to train a step in well under a second on a CPU, big enough (about a million
parameters) that the few bytes outside the 16 per parameter (Adam's step counters) stay far
below 1%.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dplab.models import GPTConfig, TinyGPT, lm_loss

__all__ = ["MEASURED_GPT", "TinyGPT", "lm_loss", "measured_gpt", "random_batch"]

# Korthikanti et al.'s block: explicit attention (its softmax and mask are saved), dropout 0.1,
# an untied head, torch's default initialisation.
MEASURED_GPT = GPTConfig(
    vocab=512,
    seq_len=64,
    d_model=128,
    n_layers=4,
    n_heads=4,
    tie_embeddings=False,
    p_drop=0.1,
    attention="explicit",
    gpt2_init=False,
)


def measured_gpt(**fields: Any) -> TinyGPT:
    """The measured GPT with some :class:`~dplab.models.GPTConfig` fields changed."""
    return TinyGPT(dataclasses.replace(MEASURED_GPT, **fields))


def random_batch(
    vocab: int, micro_batch: int, seq_len: int, *, seed: int = 0, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]
