"""What a failed run raises: :class:`RankError` (a rank raised or died), :class:`RankTimeout`."""

from __future__ import annotations

from collections.abc import Sequence

# The innermost frame of a rank waiting in a collective is in torch.distributed's Python code
# (the C++ wait shows no frame of its own).
_COLLECTIVE_FILES = ("/torch/distributed/", "\\torch\\distributed\\")


class RankError(RuntimeError):
    """A rank raised or died. ``.rank`` is the rank; the message holds its traceback.

    ``.summary`` is the cause in one line: the exception's last line for a rank that raised,
    "the rank process exited with code 3 …" for one that died. A dead rank's last printed line
    is in its traceback text, but it is what the rank printed, never the cause.
    """

    def __init__(
        self,
        rank: int,
        traceback: str,
        *,
        others: dict[int, str] | None = None,
        summary: str | None = None,
    ):
        self.rank = rank
        self.traceback = traceback
        self.others = others or {}
        lines = traceback.strip().splitlines()
        self.summary = summary or (lines[-1] if lines else f"rank {rank} failed")
        msg = f"rank {rank} failed:\n{traceback.rstrip()}"
        if self.others:
            msg += "\n(also failed: " + ", ".join(f"rank {r}" for r in sorted(self.others)) + ")"
        super().__init__(msg)


class RankTimeout(TimeoutError):
    """Some ranks did not finish within ``timeout_s``; ``.ranks`` names them.

    ``.stacks`` holds, per stuck rank, where its Python code was when it was stopped;
    ``.in_collective`` the stuck ranks whose innermost frame was inside ``torch.distributed``
    (waiting for a partner), as opposed to busy in their own code (an endless loop).
    """

    def __init__(
        self, ranks: Sequence[int], timeout_s: float, *, stacks: dict[int, str] | None = None
    ):
        self.ranks = sorted(ranks)
        self.timeout_s = timeout_s
        self.stacks = stacks or {}
        self.in_collective = sorted(
            r for r in self.ranks if _waits_in_collective(self.stacks.get(r))
        )
        names = ", ".join(str(r) for r in self.ranks)
        msg = f"ranks {names} did not finish within timeout_s={timeout_s:g}; all ranks were stopped"
        for rank in self.ranks:
            if self.stacks.get(rank):
                msg += f"\nrank {rank} was stuck at (most recent call last):\n{self.stacks[rank]}"
        super().__init__(msg)


def _waits_in_collective(stack: str | None) -> bool:
    """Whether a stack (innermost frame last) ends inside torch.distributed."""
    frames = [line for line in (stack or "").splitlines() if line.lstrip().startswith("File ")]
    return bool(frames) and any(part in frames[-1] for part in _COLLECTIVE_FILES)
