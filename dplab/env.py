"""What this process runs on: the machine (for provenance), its GPUs, the backend, torchrun.

Kept at the bottom layer because launching ranks, benchmarks and recorded assets all need it,
and none of them should import a benchmark to learn which CPU they ran on.
"""

from __future__ import annotations

import os
import platform
from typing import Any

__all__ = ["gpu_count", "in_torchrun", "machine_info", "resolve_backend", "usable_cpus"]


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model, cores, OS, torch, Python."""
    import torch

    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_model": model,
        "cpu_cores": os.cpu_count(),
        "usable_cores": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def gpu_count() -> int:
    """GPUs torch can see, without creating a CUDA context in this process."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int, *, gpus: int | None = None) -> str:
    """``auto`` → nccl when there is one GPU per rank, else gloo; check an explicit choice.

    NCCL refuses two ranks on one GPU, so nccl with fewer GPUs than ranks is an error here rather
    than a hang later.
    """
    import torch.distributed as dist

    gpus = gpu_count() if gpus is None else gpus
    if backend == "auto":
        return "nccl" if gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend == "gloo":
        if not dist.is_gloo_available():
            raise RuntimeError("this torch build has no gloo backend")
        return backend
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("backend='nccl' but this torch build has no NCCL (a CPU build?)")
        if gpus < world_size:
            raise ValueError(
                f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size} but "
                f"{gpus} GPU(s) visible. NCCL cannot put two ranks on one GPU; use "
                "backend='gloo' (CPU tensors, or CUDA tensors on a shared GPU)."
            )
        return backend
    raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")


def in_torchrun() -> bool:
    """True inside torchrun (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists: how a leftover of a dead owner (rank logs, namespaces) is
    told from one whose owner still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
