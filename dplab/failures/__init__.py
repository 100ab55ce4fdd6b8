"""When DP goes wrong or hangs: the failures people really hit, as rank functions (§8d, §8e).

Each module reproduces one failure on real ranks, and its fix, bounded in time: every
experiment runs on a fresh gloo group with a short ``timeout``
(:func:`~dplab.failures._common.short_group`), so a rank waiting for a partner that never comes
raises in seconds and the pool stays usable. Each returns a small dataclass the lesson asserts
on. Most run torch's own ``DistributedDataParallel``: the failures are what torch does and
says, and its messages are what a learner will meet on a cluster.
"""

from dplab.failures.batchnorm import TwoForwards, two_forwards
from dplab.failures.checkpointing import CheckpointRun, checkpointed_ddp
from dplab.failures.compiled import CompiledRun, compiled_ddp, graphs_under_dplab_ddp
from dplab.failures.job import JobRun, run_job
from dplab.failures.no_sync import PLACEMENTS, NoSyncRun, no_sync_run
from dplab.failures.ragged import RaggedLoss, ragged_loss
from dplab.failures.rank0_work import EvalRun, rank0_evaluates
from dplab.failures.sampler import EvalCount, distributed_accuracy, epoch_orders, is_correct
from dplab.failures.seeding import SeedRun, augmentations_seen
from dplab.failures.setup_errors import SetupErrors, setup_errors
from dplab.failures.straggler import straggler_steps
from dplab.failures.uneven import JoinRun, uneven_with_join, uneven_without_join
from dplab.failures.unused import (
    FindUnusedCost,
    UnusedParameters,
    find_unused_cost,
    unused_parameters,
)

__all__ = [
    "PLACEMENTS",
    "CheckpointRun",
    "CompiledRun",
    "EvalCount",
    "EvalRun",
    "FindUnusedCost",
    "JobRun",
    "JoinRun",
    "NoSyncRun",
    "RaggedLoss",
    "SeedRun",
    "SetupErrors",
    "TwoForwards",
    "UnusedParameters",
    "augmentations_seen",
    "checkpointed_ddp",
    "compiled_ddp",
    "distributed_accuracy",
    "epoch_orders",
    "find_unused_cost",
    "graphs_under_dplab_ddp",
    "is_correct",
    "no_sync_run",
    "ragged_loss",
    "rank0_evaluates",
    "run_job",
    "setup_errors",
    "straggler_steps",
    "two_forwards",
    "uneven_with_join",
    "uneven_without_join",
    "unused_parameters",
]
