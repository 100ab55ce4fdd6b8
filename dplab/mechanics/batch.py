"""B_global = B_local × N × A: the batch the optimizer actually sees.

The per-rank batch (B_local) is what fits in memory; the world size N and the accumulation count
A multiply it. Scaling out from 8 to 64 ranks with the same B_local multiplies B_global by 8 and
changes the optimization, which is why the learning rate has to follow (see lr_scaling).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dplab._checks import check_positive_int


def global_batch_size(b_local: int, world_size: int, accum: int = 1) -> int:
    """B_global = B_local × N × A."""
    b = check_positive_int("b_local", b_local)
    n = check_positive_int("world_size", world_size)
    a = check_positive_int("accum", accum)
    return b * n * a


def local_batch_size(b_global: int, world_size: int, accum: int = 1) -> int:
    """B_local = B_global / (N × A); a ValueError when it does not divide evenly.

    Uneven shards would give some samples more weight than others in the averaged gradient.
    """
    b = check_positive_int("b_global", b_global)
    n = check_positive_int("world_size", world_size)
    a = check_positive_int("accum", accum)
    if b % (n * a):
        raise ValueError(
            f"B_global={b} does not split into world_size={n} ranks × accum={a} micro-batches "
            f"(N×A={n * a} must divide it)"
        )
    return b // (n * a)


def batch_table(
    b_global: int, world_sizes: Iterable[int] = (1, 2, 4, 8), accums: Iterable[int] = (1, 2, 4)
) -> list[dict[str, Any]]:
    """Every (N, A) that reaches ``b_global`` exactly, with the B_local (micro-batch) it needs."""
    rows = []
    for n in world_sizes:
        for a in accums:
            try:
                b_local = local_batch_size(b_global, n, a)
            except ValueError:
                continue
            rows.append({"world_size": n, "accum": a, "b_local": b_local, "b_global": b_global})
    return rows


def format_batch_table(rows: list[dict[str, Any]]) -> str:
    """The calculator's rows as aligned text."""
    lines = [f"{'N':>4} {'A':>4} {'B_local':>8} {'B_global':>9}"]
    lines += [
        f"{r['world_size']:>4} {r['accum']:>4} {r['b_local']:>8} {r['b_global']:>9}" for r in rows
    ]
    return "\n".join(lines)
