"""§3, the mechanics of data parallelism, each claim a function that real ranks run.

- :mod:`~dplab.mechanics.gradients`: sharded gradients, all-reduce averaged, equal the
  global-batch gradient (to rounding).
- :mod:`~dplab.mechanics.training`: one configurable DP training run (replica hashes, bytes per
  step, accumulation with its two classic bugs).
- :mod:`~dplab.mechanics.traffic`: :class:`CommCounter`, which counts every collective's bytes.
- :mod:`~dplab.mechanics.batch`: B_global = B_local × N × A.
- :mod:`~dplab.mechanics.accumulation`: activation memory measured with saved-tensor hooks.
- :mod:`~dplab.mechanics.lr_scaling`: the linear scaling rule and warm-up on a real task.
- :mod:`~dplab.mechanics.allreduce`: what the all-reduce computes; the ring on real ranks.
- :mod:`~dplab.mechanics.parallel3d`: where DP sits in 3D parallelism (layout, syncs per step).
- :mod:`~dplab.mechanics.spawned` and :mod:`~dplab.mechanics.course_map`: 00's aside (a cell's
  function in a spawned process) and its map of the lessons, checked against the folder.
"""

from dplab.ddp import accumulate
from dplab.mechanics._common import (
    as_dtype,
    flat_grads,
    flat_params,
    max_abs_diff,
    params_hash,
    rank_and_world,
    shard,
    tensor_hash,
    ulp,
)
from dplab.mechanics.accumulation import SavedTensorMeter, activation_memory, peak_saved_bytes
from dplab.mechanics.allreduce import all_reduce_demo, rank_tensor
from dplab.mechanics.batch import (
    batch_table,
    format_batch_table,
    global_batch_size,
    local_batch_size,
)
from dplab.mechanics.course_map import LessonTimes, last_link, lessons_in, map_links, recorded_times
from dplab.mechanics.gradients import average_over_ranks, gradient, sharded_vs_global
from dplab.mechanics.lr_scaling import (
    CountTask,
    FactorSetup,
    ScalingSetup,
    epochs_to_reach,
    factor_runs,
    log_gap,
    lr_scaling_runs,
    mean_loss_in,
    rates_at_start,
    scaling_summary,
    train_counts,
    warmup_lr,
)
from dplab.mechanics.spawned import SpawnedRun, run_spawned
from dplab.mechanics.traffic import CommCounter, CommRecord, comm_table
from dplab.mechanics.training import (
    broadcast_from_rank0,
    comm_in_phase,
    comm_per_step,
    step_batches,
    train_run,
)

__all__ = [
    "CommCounter",
    "CommRecord",
    "CountTask",
    "FactorSetup",
    "LessonTimes",
    "SavedTensorMeter",
    "ScalingSetup",
    "SpawnedRun",
    "accumulate",
    "activation_memory",
    "all_reduce_demo",
    "as_dtype",
    "average_over_ranks",
    "batch_table",
    "broadcast_from_rank0",
    "comm_in_phase",
    "comm_per_step",
    "comm_table",
    "epochs_to_reach",
    "factor_runs",
    "flat_grads",
    "flat_params",
    "format_batch_table",
    "global_batch_size",
    "gradient",
    "last_link",
    "lessons_in",
    "local_batch_size",
    "log_gap",
    "lr_scaling_runs",
    "map_links",
    "max_abs_diff",
    "mean_loss_in",
    "params_hash",
    "peak_saved_bytes",
    "rank_and_world",
    "rank_tensor",
    "rates_at_start",
    "recorded_times",
    "run_spawned",
    "scaling_summary",
    "shard",
    "sharded_vs_global",
    "step_batches",
    "tensor_hash",
    "train_counts",
    "train_run",
    "ulp",
    "warmup_lr",
]
