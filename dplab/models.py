"""Small models with enough layers for buckets to mean something.

``make_model(name)`` builds a preset the same way on every rank (same seed → same weights, though
DDP broadcasts rank 0's anyway); ``make_batch(name, batch_size, seed)`` makes matching data.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from dplab.model_config import GPT_PRESETS, MODELS, GPTConfig

__all__ = [
    "GPT_PRESETS",
    "MLP",
    "MODELS",
    "Block",
    "GPTConfig",
    "TinyGPT",
    "lm_loss",
    "make_batch",
    "make_model",
    "n_params",
    "param_sizes_of",
]


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
    """Pre-norm transformer block: attention then MLP, each with a residual (GPT-2/3 style)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.p_drop, self.attention = cfg.n_heads, cfg.p_drop, cfg.attention
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        if cfg.attention == "explicit":
            causal = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1)
            self.register_buffer("causal", causal, persistent=False)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.attention == "sdpa":
            p = self.p_drop if self.training else 0.0
            return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        s = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        scores = scores.masked_fill(self.causal[:s, :s], float("-inf"))
        return dropout(scores.softmax(dim=-1), self.p_drop, self.training) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = self._attend(q, k, v)
        x = x + dropout(self.proj(y.transpose(1, 2).reshape(b, s, d)), self.p_drop, self.training)
        mlp = self.out(nn.functional.gelu(self.fc(self.ln2(x))))
        return x + dropout(mlp, self.p_drop, self.training)


def _gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases.

    Not a detail: with torch's default N(0, 1) embedding tied to the head, the logits are ~11
    standard deviations wide, softmax underflows to subnormal floats, and on a CPU every matmul
    that touches them runs ~200x slower (measured: 114 ms against 0.5 ms for one 512x512 @
    512x128 product): the backward would spend most of its time in the head.
    """
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class TinyGPT(nn.Module):
    """A GPT in miniature: embeddings, blocks, a final LayerNorm and a head (tied or not)."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        cfg = GPTConfig() if cfg is None else cfg
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        if cfg.gpt2_init:
            self.apply(_gpt2_init)

    @property
    def vocab(self) -> int:
        return self.cfg.vocab

    @property
    def max_seq(self) -> int:
        return self.cfg.seq_len

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; with ``targets``, the mean next-token cross-entropy instead."""
        s = idx.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq={self.cfg.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self, idx, targets)


def lm_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 whatever the model's dtype.

    Takes the model (or a DDP wrapper around it) and calls it, so that a wrapper's forward runs.
    """
    logits = model(idx)
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
    )


class MLP(nn.Module):
    """A stack of Linear + tanh layers: the simplest model with many gradient tensors."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 64, 64, 1)):
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(widths)):
            layers.append(nn.Linear(a, b))
            if i < len(widths) - 2:
                layers.append(nn.Tanh())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.net(x)
        return out if y is None else nn.functional.mse_loss(out, y)


def make_model(
    name: str = "tiny-gpt", *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """A preset model, initialised from ``seed``."""
    torch.manual_seed(seed)
    if name in GPT_PRESETS:
        model: nn.Module = TinyGPT(GPT_PRESETS[name])
    elif name == "mlp":
        model = MLP()
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return model.to(dtype)


def make_batch(
    name: str = "tiny-gpt",
    batch_size: int = 8,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for ``name``: random tokens for a GPT, a smooth target for the MLP."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    g = torch.Generator().manual_seed(seed)
    if name in GPT_PRESETS:
        cfg = GPT_PRESETS[name]
        idx = torch.randint(cfg.vocab, (batch_size, cfg.seq_len + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]
    if name == "mlp":
        x = torch.randn(batch_size, 32, generator=g, dtype=dtype)
        return x, torch.sin(x.sum(dim=1, keepdim=True) / math.sqrt(32))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def param_sizes_of(module: nn.Module) -> dict[str, int]:
    """``{name: gradient bytes}`` in registration order (what ``bucket_map_figure`` wants).

    A tied parameter appears once, as ``named_parameters()`` and DDP see it.
    """
    return {
        name: p.numel() * p.element_size()
        for name, p in module.named_parameters()
        if p.requires_grad
    }


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
