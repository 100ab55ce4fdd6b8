"""Your-turn exercises of §3, checked on real ranks; reference answers in ``solutions``.

Each checker takes the learner's function (and optionally a warm :class:`dplab.Cluster`) and
returns a :class:`CheckResult` that shows itself in the notebook.
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

__all__ = [
    "FAILED",
    "NOT_ATTEMPTED",
    "PASSED",
    "CheckResult",
    "check_accumulation_step",
    "check_average_gradients",
    "check_broadcast_weights",
    "solutions",
]
