"""Two setup errors, as torch words them: a rendezvous port in use, and the ``module.`` prefix.

- The rendezvous store (``MASTER_PORT``) on a port another process holds (an earlier job not
  yet gone, two jobs given the same port): torch's ``TCPStore`` fails with EADDRINUSE.
- A state dict saved from the DDP wrapper (``ddp.state_dict()``) names every parameter
  ``module.<name>``; loading it into the bare model fails with "Missing key(s)" and "Unexpected
  key(s)". Save ``ddp.module.state_dict()``, or strip the prefix with torch's
  ``consume_prefix_in_state_dict_if_present``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dplab.failures._common import first_line, mlp, short_group


@dataclass(frozen=True)
class SetupErrors:
    """torch's words for each setup error, and whether its fix worked."""

    port_in_use: str
    saved_keys: tuple[str, ...]
    load_error: str
    loaded_after_strip: bool


def port_in_use_error() -> str:
    """torch's error when the store's port is taken (held here on 127.0.0.1 by a socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        try:
            dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=2))
        except RuntimeError as e:  # DistNetworkError is a RuntimeError
            return first_line(e)
    raise AssertionError(f"TCPStore listened on port {port}, which a socket already held")


def setup_errors(*, group_timeout_s: float = 5.0) -> SetupErrors:
    """Rank function: the port error, and a DDP state dict loaded into the bare model."""
    model = mlp(width=4, depth=2)
    with short_group(group_timeout_s) as group:
        ddp = TorchDDP(model, process_group=group)
        saved = ddp.state_dict()
        keys = tuple(saved)
        del ddp  # a DDP must not outlive its group (see short_group)
    bare = mlp(width=4, depth=2, seed=1)
    try:
        bare.load_state_dict(saved)
        load_error = ""
    except RuntimeError as e:
        load_error = str(e)
    consume_prefix_in_state_dict_if_present(saved, "module.")
    bare.load_state_dict(saved)
    loaded = all(
        torch.equal(a, b) for a, b in zip(bare.parameters(), model.parameters(), strict=True)
    )
    return SetupErrors(port_in_use_error(), keys, load_error, loaded)
