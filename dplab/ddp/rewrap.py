"""The re-wrap guard: a module wrapped again detaches its old dplab.DDP.

A notebook cell ``ddp = dplab.DDP(model)`` run twice leaves the first wrapper alive (the cell's
output history holds it) with its hooks still on ``model``'s parameters. Both wrappers would then
reduce every gradient, and the old one, whose forward is never called, would issue collectives the
other ranks do not expect. The guard detaches the old wrapper instead, with a warning.

"Wrapped again" means: the same module, or a new wrapper whose parameters include every parameter
of the old one. Two wrappers that merely *share* a parameter (two models tied by one layer) are
both kept, as torch keeps both: each reduces the shared gradient and writes back the same average.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # every dplab.DDP not yet collected
_LOCK = threading.Lock()


def claim(ddp: Any) -> None:
    """Register ``ddp``; detach any live wrapper of the same module (or of a subset of its
    parameters), warning that the old one is no longer in use."""
    mine = {id(p) for _, p in ddp._params}
    with _LOCK:
        for old in list(_LIVE):
            if old is ddp or old.detached or old is ddp.module:
                continue  # a DDP wrapping a DDP (nested, as torch allows) keeps both
            theirs = {id(p) for _, p in old._params}
            if old.module is ddp.module or theirs <= mine:
                old._detach("its module was wrapped again by another dplab.DDP")
                warnings.warn(
                    "this module was already wrapped by a dplab.DDP; that wrapper is now "
                    "detached (its hooks are removed). Use the new one.",
                    stacklevel=4,
                )
        _LIVE.add(ddp)


def remove_hooks(handles: list[Any]) -> None:
    """When a DDP is garbage-collected, its parameters keep no hook of it."""
    for handle in handles:
        handle.remove()
    handles.clear()
