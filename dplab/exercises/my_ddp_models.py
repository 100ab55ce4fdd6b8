"""The small models ``check_my_ddp`` trains, each catching a different mistake.

Float64 and tiny, so that a full check on two CPU cores takes seconds and the only differences
from torch's DDP allowed are the order of sums. The sizes are uneven on purpose: cutting the
buckets from the front instead of the back, or bucketing the frozen layer, gives other bucket
sizes, which the checker can see from what each all-reduce carried.

- ``mlp``: three Linear layers of different widths (six gradient tensors);
- ``tied``: an embedding whose weight is also the output head (one tensor, two uses, one
  gradient: its hook must fire once, after both contributions are in);
- ``frozen``: a first layer with ``requires_grad=False`` (no gradient, so no all-reduce).
"""

from __future__ import annotations

import torch
from torch import nn

DTYPE = torch.float64
MODELS = ("mlp", "tied", "frozen")
BATCH = 8  # per rank


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 12), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(torch.tanh(self.l0(x))))
        return nn.functional.mse_loss(self.l2(h), y)


class Tied(nn.Module):
    def __init__(self, vocab: int = 12, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.emb(idx)))
        logits = h @ self.emb.weight.T  # the head is the embedding, transposed
        return nn.functional.cross_entropy(logits, y)


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(6, 10), nn.Linear(10, 10), nn.Linear(10, 3)
        self.l0.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(torch.tanh(self.l0(x))))
        return nn.functional.mse_loss(self.l2(h), y)


def build(name: str, seed: int = 0) -> nn.Module:
    """The same weights on every rank and for every copy (the oracle's and the learner's)."""
    torch.manual_seed(seed)
    model = {"mlp": MLP, "tied": Tied, "frozen": Frozen}[name]()
    return model.to(DTYPE)


def batch(name: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of step ``step``: every rank sees different samples."""
    g = torch.Generator().manual_seed(1000 * step + rank + 1)
    if name == "tied":
        idx = torch.randint(12, (BATCH,), generator=g)
        return idx, torch.randint(12, (BATCH,), generator=g)
    width_in, width_out = {"mlp": (8, 4), "frozen": (6, 3)}[name]
    x = torch.randn(BATCH, width_in, generator=g, dtype=DTYPE)
    return x, torch.randn(BATCH, width_out, generator=g, dtype=DTYPE)


class Stack(nn.Module):
    """``layers`` equal square layers (no biases): every gradient tensor the same size, which
    is the model the bucket-size derivation of 08b assumes. Float32, for timing."""

    def __init__(self, layers: int = 16, width: int = 256) -> None:
        super().__init__()
        self.width = width
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.mse_loss(x, y)

    def batch(self, size: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(size, self.width, generator=g)
        return x, torch.tanh(torch.randn(size, self.width, generator=g))
