"""Why a function defined in a notebook cell needs cloudpickle to reach a rank (00's aside).

``multiprocessing`` and ``torch.multiprocessing.spawn`` hand a function to a new process with
``pickle``, which stores it by reference: its module and its name. A *spawned* child is a fresh
Python whose ``__main__`` is not the notebook's, so a function defined in a cell cannot be found
there. :func:`run_spawned` shows that for real: it starts the function in one spawned process and
returns the child's exit code and what it wrote to its standard error, which a notebook would
otherwise never show (the child writes to the kernel's file descriptor 2, not to the cell).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from dplab._checks import check_positive


@dataclass(frozen=True)
class SpawnedRun:
    """How a spawned child ended: ``exit_code`` (negative: killed by that signal) and its stderr."""

    exit_code: int | None  # None only while it runs; run_spawned always joins it
    stderr: str

    @property
    def last_line(self) -> str:
        """The child's last words: the line a traceback ends with."""
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""


def run_spawned(fn: Callable[[], object], timeout_s: float = 60.0) -> SpawnedRun:
    """Start ``fn`` in one process of the ``spawn`` start method; its exit code and stderr.

    The child inherits this process's file descriptor 2, so for the child's lifetime fd 2 points
    at a temporary file (restored afterwards, whatever happens); a child still alive after
    ``timeout_s`` is killed, so a cell never hangs on it.
    """
    limit = check_positive("timeout_s", timeout_s)
    if not callable(fn):
        raise TypeError(f"run_spawned needs a function, got {fn!r}")
    with tempfile.TemporaryFile() as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            child = multiprocessing.get_context("spawn").Process(target=fn)
            child.start()
            child.join(limit)
            if child.is_alive():
                child.kill()
                child.join()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return SpawnedRun(child.exitcode, err.read().decode(errors="replace"))
