"""§9b Past the wall: the model state sharded across ranks, measured on real ranks.

09 measured the wall: plain data parallelism holds 16 bytes per parameter on every rank, however
many ranks there are. Here the same small GPT runs under DDP, ZeRO-1 (torch's
``ZeroRedundancyOptimizer``) and FSDP2 (``fully_shard``, ZeRO-3, and with
``reshard_after_forward=False``, ZeRO-2-like), and each rank measures what it holds
(:mod:`~dplab.sharding.ranks`) against the paper's accounting (:mod:`~dplab.sharding.formula`),
what it sends (:mod:`~dplab.sharding.wire`) and whether it still averages
(:mod:`~dplab.sharding.averaging`); :mod:`~dplab.sharding.timeline` draws its step on the
course's timeline from ``torch.profiler``. :mod:`~dplab.sharding.compat` finds FSDP2 in the
installed torch, or says it is not there.
"""

from dplab.sharding.averaging import TOLERANCE, Averaging, check_averaging
from dplab.sharding.compat import ShardingUnavailable, fsdp2_available, fully_shard_api
from dplab.sharding.formula import (
    METHOD_LABELS,
    METHODS,
    STAGE_AT_REST,
    check_method,
    expected_state,
    wire_factor,
)
from dplab.sharding.ranks import (
    PHASES,
    SHARDED_GPT,
    ShardedStep,
    global_batch_step,
    rank_batch,
    sharded_model,
    sharded_step,
)
from dplab.sharding.timeline import steps_from_events, traced_sharded_step
from dplab.sharding.wire import (
    ShardedCommCounter,
    WireRow,
    total_wire_bytes,
    wire_rows,
)

__all__ = [
    "METHODS",
    "METHOD_LABELS",
    "PHASES",
    "SHARDED_GPT",
    "STAGE_AT_REST",
    "TOLERANCE",
    "Averaging",
    "ShardedCommCounter",
    "ShardedStep",
    "ShardingUnavailable",
    "WireRow",
    "check_averaging",
    "check_method",
    "expected_state",
    "fsdp2_available",
    "fully_shard_api",
    "global_batch_step",
    "rank_batch",
    "sharded_model",
    "sharded_step",
    "steps_from_events",
    "total_wire_bytes",
    "traced_sharded_step",
    "wire_factor",
    "wire_rows",
]
