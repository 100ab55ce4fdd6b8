"""Activation memory of a GPT block: what the forward pass saves for the backward pass.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1)
count the tensors a GPT-3 style block (LayerNorm → QKV → softmax attention with dropout →
projection → dropout → LayerNorm → 4h GeLU MLP → dropout) keeps for backward, with sequence
length s, micro-batch b, hidden size h and a attention heads:

* 16 tensors of s·b·h elements: LayerNorm inputs (2), QKV input, Q, K, V, projection input,
  MLP input, GeLU input (4), second MLP linear input (4), counted in h-wide units;
* 2 dropout masks of s·b·h elements (after the projection and after the MLP);
* 2 tensors of a·s²·b elements (softmax output, attention dropout output) and 1 mask of a·s²·b.

With 2-byte activations and 1-byte masks that is s·b·h·(34 + 5·a·s/h) bytes per layer. The
general form below lets a measurement use its own element and mask sizes (fp32 on a CPU).
Everything is proportional to the micro-batch b: that is why gradient accumulation (smaller
micro-batches, same global batch) lowers activation memory, and why the quadratic a·s²·b term
dominates at long sequences.

Recomputation trades compute for memory: ``"selective"`` recomputes the attention core and
drops the a·s²·b term (34·s·b·h per layer); ``"full"`` keeps only each layer's input
(2·s·b·h per layer in 16-bit) and recomputes the rest in the backward pass.

The a·s²·b term exists only where the softmax is *materialised* (``attention="explicit"``, what
the paper counts). A fused kernel (``torch.nn.functional.scaled_dot_product_attention``, which
dplab's DDP lessons use: ``attention="sdpa"``) never stores the s×s matrix; for its backward it
keeps its output (the projection's input, already counted) and one fp32 log-sum-exp per head
and token, a·s·b·4 bytes. Without dropout (``dropout=False``: no masks, and the explicit block
saves the softmax output once) both cases are measured exactly in ``tests/test_memory.py``.
SDPA *with* dropout is not modelled: what it saves depends on the kernel (CUDA's flash kernel
keeps an RNG state, not a mask; the CPU falls back to an unfused path that stores more).
"""

from __future__ import annotations

from numbers import Integral

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("explicit", "sdpa")
LSE_BYTES = 4  # SDPA's log-sum-exp is fp32 whatever the activations' dtype

# element counts per layer, in units of s·b·h and a·s²·b (see the module docstring)
SBH_TENSORS = 16
SBH_MASKS = 2
AS2B_TENSORS = 2
AS2B_MASKS = 1


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_recompute(recompute: object) -> str:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    return str(recompute)


def check_attention(attention: object) -> str:
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    return str(attention)


def gpt_block_activation_bytes(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    *,
    act_bytes: int = 2,
    mask_bytes: int = 1,
    recompute: str = "none",
    attention: str = "explicit",
    dropout: bool = True,
) -> int:
    """Bytes one GPT block saves for backward (Korthikanti et al. 2022, Table 2, no parallelism).

    ``attention="sdpa"``: a fused attention kernel, no s×s matrix (see the module docstring);
    ``dropout=False``: a block without dropout (no masks).

    >>> s, b, h, a = 2048, 1, 4096, 32
    >>> gpt_block_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    True
    >>> gpt_block_activation_bytes(s, b, h, a, attention="sdpa", dropout=False) == (
    ...     s * b * h * 32 + 4 * a * s * b)
    True
    """
    s = _positive_int("seq_len", seq_len)
    b = _positive_int("micro_batch", micro_batch)
    h = _positive_int("hidden", hidden)
    a = _positive_int("heads", heads)
    act = _positive_int("act_bytes", act_bytes)
    mask = _positive_int("mask_bytes", mask_bytes)
    mode = check_recompute(recompute)
    kind = check_attention(attention)
    if h % a:
        raise ValueError(f"hidden ({h}) must be a multiple of heads ({a})")
    if not isinstance(dropout, bool):
        raise ValueError(f"dropout must be True or False, got {dropout!r}")
    if kind == "sdpa" and dropout:
        raise ValueError(
            "attention='sdpa' with dropout is not modelled (what it saves depends on the "
            "kernel); pass dropout=False"
        )
    sbh, as2b = s * b * h, a * s * s * b
    if mode == "full":
        return act * sbh
    per_layer = (SBH_TENSORS * act + (SBH_MASKS * mask if dropout else 0)) * sbh
    if mode == "none":
        if kind == "sdpa":
            per_layer += LSE_BYTES * a * s * b
        elif dropout:
            per_layer += (AS2B_TENSORS * act + AS2B_MASKS * mask) * as2b
        else:  # no dropout: the softmax output is the one a·s²·b tensor saved
            per_layer += act * as2b
    return per_layer


def gpt_activation_bytes(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    layers: int,
    *,
    act_bytes: int = 2,
    mask_bytes: int = 1,
    recompute: str = "none",
    attention: str = "explicit",
    dropout: bool = True,
) -> int:
    """All blocks of a GPT: ``layers`` × one block (embeddings and logits not counted)."""
    n_layers = _positive_int("layers", layers)
    return n_layers * gpt_block_activation_bytes(
        seq_len,
        micro_batch,
        hidden,
        heads,
        act_bytes=act_bytes,
        mask_bytes=mask_bytes,
        recompute=recompute,
        attention=attention,
        dropout=dropout,
    )
