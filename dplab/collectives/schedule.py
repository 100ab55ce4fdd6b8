"""The all-reduce schedules as pure functions: no ranks needed, so a widget steps through instantly.

A ring all-reduce on N ranks cuts the tensor into N chunks and makes 2(N-1) steps. At every step
each rank sends one chunk to its right neighbour and receives one from its left. Steps 1..N-1
are the *reduce-scatter* (add what arrives); steps N..2(N-1) the *all-gather* (copy what arrives).
The real ring (:mod:`dplab.collectives.allreduce`) records the messages it sends; the tests check
that record against :func:`ring_schedule`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dplab._checks import check_count, check_world_size

REDUCE_SCATTER = "reduce-scatter"
ALL_GATHER = "all-gather"
GATHER = "gather"
BROADCAST = "broadcast"


@dataclass(frozen=True)
class Transfer:
    """One message of an all-reduce: ``src`` sends elements ``[start, stop)`` to ``dst``.

    ``step`` counts from 1 (step 0 is the state before anything moves). For the ring, ``chunk``
    is the chunk index; for the naive algorithm the whole tensor moves and ``chunk`` is None.
    Ranks are ranks within the process group.
    """

    phase: str
    step: int
    src: int
    dst: int
    chunk: int | None
    start: int
    stop: int
    nbytes: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Cut ``numel`` elements into ``world_size`` contiguous chunks, ``[start, stop)`` each.

    When N does not divide the size, the first ``numel % N`` chunks get one element more (as
    ``torch.tensor_split`` does); with fewer elements than ranks some chunks are empty, and the
    ring still runs every step (an empty message costs α, nothing else).
    """
    numel = check_count("numel", numel)
    n = check_world_size(world_size)
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for c in range(n):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_send_chunk(rank: int, step: int, world_size: int) -> int:
    """The chunk ``rank`` sends to its right neighbour at (1-based) ring ``step``.

    Reduce-scatter step s (0-based): send chunk ``r - s``; all-gather step s: send the finished
    chunk ``r + 1 - s`` (rank r finished chunk ``r + 1`` at the end of reduce-scatter).
    """
    n = world_size
    if step <= n - 1:
        return (rank - (step - 1)) % n
    return (rank + 1 - (step - n)) % n


def ring_recv_chunk(rank: int, step: int, world_size: int) -> int:
    """The chunk ``rank`` receives from its left neighbour at (1-based) ring ``step``."""
    return ring_send_chunk((rank - 1) % world_size, step, world_size)


def ring_phase(step: int, world_size: int) -> str:
    """``reduce-scatter`` for steps 1..N-1, ``all-gather`` for steps N..2(N-1)."""
    return REDUCE_SCATTER if step <= world_size - 1 else ALL_GATHER


def ring_steps(world_size: int) -> int:
    """How many sequential steps the ring makes: 2(N-1)."""
    return 2 * (check_world_size(world_size) - 1)


def ring_schedule(world_size: int, numel: int, element_size: int = 4) -> list[Transfer]:
    """Every message of a ring all-reduce of ``numel`` elements, by step then by sender."""
    n = check_world_size(world_size)
    element_size = check_count("element_size", element_size)
    bounds = chunk_bounds(numel, n)
    out = []
    for step in range(1, ring_steps(n) + 1):
        for src in range(n):
            c = ring_send_chunk(src, step, n)
            start, stop = bounds[c]
            out.append(
                Transfer(
                    ring_phase(step, n),
                    step,
                    src,
                    (src + 1) % n,
                    c,
                    start,
                    stop,
                    (stop - start) * element_size,
                )
            )
    return out


def naive_schedule(
    world_size: int, numel: int, element_size: int = 4, root: int = 0
) -> list[Transfer]:
    """Every message of the naive all-reduce: step 1 gathers to ``root``, step 2 broadcasts."""
    n = check_world_size(world_size)
    numel = check_count("numel", numel)
    element_size = check_count("element_size", element_size)
    if not 0 <= root < n:
        raise ValueError(f"root must be a rank in 0..{n - 1}, got {root!r}")
    nbytes = numel * element_size
    others = [r for r in range(n) if r != root]
    gather = [Transfer(GATHER, 1, r, root, None, 0, numel, nbytes) for r in others]
    bcast = [Transfer(BROADCAST, 2, root, r, None, 0, numel, nbytes) for r in others]
    return gather + bcast


def ring_partial_sums(world_size: int) -> list[list[list[frozenset[int]]]]:
    """Whose contributions each rank's copy of each chunk holds, after every ring step.

    ``states[k][rank][chunk]`` is the set of ranks summed into that chunk after step k
    (k = 0: before anything moves, each rank holds only its own data). Reduce-scatter merges the
    arriving set into the receiver's; all-gather replaces it. The tests check this against real
    ranks (each contributing a distinct bit, so the integer sum *is* the set).
    """
    n = check_world_size(world_size)
    state = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    states = [state]
    for step in range(1, ring_steps(n) + 1):
        new = [list(row) for row in state]
        for src in range(n):
            dst, c = (src + 1) % n, ring_send_chunk(src, step, n)
            if ring_phase(step, n) == REDUCE_SCATTER:
                new[dst][c] = state[dst][c] | state[src][c]
            else:
                new[dst][c] = state[src][c]
        state = new
        states.append(state)
    return states
