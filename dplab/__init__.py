"""dplab: data parallelism, measured.

Public names: :func:`launch`, :class:`Cluster`, :class:`RankError`, :class:`DDP`, :class:`Tracer`,
:class:`StepTrace`, :class:`TextbookDDP` (the DDP to read); the modules :mod:`dplab.sim`,
:mod:`dplab.memory`, :mod:`dplab.collectives`.

The names that need torch are imported on first use (:mod:`dplab._lazy`), so ``python -m dplab
simulate`` answers without loading it. ``launch`` is imported here: it shares its name with the
package :mod:`dplab.launch`, which needs no torch.
"""

from dplab._lazy import lazy_exports
from dplab.launch import Cluster, RankError, RankTimeout, device, launch  # noqa: F401

__getattr__, __dir__, _lazy_names = lazy_exports(
    globals(),
    {
        "dplab.ddp": ["DDP", "ForwardOrderDDP", "NaiveDDP", "PerParameterDDP", "TextbookDDP"],
        "dplab.trace.bucket": ["Bucket"],
        "dplab.trace.step": ["StepTrace"],
        "dplab.trace.tracer": ["Tracer"],
    },
)
__all__ = sorted([*_lazy_names, "Cluster", "RankError", "RankTimeout", "device", "launch"])
__version__ = "0.1.0"
