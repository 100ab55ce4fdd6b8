"""How the traces beside this file were recorded: torch's own DDP on 2 gloo ranks (CPU).

    .venv/bin/python assets/traces/torch-ddp-tiny-gpt-2ranks-cap0.5/record.py

tiny-gpt, batch 8 per rank, SGD, ``DistributedDataParallel(bucket_cap_mb=0.5)``, torch.profiler
with ``record_shapes=True`` and ``schedule(wait=1, warmup=1, active=3)``: steps 2, 3 and 4 are
in the traces (``rank{r}.pt.trace.json.gz``). ``recorded.json`` says where and when, and holds
each rank's ``ddp._get_ddp_logging_data()`` (torch's own bucket sizes and timings).
Read them with ``dplab.trace.profiler.from_profiler(folder)`` or ``python -m dplab doctor``.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

import dplab

HERE = Path(__file__).resolve().parent
CAP_MB = 0.5


def record(out: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, schedule

    from dplab.models import make_batch, make_model

    rank = dist.get_rank()
    ddp = DistributedDataParallel(make_model("tiny-gpt", seed=0), bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    path = Path(out) / f"rank{rank}.pt.trace.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=1, warmup=1, active=3),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for i in range(5):
            x, y = make_batch("tiny-gpt", 8, seed=100 * i + rank)
            ddp(x, y).backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    with open(path, "rb") as f, gzip.open(f"{path}.gz", "wb", compresslevel=9) as g:
        shutil.copyfileobj(f, g)
    path.unlink()
    return ddp._get_ddp_logging_data()


if __name__ == "__main__":
    load = [round(x, 2) for x in os.getloadavg()]
    logging = dplab.launch(record, 2, args=(str(HERE),))
    import platform

    import torch

    meta = {
        "what": "torch DistributedDataParallel, tiny-gpt, 2 gloo ranks, bucket_cap_mb=0.5",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "load_average_before": load,
        "ddp_logging_data": logging,
    }
    (HERE / "recorded.json").write_text(json.dumps(meta, indent=1) + "\n")
