"""Buffers (BatchNorm statistics and the like): which ones DDP keeps equal, and how.

As torch does (``_sync_buffers`` in torch/nn/parallel/distributed.py), the module's buffers are
read again before every sync, not fixed at construction: a buffer the model *reassigns*
(``self.buffer = self.buffer + 1``) is a new tensor, and it is that one which is broadcast from
rank 0 (under ``join()``: from the highest rank still training). A buffer comm hook
(``_register_buffer_comm_hook``) replaces the broadcast, before or after the forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dplab.ddp.replicas import broadcast_from


class BufferSyncMixin:
    """The buffer half of DDP's forward (mixed into :class:`dplab.ddp.ddp.DDP`)."""

    def _current_buffers(self) -> list[torch.Tensor]:
        """The module's buffers as they are now, the ignored ones left out."""
        self._buffers_to_sync = [
            b for n, b in self.module.named_buffers() if n not in self._ignored
        ]
        return self._buffers_to_sync

    def _kept_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter DDP keeps equal (frozen ones too), the ignored ones left out."""
        return [(n, p) for n, p in self.module.named_parameters() if n not in self._ignored]

    def will_sync_module_buffers(self) -> bool:
        """torch's rule: buffers are synced at a forward that follows a synchronising (grad-
        enabled, not ``no_sync``) one; the first forward counts as following one."""
        return (
            self.require_forward_param_sync
            and self.forward_sync_buffers
            and len(self._buffers_to_sync) > 0
        )

    def _buffer_hook_at(self, post_forward: bool) -> bool:
        """Whether the buffers are synced here: before the forward, or after it (a hook's
        choice; without a hook, before)."""
        if not self.will_sync_module_buffers():
            return False
        if self._buffer_hook is None:
            return not post_forward
        from torch.nn.parallel.distributed import _BufferCommHookLocation

        at_post = self._buffer_hook[2] == _BufferCommHookLocation.POST_FORWARD
        return at_post == post_forward

    def _sync_buffers(self, src: int | None = None) -> None:
        """Broadcast the current buffers from group rank ``src`` (default: 0, or under
        ``join()`` the highest rank still training), or run the buffer hook."""
        buffers = self._current_buffers()
        if self._buffer_hook is not None:
            hook, state, _ = self._buffer_hook
            names = [n for n, _ in self.module.named_buffers() if n not in self._ignored]
            futures = hook(state, dict(zip(names, buffers, strict=True)))
            if futures is not None:
                self._buffer_futures = list(futures)
            return
        if src is None:
            src = self._find_common_rank(self.rank, True) if self._join_config.enable else 0
        if self.world_size > 1:
            global_src = dist_global_rank(self.process_group, src)
            with torch.no_grad():
                broadcast_from(buffers, global_src, self.process_group)

    def _wait_buffer_futures(self) -> None:
        """The futures a buffer hook returned are awaited at the end of the backward."""
        futures: list[Any] = getattr(self, "_buffer_futures", [])
        self._buffer_futures = []
        for f in futures:
            f.wait()


def dist_global_rank(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(group, rank)
