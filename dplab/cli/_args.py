"""What every verb checks before it starts a rank: its numbers, and where its files will go.

A verb that measures for a minute and then finds it cannot write its result has wasted the
minute and lost the result, and a bad ``--steps`` caught on a rank is a 30-line traceback. So
the numbers are checked with :mod:`dplab._checks` (one line naming the flag and the value:
``error: --steps 0: steps must be a positive int, got 0``, exit status 2), and each output
location is probed, by writing a temporary file where the output will go, before anything is
measured. Creating an empty file needs no free space, so the probe alone passes on a full disk:
the folder's free space is checked too, against what the output will take (a page with
plotly.js embedded is 4.8 MB). Outputs are written through
:func:`dplab.trace.files.write_atomic` (a temporary file in the same folder, then a rename;
mode ``0666 & ~umask``), so a disk that fills during the run fails the write before anything
already there is replaced, and the verb says so in one line (:func:`write_failed`).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dplab import _checks
from dplab._units import MIB

__all__ = [
    "JSON_BYTES",
    "PAGE_BYTES",
    "CliError",
    "cap_mb",
    "check_output_file",
    "check_ranks",
    "check_writable_folder",
    "count",
    "display_path",
    "fail",
    "launched_world_size",
    "positive_float",
    "positive_int",
    "world_size",
    "write_failed",
]

# The free space an output needs: an HTML page embeds plotly.js (4.8 MB) beside the figure's data;
# a JSON result (a profile, a bandwidth table, the simulator's rows) is a few hundred KB at most.
PAGE_BYTES = 8 * MIB
JSON_BYTES = 1 * MIB


class CliError(ValueError):
    """A bad argument or output location, found before anything ran (printed as one line)."""


def fail(message: str) -> int:
    """Print ``error: message`` (one line) on stderr; the exit status of a refused command."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def _name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _checked(flag: str, value: Any, check: Callable[[str, Any], Any]) -> Any:
    try:
        return check(_name(flag), value)
    except ValueError as e:
        raise CliError(f"{flag} {value!r}: {e}") from None


def positive_int(flag: str, value: Any) -> int:
    """An int >= 1 (steps, a batch, nodes)."""
    return _checked(flag, value, _checks.check_positive_int)


def count(flag: str, value: Any) -> int:
    """An int >= 0 (warm-up steps, repeats that may be skipped)."""
    return _checked(flag, value, _checks.check_count)


def world_size(flag: str, value: Any, *, minimum: int = 1) -> int:
    """A number of ranks: an int >= ``minimum``."""
    return _checked(flag, value, lambda n, v: _checks.check_world_size(v, minimum=minimum))


def positive_float(flag: str, value: Any) -> float:
    """A finite number > 0 (a speed-up, a line rate, a size)."""
    return _checked(flag, value, _checks.check_positive)


def cap_mb(flag: str, value: Any) -> float:
    """A bucket cap in MiB that DDP can build buckets with: finite, and at least one byte."""
    cap = positive_float(flag, value)
    if int(cap * MIB) < 1:
        raise CliError(
            f"{flag} {value!r}: {_name(flag)}={value!r} is {int(cap * MIB)} bytes: a bucket cap "
            f"must be at least 1 byte ({1 / MIB:.3g} MiB)"
        )
    return cap


def check_ranks(world_size: int, *, flag: str = "--world-size") -> int:
    """Refuse more ranks than this machine holds (cores, memory per rank) before starting any.

    Under torchrun the ranks exist already, so there is nothing to refuse.
    """
    from dplab.env import in_torchrun
    from dplab.launch import check_capacity

    if in_torchrun():
        return world_size
    try:
        return check_capacity(world_size)
    except ValueError as e:
        text = str(e).replace(" Pass oversubscribe=True to start them anyway.", " Use fewer.")
        raise CliError(f"{flag}: {text}") from None


def display_path(path: str | os.PathLike) -> str:
    """A path as text that any page or terminal can hold: a name that is not UTF-8 (Python
    keeps its bytes as lone surrogates, which plotly's JSON and a UTF-8 file refuse) shows
    its undecodable bytes as U+FFFD, as file managers do."""
    return os.fsencode(path).decode("utf-8", "replace")


def launched_world_size(flag_value: Any) -> Any:
    """The world size a verb runs at: torchrun's ``WORLD_SIZE`` under torchrun (the ranks exist
    already, and ``--world-size``'s default of 2 would not match a group of 4: every rank then
    failed), else ``--world-size``. The value is checked by the caller, as the flag's is."""
    from dplab.env import in_torchrun

    return int(os.environ["WORLD_SIZE"]) if in_torchrun() else flag_value


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_folder(folder: Path, *, what: str, needs_bytes: int = 0) -> None:
    """Refuse a folder where no file can be created (``/proc``, a read-only mount, a file),
    or whose file system has less than ``needs_bytes`` free: the nearest folder that exists
    must take a temporary file (removed again) and have the room."""
    base = _nearest_existing(folder.absolute())
    if not base.is_dir():
        raise CliError(f"{what}: {base} is a file, not a folder: nothing can be written under it")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise CliError(f"{what}: cannot create a file in {base} ({e.strerror or e})") from None
    check_free_space(base, needs_bytes, what=what)


def check_free_space(folder: Path, needs_bytes: int, *, what: str) -> None:
    """Refuse a file system with less than ``needs_bytes`` free for this user, before a verb
    measures for a minute and then cannot write what it measured."""
    if needs_bytes <= 0:
        return
    try:
        st = os.statvfs(folder)
    except OSError:  # no statvfs here: the write itself will say (atomically)
        return
    free = st.f_bavail * st.f_frsize
    if free < needs_bytes:
        raise CliError(
            f"{what}: only {free / MIB:.2f} MiB free on the disk holding {folder}, the output "
            f"needs about {needs_bytes / MIB:.0f} MiB: free some space or choose another place "
            "(nothing was measured)"
        )


def write_failed(what: str, path: str | os.PathLike, error: OSError) -> int:
    """One line for an output that could not be written after measuring (the disk filled during
    the run); exit status 1. Outputs are written atomically, so nothing there was replaced."""
    fail(
        f"{what} {str(path)!r}: could not write it ({error.strerror or error}); whatever was "
        "there before is unchanged. Free some space and run again"
    )
    return 1  # it ran: not a refused argument (2), a failure after the work (1)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output_file(
    path: str,
    *,
    what: str,
    inputs: dict[str, str | None] | None = None,
    needs_bytes: int = PAGE_BYTES,
) -> Path:
    """A file the verb may write: named, not a folder, in a writable place with ``needs_bytes``
    free (default: room for an HTML page), and not one of its own ``inputs``
    (``{"--profile": path}``), which writing it would destroy."""
    if path == "":
        raise CliError(f"{what} is empty: name a file, e.g. {what} result.json")
    out = Path(path)
    if out.is_dir():
        raise CliError(f"{what} {path!r} is a folder: name a file inside it")
    for flag, source in (inputs or {}).items():
        if source is None:
            continue
        src = Path(source)
        if _same(out, src) or os.path.abspath(out) == os.path.abspath(src):
            raise CliError(
                f"{what} {path!r} is the same file as {flag} {source!r}: writing it would "
                f"destroy the input; choose another {what}"
            )
    check_writable_folder(out.parent, what=what, needs_bytes=needs_bytes)
    return out
