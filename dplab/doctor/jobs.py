"""A user's job to diagnose: torch's own DDP under torch.profiler, nothing of dplab in the step.

The doctor is checked on jobs whose trouble is known because it was put there: a data loader
that sleeps before every batch (the step waits for data), a model whose gradients are large
next to its compute (the step waits for its all-reduce), and torch's own variants of the
reducer (``gradient_as_bucket_view``, a bf16 compression hook). :func:`profile_torch_job` runs
one on every rank and writes one trace per rank, as a user's script would.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# ProfilerStep numbers of schedule(wait=1, warmup=1, active=3): the steps a trace holds
WAIT, WARMUP, ACTIVE = 1, 1, 3
# A step that took this many page faults (1 MiB of 4 KiB pages) wrote to fresh memory: on a
# virtual machine that can cost the wide job's backward more than its all-reduce.
FRESH_PAGES = 256


def wide_model(width: int = 1024) -> Any:
    """Two ``width``-square linear layers: 8 MiB of gradients at 1024 for little compute on a
    batch of 2, so the all-reduce outweighs backward (a comms-bound step)."""
    import torch

    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(width, width)
            self.b = torch.nn.Linear(width, width)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.b(self.a(x)), y)

    torch.manual_seed(0)
    return Wide()


def slow_loader(model: str, batch_size: int, sleep_s: float, seed: int) -> Iterator[Any]:
    """Batches of ``model``'s kind (``"wide"`` or a :func:`dplab.models.make_batch` preset),
    each after ``sleep_s`` of waiting: a loader that cannot keep up (disk, decoding)."""
    import torch

    from dplab.models import make_batch

    k = 0
    while True:
        time.sleep(sleep_s)
        if model == "wide":
            g = torch.Generator().manual_seed(seed + k)
            yield torch.randn(2, 1024, generator=g), torch.randn(2, 1024, generator=g)
        else:
            yield make_batch(model, batch_size, seed=seed + k)
        k += 1


def _bf16(state, bucket):  # unannotated: torch accepts no annotation but GradBucket, Future
    """torch's ``bf16_compress_hook``, registered under another name: torch refuses that name
    unless CUDA and NCCL are there (``DistributedDataParallel.register_comm_hook``), though
    the function itself runs on gloo."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def profile_torch_job(
    out: str,
    model: str = "mlp",
    *,
    bucket_cap_mb: float | None = None,
    loader_sleep_s: float = 0.0,
    gradient_as_bucket_view: bool = False,
    set_to_none: bool = True,
    bf16_hook: bool = False,
    batch_size: int = 8,
) -> dict[str, Any]:
    """On every rank: torch's DDP of ``model`` (``"wide"``: :func:`wide_model`; else a
    :func:`dplab.models.make_model` preset), profiled with ``record_shapes=True`` and a
    schedule, one trace per rank in ``out``. ``bucket_cap_mb=None`` leaves torch's default.

    Returns torch's ``_get_ddp_logging_data()``, ``step_ms``: each profiled iteration as the
    job's own clock saw it (``time.perf_counter`` from the top of the loop to ``prof.step()``),
    to check the trace by, and ``step_faults``: the page faults the training thread took in
    it (:func:`thread_page_faults`; ``None`` where the system does not count them).
    ``ProfilerStep#k`` runs from the end of one ``prof.step()`` to the start of the next: the
    profiler's own work inside the call (starting its trace, at the first active step:
    milliseconds) is in no step, and is left out here too.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, schedule

    from dplab.models import make_model

    rank = dist.get_rank()
    net = wide_model() if model == "wide" else make_model(model, seed=0)
    ddp = DistributedDataParallel(
        net, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view
    )
    if bf16_hook:
        ddp.register_comm_hook(None, _bf16)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / f"rank{rank}.pt.trace.json"
    batches = slow_loader(model, batch_size, loader_sleep_s, seed=100 * rank)
    steps, faults = {}, {}
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for k in range(WAIT + WARMUP + ACTIVE):
            start, start_faults = time.perf_counter(), thread_page_faults()
            x, y = next(batches)
            ddp(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            if k >= WAIT + WARMUP:  # ProfilerStep#k is iteration k
                steps[k] = (time.perf_counter() - start) * 1e3
                end_faults = thread_page_faults()
                faults[k] = None if start_faults is None else end_faults - start_faults
            prof.step()
    return {"logging": ddp._get_ddp_logging_data(), "step_ms": steps, "step_faults": faults}


def thread_page_faults() -> int | None:
    """Page faults this thread has taken: first writes to memory the process had not used.

    A step that writes its gradients to fresh pages pays for each (microseconds on a virtual
    machine, more where the host has taken the page back), and that time lands in backward,
    where no bucket cap moves it. ``None`` where the system does not count a thread's faults.
    """
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    who = getattr(resource, "RUSAGE_THREAD", None)  # Linux only
    return None if who is None else resource.getrusage(who).ru_minflt


def median_step_faults(results: list[dict[str, Any]]) -> float:
    """The page faults of the median profiled step, each step read on the rank that took the
    most, from every rank's :func:`profile_torch_job` result (an uncounted step reads 0)."""
    steps = results[0]["step_ms"]
    return statistics.median(max(r["step_faults"][k] or 0 for r in results) for k in steps)
