"""A small GPT whose block is exactly the one Korthikanti et al. count, to measure on real tensors.

Each block: LayerNorm → fused QKV → causal softmax attention → dropout → projection → dropout →
residual → LayerNorm → 4h GeLU MLP → dropout → residual. Small enough to train a step in well
under a second on a CPU, big enough (about a million parameters) that the few bytes outside the
16 per parameter (Adam's step counters) stay far below 1%.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout that keeps a 1-byte mask for backward, as on a GPU.

    On a CPU ``F.dropout`` multiplies by a noise tensor of the input's dtype and saves that for
    backward; on CUDA it calls ``native_dropout``, which saves a bool mask. Calling
    ``native_dropout`` everywhere makes a CPU measurement hold what a GPU holds (and what the
    paper counts: 1 byte per masked element).
    """
    if not training or p == 0.0:
        return x
    return torch.native_dropout(x, p, True)[0]


class Block(nn.Module):
    """One GPT-3 style transformer block (pre-LayerNorm)."""

    def __init__(self, hidden: int, heads: int, *, max_seq: int = 1024, p_drop: float = 0.1):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
        self.hidden, self.heads, self.p_drop = hidden, heads, p_drop
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        causal = torch.ones(max_seq, max_seq, dtype=torch.bool).triu(1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        a, d = self.heads, h // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, a, d).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        scores = scores.masked_fill(self.causal[:s, :s], float("-inf"))
        attn = dropout(scores.softmax(dim=-1), self.p_drop, self.training)
        y = (attn @ v).transpose(1, 2).reshape(b, s, h)
        x = x + dropout(self.proj(y), self.p_drop, self.training)
        mlp = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + dropout(mlp, self.p_drop, self.training)


class TinyGPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm and an untied head."""

    def __init__(
        self,
        *,
        vocab: int = 512,
        hidden: int = 128,
        heads: int = 4,
        layers: int = 4,
        max_seq: int = 64,
        p_drop: float = 0.1,
    ):
        super().__init__()
        self.vocab, self.max_seq = vocab, max_seq
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList(
            Block(hidden, heads, max_seq=max_seq, p_drop=p_drop) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        if s > self.max_seq:
            raise ValueError(f"sequence length {s} exceeds max_seq={self.max_seq}")
        x = self.tok(idx) + self.pos(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self, idx, targets)


def lm_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 whatever the model's dtype.

    Takes the model (or a DDP wrapper around it) and calls it, so that a wrapper's forward runs.
    """
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def n_params(module: nn.Module) -> int:
    """Parameters of a module, each shared parameter counted once."""
    return sum(p.numel() for p in module.parameters())


def random_batch(
    vocab: int, micro_batch: int, seq_len: int, *, seed: int = 0, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]
