"""dplab: data parallelism, measured.

Public names: :func:`launch`, :class:`Cluster`, :class:`RankError`, :class:`DDP`, :class:`Tracer`,
:class:`StepTrace`; the modules :mod:`dplab.sim`, :mod:`dplab.memory`, :mod:`dplab.collectives`.
"""

from dplab.launch import Cluster, RankError, RankTimeout, device, launch

__all__ = ["Cluster", "RankError", "RankTimeout", "device", "launch"]
__version__ = "0.1.0"
