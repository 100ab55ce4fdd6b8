"""Units of size, defined once: binary (KiB, MiB, GiB) for buffers, decimal GB for bandwidth.

torch's ``bucket_cap_mb`` and memory sizes are binary; nccl-tests and link specs quote GB/s with
GB = 1e9 bytes. Mixing the two is a 7 % error at GiB scale, so every module names which it means.
"""

from __future__ import annotations

KIB = 1024
MIB = 1024 * 1024
GIB = 1024**3
GB = 1e9  # decimal: nccl-tests reports GB/s with GB = 1e9 bytes

__all__ = ["GB", "GIB", "KIB", "MIB", "format_size"]


def format_size(nbytes: float) -> str:
    """1024 → '1 KiB', 268435456 → '256 MiB', 100e6 → '95.4 MiB' (three significant digits)."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} B"
