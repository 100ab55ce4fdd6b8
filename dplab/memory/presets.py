"""Model and GPU presets. Parameter counts are *computed* from each architecture's config.

Model configs are the published ones (the ``config.json`` each model ships with): vocabulary,
hidden size, MLP intermediate size, layers, attention heads, key/value heads (grouped-query
attention when fewer than the heads) and whether the output head shares the embedding matrix.

* GPT-2 (Radford et al. 2019): learned position embeddings, LayerNorm with weight and bias,
  biases on every linear layer, a 4h GeLU MLP, output head tied to the token embedding.
* Llama 2/3 (Touvron et al. 2023; Meta 2024): rotary positions (no parameters), RMSNorm with a
  weight only, no biases, a SwiGLU MLP (gate, up, down), an untied output head.

GPU capacities are the vendors' nominal HBM sizes. Vendors write "80 GB", but HBM stacks come in
binary sizes, so the nominal figure is taken as GiB (2^30 bytes): an "80 GB" H100 is modelled as
80 GiB = 85.9 GB. It is an upper bound on what a program can allocate: torch reports an H100
80GB as 79.11 GiB total (the rest goes to the driver), an A100-SXM4-40GB as 39.39 GiB.

Peak dense bf16 tensor-core FLOP/s, where given, are the datasheets' figures without 2:4
sparsity (the datasheets print the sparse figure, twice the dense one, with a footnote): NVIDIA
A100 Tensor Core GPU datasheet, "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*" (SXM and PCIe
alike); NVIDIA H100 Tensor Core GPU datasheet, H100 SXM "BFLOAT16 Tensor Core 1,979 teraFLOPS*"
(989.4 dense; the H200 datasheet gives the same). They are peaks: a real training step reaches a
fraction of them (its model FLOPs utilisation).
"""

from __future__ import annotations

from dataclasses import dataclass

from dplab._units import GIB


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's shape; :attr:`n_params` is computed from it."""

    key: str
    name: str
    family: str  # "gpt2" or "llama"
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    max_seq: int
    tied_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params_per_layer(self) -> int:
        h, i = self.hidden, self.intermediate
        if self.family == "gpt2":
            attention = (h * 3 * h + 3 * h) + (h * h + h)  # fused QKV and projection, with bias
            mlp = (h * i + i) + (i * h + h)
            norms = 2 * (2 * h)  # two LayerNorms, weight and bias
            return attention + mlp + norms
        kv = self.kv_heads * self.head_dim
        attention = h * h + 2 * h * kv + h * h  # q, k, v (grouped), o; no bias
        mlp = 3 * h * i  # gate, up, down
        norms = 2 * h  # two RMSNorms, weight only
        return attention + mlp + norms

    @property
    def n_params(self) -> int:
        h = self.hidden
        embeddings = self.vocab * h
        if self.family == "gpt2":
            embeddings += self.max_seq * h  # learned positions
            final_norm = 2 * h
        else:
            final_norm = h
        head = 0 if self.tied_embeddings else self.vocab * h
        return embeddings + self.layers * self.params_per_layer + final_norm + head


def _llama(key, name, vocab, hidden, intermediate, layers, heads, kv_heads, max_seq):
    return ModelConfig(
        key, name, "llama", vocab, hidden, intermediate, layers, heads, kv_heads, max_seq, False
    )


LLM_SHAPES: dict[str, ModelConfig] = {
    m.key: m
    for m in [
        ModelConfig("gpt2-124m", "GPT-2 124M", "gpt2", 50257, 768, 3072, 12, 12, 12, 1024, True),
        _llama("llama2-7b", "Llama 2 7B", 32000, 4096, 11008, 32, 32, 32, 4096),
        _llama("llama2-13b", "Llama 2 13B", 32000, 5120, 13824, 40, 40, 40, 4096),
        _llama("llama2-70b", "Llama 2 70B", 32000, 8192, 28672, 80, 64, 8, 4096),
        _llama("llama3-8b", "Llama 3 8B", 128256, 4096, 14336, 32, 32, 8, 8192),
        _llama("llama3-70b", "Llama 3 70B", 128256, 8192, 28672, 80, 64, 8, 8192),
        _llama("llama3-405b", "Llama 3.1 405B", 128256, 16384, 53248, 126, 128, 8, 8192),
    ]
}


@dataclass(frozen=True)
class GPU:
    """An accelerator, its nominal memory (taken as GiB) and, where the module docstring quotes
    its datasheet, its peak dense bf16 FLOP/s (None where it does not)."""

    key: str
    name: str
    memory_gib: int
    bf16_tflops: float | None = None

    @property
    def capacity_bytes(self) -> int:
        return self.memory_gib * GIB

    @property
    def short_name(self) -> str:
        return self.name.split()[0]


GPUS: dict[str, GPU] = {
    g.key: g
    for g in [
        GPU("a100-40gb", "A100 40GB", 40, bf16_tflops=312.0),
        GPU("a100-80gb", "A100 80GB", 80, bf16_tflops=312.0),
        GPU("h100-80gb", "H100 80GB", 80, bf16_tflops=989.4),
        GPU("h200-141gb", "H200 141GB", 141, bf16_tflops=989.4),
        GPU("b200-192gb", "B200 192GB", 192),
        GPU("mi300x-192gb", "MI300X 192GB", 192),
    ]
}


def get_model(key: object) -> ModelConfig:
    if isinstance(key, ModelConfig):
        return key
    if key not in LLM_SHAPES:
        raise ValueError(f"model must be one of {list(LLM_SHAPES)}, got {key!r}")
    return LLM_SHAPES[key]


def get_gpu(key: object) -> GPU:
    if isinstance(key, GPU):
        return key
    if key not in GPUS:
        raise ValueError(f"gpu must be one of {list(GPUS)}, got {key!r}")
    return GPUS[key]


def gpt_shape_for(n_params: int) -> ModelConfig:
    """A GPT-3 style shape of about ``n_params`` parameters, for activations of a bare count.

    A parameter count alone does not say how big the activations are; this picks the usual
    aspect ratio of large models (hidden = 128 × layers, heads of 128, 4h MLP, 12·h² parameters
    per layer) so that a slider over parameter counts can still show activations.
    """
    layers = max(1, round((n_params / (12 * 128 * 128)) ** (1 / 3)))
    hidden = 128 * layers
    return ModelConfig(
        key="custom",
        name=f"GPT shape ({layers} layers, hidden {hidden})",
        family="gpt2",
        vocab=50257,
        hidden=hidden,
        intermediate=4 * hidden,
        layers=layers,
        heads=max(1, hidden // 128),
        kv_heads=max(1, hidden // 128),
        max_seq=2048,
        tied_embeddings=True,
    )
