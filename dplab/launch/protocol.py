"""The wire protocol between the caller and its rank processes (:mod:`dplab._worker`).

A call is ``CALL_HEADER.pack(CALL, call_id) + payload``; ``STOP`` asks a rank to leave its group
and exit. A reply is :class:`Reply`'s tuple. Call ids never repeat, so a reply left in a pipe (an
interrupted call, a result the caller could not unpickle) can never be taken for a later call's.

The payload is made by :func:`pickle_call`: the function travels *by value* (cloudpickle),
because a function defined in a notebook cell lives in the kernel's ``__main__``, which no other
process can import. :mod:`dplab.nodes` ships its calls with the same function.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import cloudpickle

CALL = b"C"
STOP = b"S"
CALL_HEADER = struct.Struct("<cQ")


class Reply(NamedTuple):
    """One rank's answer to one call (sent as a plain tuple, read back as this)."""

    call_id: int
    kind: str  # "ok" | "error"
    body: Any  # the pickled result, or the error's text
    collectives: int | None  # collectives issued on the default group so far
    group_lost: bool = False  # the call destroyed the rank's default process group


def source_map(fn: Callable) -> dict[str, tuple[str, list[str]]]:
    """Where ``fn`` and the functions it calls by name came from, with their source lines.

    cloudpickle ships functions from ``__main__`` without their file name, so a rank's
    traceback would only say ``<dynamic-code>``; with this map the rank names the cell or file
    and quotes the failing line.
    """
    import linecache

    out: dict[str, tuple[str, list[str]]] = {}
    code = getattr(fn, "__code__", None)
    if code is None:
        return out
    found = [fn] + [
        g
        for name in code.co_names
        if callable(g := getattr(fn, "__globals__", {}).get(name)) and hasattr(g, "__code__")
    ]
    for f in found:
        filename = f.__code__.co_filename
        out[f.__code__.co_name] = (filename, linecache.getlines(filename))
    return out


def pickle_call(fn: Callable, args: tuple, kwargs: dict | None) -> bytes:
    """The payload of one call: ``fn(*args, **kwargs)`` by value, with the caller's sys.path.

    Raises TypeError (naming ``fn``) when the call cannot be pickled, before any rank sees it.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    try:
        call = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as e:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"cannot send {name} and its arguments to the ranks: they cannot be pickled ({e})"
        ) from e
    # The call is unpickled only after the rank has this process's sys.path, so functions
    # from modules found through it (a script's folder, a benchmark's helpers) import there.
    return cloudpickle.dumps((list(sys.path), source_map(fn), call))
