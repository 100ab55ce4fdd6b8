"""dplab: data parallelism, measured.

Public names: :func:`launch`, :class:`Cluster`, :class:`RankError`, :class:`DDP`, :class:`Tracer`,
:class:`StepTrace`, :class:`TextbookDDP` (the DDP to read); the modules :mod:`dplab.sim`,
:mod:`dplab.memory`, :mod:`dplab.collectives`.
"""

from dplab.ddp import DDP, Bucket, ForwardOrderDDP, NaiveDDP, PerParameterDDP, TextbookDDP
from dplab.launch import Cluster, RankError, RankTimeout, device, launch
from dplab.trace import StepTrace, Tracer

__all__ = [
    "DDP",
    "Bucket",
    "Cluster",
    "ForwardOrderDDP",
    "NaiveDDP",
    "PerParameterDDP",
    "RankError",
    "RankTimeout",
    "StepTrace",
    "TextbookDDP",
    "Tracer",
    "device",
    "launch",
]
__version__ = "0.1.0"
