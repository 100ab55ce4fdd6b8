"""``Bucket``: one all-reduce's worth of gradients, as a step records it.

It lives with the trace (not with DDP) because every step, measured or simulated, carries its
buckets: a timeline names what each all-reduce carried, and a saved trace reads back without DDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bucket:
    """One all-reduce's worth of gradients.

    ``param_names`` are as ``module.named_parameters()`` names them, in the order their
    gradients sit in the bucket's flat buffer (the reverse of registration order).
    """

    index: int
    param_names: tuple[str, ...]
    numel: int
    nbytes: int
    dtype: Any
    device: Any = "cpu"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "param_names": list(self.param_names), "nbytes": self.nbytes}
