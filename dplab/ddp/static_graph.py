"""``static_graph=True``: torch's errors when the graph turns out not to be static.

With a static graph torch's reducer learns, in the first iteration, how many times each
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
