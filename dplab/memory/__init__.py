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

from dplab._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    globals(),
    {
        "dplab._units": ["GB", "GIB"],
        "dplab.memory.activations": [
            "RECOMPUTE",
            "gpt_activation_bytes",
            "gpt_block_activation_bytes",
        ],
        "dplab.memory.fit": ["Fit", "fits", "fmt_gb", "min_world_size", "verdict"],
        "dplab.memory.gpt": ["MEASURED_GPT", "lm_loss", "measured_gpt", "random_batch"],
        "dplab.memory.measure": [
            "block_saved_bytes",
            "layernorm_stats_bytes",
            "measure_recipe",
            "model_saved_bytes",
        ],
        "dplab.memory.presets": ["GPU", "GPUS", "LLM_SHAPES", "ModelConfig", "gpt_shape_for"],
        "dplab.memory.ranks": ["rank_state"],
        "dplab.memory.recipes": [
            "OPTIMIZERS",
            "PARTS",
            "PRECISIONS",
            "BytesPerParam",
            "bytes_per_param",
        ],
        "dplab.memory.state": [
            "STAGE_LABELS",
            "ZERO_STAGES",
            "StateBytes",
            "model_state_bytes",
            "state_bytes",
        ],
    },
)
