"""Moved to :mod:`dplab.doctor.straggler`: an alias for one release (:mod:`dplab._moved`)."""

from dplab._moved import alias_of
from dplab.doctor import straggler as _new

__getattr__ = alias_of(__name__, _new)
