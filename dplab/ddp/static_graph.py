"""torch's words for a step whose parameters did not all get their gradients.

Without ``find_unused_parameters`` a parameter with no gradient stops the step
(:func:`unused_error`: torch's reducer text, so a search for it finds torch's advice; raised,
as torch does, at the next forward: that step's gradients stay unreduced). Under
``static_graph=True`` torch's reducer learns, in the first iteration, how many times each
parameter's gradient hook fires (more than once under a reentrant checkpoint or two forwards
before one backward) and which parameters get none; from the second iteration on it marks a
parameter ready when its count is reached, and the unused ones at once, with no search of the
graph. If the graph changes, the counts are wrong, and torch says so in these words
(reducer.cpp); dplab.DDP raises the same messages.
"""

from __future__ import annotations

CHANGED = (
    "Your training graph has changed in this iteration, e.g., one parameter is unused in first "
    "iteration, but then got used in the second iteration. this is not compatible with "
    "static_graph set to True."
)


def unused_error(rank: int, missing: list[int], names: list[str]) -> str:
    """torch's ``ensure_prior_reduction_finished`` text, with the parameters named."""
    import torch.distributed as dist

    text = (
        "Expected to have finished reduction in the prior iteration before starting a new one. "
        "This error indicates that your module has parameters that were not used in producing "
        "loss. You can enable unused parameter detection by passing the keyword argument "
        "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by \n"
        "making sure all `forward` function outputs participate in calculating loss. \n"
        f"Parameter indices which did not receive grad for rank {rank}: "
        f"{' '.join(map(str, missing))}\n"
        f"Parameters which did not receive grad for rank {rank}: {', '.join(names)}"
    )
    if dist.get_debug_level() == dist.DebugLevel.OFF:
        text += (
            "\nIn addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to "
            "either INFO or DETAIL to print out information about which particular parameters "
            "did not receive gradient on this rank as part of this error"
        )
    return text


def changed_graph_error(name: str) -> str:
    """A parameter received more gradients than in the first iteration (or any, if unused)."""
    return f"{CHANGED} Parameter: {name!r}."


def unfinished_error(rank: int, missing: list[int], names: list[str]) -> str:
    """A parameter received fewer gradients than in the first iteration."""
    return (
        "Expected to have finished reduction in the prior iteration before starting a new one. "
        "This error indicates that your training graph has changed in this iteration, e.g., one "
        "parameter is used in first iteration, but then got unused in the second iteration. "
        "this is not compatible with static_graph set to True.\n"
        f"Parameter indices which did not receive grad for rank {rank}: "
        f"{' '.join(map(str, missing))}\n"
        f"Parameters which did not receive grad for rank {rank}: {', '.join(names)}"
    )
