"""What every verb checks before it starts a rank: its numbers, and where its files will go.

A verb that measures for a minute and then finds it cannot write its result has wasted the
minute and lost the result, and a bad ``--steps`` caught on a rank is a 30-line traceback. So
the numbers are checked with :mod:`dplab._checks` (one line naming the flag and the value:
``error: --steps 0: steps must be a positive int, got 0``, exit status 2), and each output
location is probed, by writing a temporary file where the output will go, before anything is
measured. Outputs are written through :func:`dplab.trace.files.write_atomic` (a
temporary file in the same folder, then a rename; mode ``0666 & ~umask``).
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
    "CliError",
    "cap_mb",
    "check_output_file",
    "check_ranks",
    "check_writable_folder",
    "count",
    "fail",
    "positive_float",
    "positive_int",
    "world_size",
]


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


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_folder(folder: Path, *, what: str) -> None:
    """Refuse a folder where no file can be created (``/proc``, a read-only mount, a file):
    the nearest folder that exists must take a temporary file, which is removed again."""
    base = _nearest_existing(folder.absolute())
    if not base.is_dir():
        raise CliError(f"{what}: {base} is a file, not a folder: nothing can be written under it")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise CliError(f"{what}: cannot create a file in {base} ({e.strerror or e})") from None


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output_file(path: str, *, what: str, inputs: dict[str, str | None] | None = None) -> Path:
    """A file the verb may write: named, not a folder, in a writable place, and not one of
    its own ``inputs`` (``{"--profile": path}``), which writing it would destroy."""
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
    check_writable_folder(out.parent, what=what)
    return out
