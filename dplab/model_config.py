"""The course's model shapes and their names, without torch.

Why apart from :mod:`dplab.models`: the command line lists the models (``--model gpt-7m``) and
the simulator prices them with arithmetic alone; reading a shape must not load torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ATTENTION", "GPT_PRESETS", "MODELS", "GPTConfig"]

ATTENTION = ("sdpa", "explicit")


@dataclass(frozen=True)
class GPTConfig:
    """A GPT's shape, and the few choices that differ between lessons.

    ``attention="sdpa"`` uses torch's fused attention (fast: the DDP lessons time it);
    ``"explicit"`` writes softmax(QKᵀ/√d)V out, so it saves for backward exactly the tensors
    Korthikanti et al. count (the memory lesson measures them). ``p_drop`` > 0 adds dropout with
    a 1-byte mask, as on a GPU. ``gpt2_init`` draws weights as GPT-2 does (see ``_gpt2_init``).
    """

    vocab: int = 512
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    tie_embeddings: bool = True
    p_drop: float = 0.0
    attention: str = "sdpa"
    gpt2_init: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})"
            )
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")


GPT_PRESETS = {
    "tiny-gpt": GPTConfig(vocab=512, seq_len=64, d_model=128, n_layers=4, n_heads=4),
    "gpt-7m": GPTConfig(vocab=4096, seq_len=128, d_model=256, n_layers=8, n_heads=8),
}
MODELS = (*GPT_PRESETS, "mlp")
