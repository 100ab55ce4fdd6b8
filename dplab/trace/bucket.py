"""``Bucket``: one all-reduce's worth of gradients, as a step records it.

It lives with the trace (not with DDP) because every step, measured or simulated, carries its
buckets: a timeline names what each all-reduce carried, and a saved trace reads back without DDP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# What a saved trace keeps of a bucket (the on-disk format): enough to name and size each
# all-reduce. numel, dtype and device are known while DDP runs but not written.
SAVED_KEYS = ("index", "param_names", "nbytes")


@dataclass(frozen=True)
class Bucket:
    """One all-reduce's worth of gradients.

    ``param_names`` are as ``module.named_parameters()`` names them, in the order their
    gradients sit in the bucket's flat buffer (the reverse of registration order).

    Two buckets are equal when they carry the same gradients (index, names, bytes): a simulated
    bucket, a measured one and one read back from disk compare equal when they would all-reduce
    the same thing. ``numel``, ``dtype`` and ``device`` are None for a bucket read from disk.
    Read it by attribute (``b.nbytes``); ``to_dict()`` is the saved form, a plain dict.
    """

    index: int
    param_names: tuple[str, ...]
    nbytes: int
    numel: int | None = field(default=None, compare=False)
    dtype: Any = field(default=None, compare=False)
    device: Any = field(default="cpu", compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "param_names": list(self.param_names), "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: Any) -> Bucket:
        """Read ``to_dict``'s output (or a live Bucket) back; anything else is a clear error."""
        if isinstance(d, Bucket):
            return d
        if not isinstance(d, dict) or any(k not in d for k in SAVED_KEYS):
            raise ValueError(f"a bucket needs {', '.join(SAVED_KEYS)}, got {d!r}")
        return cls(
            index=int(d["index"]),
            param_names=tuple(str(n) for n in d["param_names"]),
            nbytes=int(d["nbytes"]),
            numel=None if d.get("numel") is None else int(d["numel"]),
        )
