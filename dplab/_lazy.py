"""A package's public names, imported on first use (PEP 562).

Why: ``python -m dplab simulate`` prices a step on 1,024 GPUs with arithmetic alone, yet importing
``dplab`` used to import torch (about 1.9 s) through the package ``__init__`` files. With this,
``dplab``, ``dplab.ddp``, ``dplab.trace``, ``dplab.collectives`` and ``dplab.memory`` name what
they export and where it lives; the module holding a name is imported when the name is first
read, so a verb that needs no tensor never loads torch. ``from dplab.ddp import DDP``,
``dplab.DDP`` and ``dplab.trace.Span`` after a bare ``import dplab`` work as before: a
subpackage read as an attribute is imported on first use too.

A public name must not also be a submodule's name: importing the submodule would set the package
attribute to the module and hide the function (``tests/test_lazy_exports.py`` checks this).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: dict[str, Any], where: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` for the package whose ``globals()`` is
    ``package``; ``where`` maps each module to the public names it defines."""
    home = {name: module for module, names in where.items() for name in names}
    package_name = package["__name__"]

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            if not name.startswith("_") and importlib.util.find_spec(f"{package_name}.{name}"):
                return importlib.import_module(f"{package_name}.{name}")  # sets the attribute
            raise AttributeError(f"module {package_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        package[name] = value  # the next read is a plain attribute
        return value

    __getattr__.home = home  # type: ignore[attr-defined]  # where each name lives, for tests

    def __dir__() -> list[str]:
        return sorted(set(package) | set(home))

    return __getattr__, __dir__, sorted(home)
