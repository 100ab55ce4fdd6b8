"""Your-turn exercises, checked on real ranks; reference answers in ``solutions``.

:mod:`~dplab.exercises.checks` holds §3's mechanics checkers, :mod:`~dplab.exercises.ddp` §8's
DDP checker (which buckets are exposed) and :mod:`~dplab.exercises.my_ddp` §8b's checker of the
learner's own DDP, side by side. Each checker takes the learner's function
(and optionally a warm :class:`dplab.Cluster`) and returns a :class:`CheckResult` that shows
itself in the notebook.
"""

from dplab.exercises import solutions
from dplab.exercises.checks import (
    FAILED,
    NOT_ATTEMPTED,
    PASSED,
    CheckResult,
    check_accumulation_step,
    check_average_gradients,
    check_broadcast_weights,
)
from dplab.exercises.ddp import check_exposed_buckets
from dplab.exercises.my_ddp import check_my_ddp
from dplab.exercises.zero1 import NoBroadcastShardedOptimizer, ShardedOptimizer, check_my_zero1

__all__ = [
    "FAILED",
    "NOT_ATTEMPTED",
    "PASSED",
    "CheckResult",
    "NoBroadcastShardedOptimizer",
    "ShardedOptimizer",
    "check_accumulation_step",
    "check_average_gradients",
    "check_broadcast_weights",
    "check_exposed_buckets",
    "check_my_ddp",
    "check_my_zero1",
    "solutions",
]
