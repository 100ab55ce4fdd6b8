"""Notebook hygiene: IPython's output history keeps a displayed Cluster alive.

Re-running ``c = Cluster(2); c`` rebinds ``c``, but ``Out[n]`` still holds the old pool, so its
ranks would live until the kernel dies. After every cell, a pool that only the output history
(``Out``, ``_``, ``_N``) still holds is closed; a pool still bound to a name (or held by a widget,
a list …) is kept.
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
import types
import weakref
from typing import Any

# Every live pool (a Cluster adds itself): the history scan and the exit hook walk it.
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_HISTORY_NAME = re.compile(r"_+|_\d+")


def _ipython_shell() -> Any:
    if "IPython" not in sys.modules:
        return None
    with contextlib.suppress(Exception):
        from IPython import get_ipython

        return get_ipython()
    return None


def _held_only_by_history(cluster: Any, shell: Any) -> bool:
    """True when nothing but IPython's ``Out``/``_``/``_N`` history refers to ``cluster``.

    A pool the user can only reach through the output history is one they have let go of.
    """
    from IPython.core.displayhook import DisplayHook

    ns = shell.user_ns
    out = ns.get("Out")
    # Cheap tests first: a full referrer scan walks the whole heap, so it is done only for a
    # pool that was displayed and is no longer named in the namespace.
    # (Loops, not comprehensions: a comprehension's closure cell would be one more referrer.)
    if not isinstance(out, dict) or not _holds(out, cluster):
        return False
    for key, value in ns.items():
        if value is cluster and not (isinstance(key, str) and _HISTORY_NAME.fullmatch(key)):
            return False
    history = {id(out), id(getattr(shell.history_manager, "output_hist", None))}
    for ref in gc.get_referrers(cluster):
        if isinstance(ref, types.FrameType | DisplayHook) or id(ref) in history:
            continue  # our own frame; the display hook's _, __, ___; Out
        if type(ref).__name__ == "ExecutionResult":
            continue
        if isinstance(ref, dict) and _only_history_names(ref, cluster):
            continue  # the namespace, or a copy of its _, _N entries
        return False
    return True


def _holds(mapping: dict, obj: object) -> bool:
    """Whether ``obj`` itself (by identity, never by ==) is one of the mapping's values."""
    # (a generator's closure cell on obj lives only while this function runs)
    return any(value is obj for value in mapping.values())


def _only_history_names(namespace: dict, obj: object) -> bool:
    names = []
    for key, value in namespace.items():  # a loop, not a comprehension: no closure cell
        if value is obj:
            names.append(key)
    return bool(names) and all(isinstance(k, str) and _HISTORY_NAME.fullmatch(k) for k in names)


def _close_pools_left_in_history(*_: object) -> None:
    """After each cell: close the pools that only the output history still holds."""
    shell = _ipython_shell()
    if shell is None:
        return
    for ref in list(LIVE.data):
        cluster = ref()
        if cluster is not None and cluster.started and _held_only_by_history(cluster, shell):
            cluster.close()
        del cluster


def watch_ipython_history() -> None:
    """In IPython, check after every cell (``c = Cluster(2)`` rebinds ``c`` only after the new
    pool exists, so the old one can be let go of only once the cell is done)."""
    shell = _ipython_shell()
    if shell is None or getattr(shell, "_dplab_watches_history", False):
        return
    with contextlib.suppress(Exception):
        shell.events.register("post_run_cell", _close_pools_left_in_history)
        shell._dplab_watches_history = True
