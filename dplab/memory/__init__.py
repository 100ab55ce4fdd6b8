"""§9 The memory wall: bytes per parameter, model state per rank (DP and ZeRO 1/2/3),
activations, presets and "does it fit?".

Data parallelism shards the data, never the model: every rank holds all 16 bytes per parameter
of mixed-precision Adam state, so the bytes per rank do not fall as ranks are added. The
arithmetic modules (activations, fit, presets, recipes, state) import no torch; the
measurements on real tensors live in :mod:`dplab.memory.measure` (one process) and
:mod:`dplab.memory.ranks` (every rank of a DDP job), the small GPT they train in
:mod:`dplab.memory.gpt` (a :class:`dplab.models.TinyGPT`).

Units: bytes everywhere; figures and sentences print decimal GB (10^9 bytes) as the published
figures do, GPU capacities are nominal GiB (2^30 bytes), see :mod:`dplab.memory.presets`.
"""

from dplab._units import GB, GIB
from dplab.memory.activations import (
    RECOMPUTE,
    gpt_activation_bytes,
    gpt_block_activation_bytes,
)
from dplab.memory.fit import Fit, fits, fmt_gb, min_world_size, verdict
from dplab.memory.gpt import MEASURED_GPT, lm_loss, measured_gpt, random_batch
from dplab.memory.measure import (
    block_saved_bytes,
    layernorm_stats_bytes,
    measure_recipe,
    model_saved_bytes,
)
from dplab.memory.presets import GPU, GPUS, LLM_SHAPES, ModelConfig, gpt_shape_for
from dplab.memory.ranks import rank_state
from dplab.memory.recipes import (
    OPTIMIZERS,
    PARTS,
    PRECISIONS,
    BytesPerParam,
    bytes_per_param,
)
from dplab.memory.state import STAGE_LABELS, ZERO_STAGES, StateBytes, model_state_bytes, state_bytes

__all__ = [
    "GB",
    "GIB",
    "GPU",
    "GPUS",
    "LLM_SHAPES",
    "MEASURED_GPT",
    "OPTIMIZERS",
    "PARTS",
    "PRECISIONS",
    "RECOMPUTE",
    "STAGE_LABELS",
    "ZERO_STAGES",
    "BytesPerParam",
    "Fit",
    "ModelConfig",
    "StateBytes",
    "block_saved_bytes",
    "bytes_per_param",
    "fits",
    "fmt_gb",
    "gpt_activation_bytes",
    "gpt_block_activation_bytes",
    "gpt_shape_for",
    "layernorm_stats_bytes",
    "lm_loss",
    "measure_recipe",
    "measured_gpt",
    "min_world_size",
    "model_saved_bytes",
    "model_state_bytes",
    "random_batch",
    "rank_state",
    "state_bytes",
    "verdict",
]
