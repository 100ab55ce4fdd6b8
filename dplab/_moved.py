"""A module that moved keeps its old name for one release, warning with the new one.

Why: a learner's saved notebook holds the imports it was written with; breaking them on an
upgrade loses their work, keeping them forever keeps two names for one thing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["alias_of"]


def alias_of(old: str, new: ModuleType) -> Callable[[str], Any]:
    """Warn that ``old`` is now ``new`` and return the old module's ``__getattr__`` (PEP 562),
    which reads every name from ``new``."""
    warnings.warn(
        f"{old} moved to {new.__name__}: import it from there; the old name goes in the next "
        "release",
        DeprecationWarning,
        stacklevel=3,
    )

    def __getattr__(name: str) -> Any:
        return getattr(new, name)

    return __getattr__
