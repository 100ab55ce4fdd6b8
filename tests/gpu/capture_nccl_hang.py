"""Record what a hung NCCL collective prints, on a real GPU, for the hang-triage lesson.

One GPU cannot host two NCCL ranks, so no rank can be *behind* another here. What one rank can
show is everything a user sees when a collective never completes: the stream the collective
waits on is held by a long ``torch.cuda._sleep`` kernel, so the all-reduce is enqueued but does
not finish within the group's timeout. NCCL's watchdog then prints its timeout line
(``WorkNCCL(SeqNum=…, OpType=…, NumelIn=…)``, last enqueued / last completed), dumps the flight
recorder (``TORCH_NCCL_DUMP_ON_TIMEOUT``) and takes the process down; ``NCCL_DEBUG=INFO`` adds
NCCL's own start-up lines. The recorded log and the dump are kept as they were printed and
written, labelled with the date, the hardware and the torch and NCCL versions.

    python tests/gpu/capture_nccl_hang.py --out "$OUT"

writes ``nccl_hang.log`` (the hung rank's stderr), ``nccl_trace_rank_0`` (its flight-recorder
dump, as torch wrote it), ``frtrace.txt`` (torch's ``torchfrtrace`` on that dump) and
``nccl_hang.json`` (versions, hardware, exit code).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

TIMEOUT_S = 5
SLEEP_S = 40  # far past the timeout: the watchdog must fire before the kernel ends


def hung_rank(out: Path) -> None:
    """The rank: a few collectives that complete, then one whose stream is held past the timeout."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = dist.HashStore()
    dist.init_process_group(
        "nccl",
        store=store,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=TIMEOUT_S),
        device_id=torch.device("cuda", 0),
    )
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    side = dist.new_group([0])
    dist.broadcast(torch.ones(4096, device="cuda"), src=0, group=side)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(SLEEP_S * 2.0e9))  # cycles: about SLEEP_S at the H200's 1.98 GHz
    dist.all_reduce(
        torch.ones(12_345, device="cuda")
    )  # enqueued behind the sleep: never done in time
    torch.cuda.synchronize()
    print("the hung all-reduce completed: the watchdog did not fire", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rank:
        hung_rank(args.out)
        return 0
    prefix = str(args.out / "nccl_trace_rank_")
    env = dict(
        os.environ,
        NCCL_DEBUG="INFO",
        TORCH_NCCL_DUMP_ON_TIMEOUT="1",
        TORCH_FR_BUFFER_SIZE="2000",
        TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
        TORCH_FR_DUMP_TEMP_FILE=prefix,
        TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix,
    )
    with open(args.out / "nccl_hang.log", "w") as log:
        rc = subprocess.run(
            [sys.executable, __file__, "--out", str(args.out), "--rank"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=SLEEP_S + 60,
        ).returncode
    dumps = sorted(p.name for p in args.out.glob("nccl_trace_rank_*"))
    fr = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            str(args.out),
            "--prefix",
            "nccl_trace_rank_",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    (args.out / "frtrace.txt").write_text(
        f"$ torchfrtrace {args.out} --prefix nccl_trace_rank_\n(exit {fr.returncode})\n"
        + fr.stdout
        + fr.stderr
    )
    import torch

    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "rank_exit_code": rc,
        "dumps": dumps,
        "timeout_s": TIMEOUT_S,
    }
    (args.out / "nccl_hang.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta))
    return 0 if dumps else 1


if __name__ == "__main__":
    sys.exit(main())
