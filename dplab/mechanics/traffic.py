"""Count what goes through torch.distributed: which collective, how many bytes, in which phase.

Why wrap the functions rather than trust a formula? The lesson's claim is "only gradients are
communicated, weights once at the start". The honest check is to stand at the door every tensor
must pass: ``torch.distributed``'s collectives. :class:`CommCounter` replaces them, inside one
rank, with wrappers that note the payload and call the original. Both names are wrapped: the
``torch.distributed`` attribute (what ``dist.all_reduce(...)`` finds) and the one inside
``distributed_c10d`` (what ``all_gather_object`` calls internally), so nothing slips past.

"Bytes" is the payload this rank hands to the collective (its tensor's size), not what the
backend puts on the wire: a ring all-reduce of S bytes sends 2(N-1)/N·S per rank (see §7).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# collective → the argument that holds this rank's payload
PAYLOAD_ARG = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": "input",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "barrier": None,
}


@dataclass(frozen=True)
class CommRecord:
    """One collective call on this rank.

    ``l1`` is the payload's sum of absolute values as it was handed over (all-reduce only): what
    was sent, not just how much, so a lesson can tell gradients from weights of the same size.
    """

    op: str
    nbytes: int
    phase: str
    dtype: str
    l1: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def payload_nbytes(t: Any) -> tuple[int, str]:
    """Bytes and dtype of what a rank hands to a collective (0 and "" for a non-tensor)."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size(), str(t.dtype).removeprefix("torch.")
    return 0, ""


class CommCounter:
    """Context manager: while active, every torch.distributed collective on this rank is counted.

    ``with counter.phase("step 1"): ...`` labels the calls made inside. ``records`` holds one
    :class:`CommRecord` per call; :meth:`calls` and :meth:`nbytes` filter by op and phase.
    Re-entering an active counter is an error (the wrappers would wrap themselves).
    """

    # collective → the argument holding this rank's payload: the doors this counter watches
    payload_args: dict[str, str | None] = PAYLOAD_ARG

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self._phase = "-"
        self._saved: list[tuple[Any, str, Any]] = []

    # -- labelling ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self._phase = self._phase, str(name)
        try:
            yield
        finally:
            self._phase = previous

    # -- patching -------------------------------------------------------------------------------

    def _wrap(self, op: str, original: Callable) -> Callable:
        arg = self.payload_args[op]
        signature = inspect.signature(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            nbytes, dtype, l1 = 0, "", None
            if arg is not None:
                payload = signature.bind_partial(*args, **kwargs).arguments.get(arg)
                nbytes, dtype = payload_nbytes(payload)
                if op == "all_reduce" and isinstance(payload, torch.Tensor):
                    l1 = float(payload.detach().abs().double().sum())
            self.records.append(CommRecord(op, nbytes, self._phase, dtype, l1))
            return original(*args, **kwargs)

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    def __enter__(self) -> CommCounter:
        if self._saved:
            raise RuntimeError("this CommCounter is already counting")
        for op in self.payload_args:
            original = getattr(c10d, op, None)
            if original is None:  # a collective this torch does not have
                continue
            wrapper = self._wrap(op, original)
            for module in (dist, c10d):
                if getattr(module, op, None) is original:
                    self._saved.append((module, op, original))
                    setattr(module, op, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, op, original in reversed(self._saved):
            setattr(module, op, original)
        self._saved = []

    # -- reading --------------------------------------------------------------------------------

    def _select(self, op: str | None, phase: str | None) -> list[CommRecord]:
        return [
            r
            for r in self.records
            if (op is None or r.op == op) and (phase is None or r.phase == phase)
        ]

    def calls(self, op: str | None = None, phase: str | None = None) -> int:
        """How many collective calls (of ``op``, in ``phase``; None = any)."""
        return len(self._select(op, phase))

    def nbytes(self, op: str | None = None, phase: str | None = None) -> int:
        """Payload bytes handed to collectives (of ``op``, in ``phase``; None = any)."""
        return sum(r.nbytes for r in self._select(op, phase))

    def phases(self) -> list[str]:
        """Phase names in the order they first appear."""
        return list(dict.fromkeys(r.phase for r in self.records))

    def to_dicts(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.records]


def comm_table(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per phase and op: calls and bytes (records as :meth:`CommCounter.to_dicts` returns them)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        row = rows.setdefault(
            (r["phase"], r["op"]), {"phase": r["phase"], "op": r["op"], "calls": 0, "nbytes": 0}
        )
        row["calls"] += 1
        row["nbytes"] += r["nbytes"]
    return list(rows.values())
