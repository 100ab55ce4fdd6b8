"""Under torchrun: run ``fn`` in place on this process's rank, and the device of a rank.

Inside torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK``
set), :func:`dplab.launch` runs ``fn`` here and returns every rank's result (gathered by
:func:`gather_results`), so the same notebook code scales out unchanged. Some of those variables
without the others are leftovers of an earlier launcher, and an error: joining a group nobody
else will join would wait forever.
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from dplab.env import gpu_count, resolve_backend

DEFAULT_TIMEOUT_S = 300.0
LET_GO_TIMEOUT_S = 30.0  # how long a rank waits for the backend to drop the gathered tensors
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def device() -> Any:
    """This rank's device: ``cuda:LOCAL_RANK`` under nccl, else the CPU.

    LOCAL_RANK is read whoever created the process group (dplab or the user, under torchrun), so
    every rank of a node gets its own GPU.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", _local_rank())
    return torch.device("cpu")


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def check_launcher_env(world_size: int) -> None:
    """The env:// variables describe a launcher that is really there, with our world size.

    RANK, WORLD_SIZE and MASTER_ADDR alone are what an earlier torchrun (or a copied
    ``%env``) leaves behind; trusting them, rank 0 would wait for ranks that never come.
    """
    env = os.environ
    present = [k for k in LAUNCHER_VARIABLES if k in env]
    missing = [k for k in LAUNCHER_VARIABLES if k not in env]
    shown = ", ".join(f"{k}={env[k]}" for k in present)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise RuntimeError(
            f"{shown} are set, as a launcher like torchrun sets them, but {', '.join(missing)} "
            f"{verb} not: these look like variables left over from an earlier launcher, not a "
            "launcher running this process. Remove them (for k in "
            f"{tuple(present)!r}: os.environ.pop(k)) so dplab.launch starts its own ranks, "
            "or run this under torchrun."
        )
    try:
        rank, env_world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        int(env["LOCAL_RANK"])
    except ValueError:
        raise RuntimeError(f"the launcher's variables are not all integers: {shown}") from None
    if env_world != world_size:
        raise ValueError(
            f"world_size={world_size} but this process runs under a launcher with "
            f"WORLD_SIZE={env_world}"
        )
    if not 0 <= rank < env_world or not 0 < port < 65536:
        raise RuntimeError(f"the launcher's variables do not fit together: {shown}")


def _join_launcher_group(backend: str, timeout_s: float) -> None:
    """init_process_group for the launcher's rank, within timeout_s, never on 0.0.0.0."""
    import torch.distributed as dist

    env = os.environ
    timeout = timedelta(seconds=timeout_s)
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        # torchrun's agent hosts the store: every rank is a client, nothing listens here.
        dist.init_process_group(backend, timeout=timeout)
        atexit.register(_leave_launcher_group)
        return
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    kwargs: dict[str, Any] = {}
    if rank == 0:
        # Bind MASTER_ADDR only; TCPStore's own bind would listen on every interface.
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((addr, port))
            listener.listen(128)
        except OSError as e:
            listener.close()
            raise RuntimeError(
                f"rank 0 cannot listen on MASTER_ADDR={addr}:{port} for the other ranks: {e}"
            ) from None
        kwargs["master_listen_fd"] = listener.detach()
    try:
        store = dist.TCPStore(addr, port, world_size, rank == 0, timeout=timeout, **kwargs)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    except RuntimeError as e:  # DistStoreError (a timeout) is one
        raise RuntimeError(
            f"rank {rank} could not join the launcher's group of WORLD_SIZE={world_size} at "
            f"MASTER_ADDR={addr}:{port} within timeout_s={timeout_s:g}: {str(e).splitlines()[0]}"
            ". Are the other ranks running?"
        ) from None
    atexit.register(_leave_launcher_group)


def _leave_launcher_group() -> None:
    """Destroy the group dplab created, at exit, as torch asks of every program that made one.

    torch warns when a group is left to the interpreter's teardown (NCCL's most loudly), and a
    group destroyed here is one the next ``init_process_group`` in the same process can replace.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_in_place(
    fn: Callable,
    world_size: int,
    backend: str,
    args: tuple,
    kwargs: dict,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"world_size={world_size} but this process's group has "
                f"world size {dist.get_world_size()}"
            )
    else:
        check_launcher_env(world_size)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        backend = resolve_backend(backend, local_world)
        if backend == "nccl":
            torch.cuda.set_device(_local_rank())
        _join_launcher_group(backend, timeout_s)
    if dist.get_backend() == "nccl" and gpu_count() > _local_rank():
        # A group the user created first may have left every rank on cuda:0.
        torch.cuda.set_device(_local_rank())
    return gather_results(fn(*args, **kwargs), world_size)


def gather_results(result: Any, world_size: int) -> list:
    """Every rank's ``result``, by rank, through tensors held here until the backend lets go.

    ``all_gather_object`` hands its tensors to gloo's worker thread and forgets them. The thread
    drops its references after ``wait()`` has returned, and dropping the last one frees a Python
    object, which needs the GIL. A rank that went straight on to exit could reach the
    interpreter's finalization first, and the thread then aborted the process ("terminate called
    without an active exception"). Holding the tensors until the thread's references are gone
    makes its drop a plain decrement, whenever it comes.
    """
    import pickle

    import torch
    import torch.distributed as dist

    here = device()
    data = torch.frombuffer(bytearray(pickle.dumps(result)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=here)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    longest = max(int(n.item()) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=here)
    padded[: data.numel()] = data.to(here)
    received = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(received, padded)
    _wait_until_let_go([size, *sizes, padded, *received])
    return [
        pickle.loads(out[: int(n.item())].cpu().numpy().tobytes())
        for out, n in zip(received, sizes, strict=True)
    ]


def _wait_until_let_go(tensors: list, timeout_s: float = LET_GO_TIMEOUT_S) -> None:
    """Sleep (the GIL released) until this process holds the only reference to each tensor.

    A backend that never lets go within ``timeout_s`` is left to it: the results are complete,
    and waiting longer would turn a rare abort at exit into a hang.
    """
    if not hasattr(tensors[0], "_use_count"):  # a torch without it: nothing to wait on
        return
    deadline = time.monotonic() + timeout_s
    while any(t._use_count() > 1 for t in tensors) and time.monotonic() < deadline:
        time.sleep(0.001)
