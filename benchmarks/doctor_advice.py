"""Is the doctor's advice kept? A user's DDP job, diagnosed, then re-run at the advised cap.

The job is written here the way people write one, not with dplab: a small GPT (nanoGPT's
shape for a CPU run: 4 layers, 4 heads, 128 wide, 64 tokens, batch 12), AdamW, gradient
accumulation over 4 micro-batches with ``no_sync()`` on all but the last, torch's own
``DistributedDataParallel`` under ``torchrun --nproc-per-node 2`` (gloo), and
``torch.profiler`` with a ``schedule`` writing one trace per rank.

1. The job runs at torch's default cap and ``python -m dplab doctor``'s diagnosis is read:
   its advised cap (or, when it declines, the cap it judged best) and the caps to compare.
2. One torchrun runs the trials: in each, the job at the default cap, at the advised cap and at
   two other caps (a quarter and four times the advised one), in a shuffled order per trial,
   each a fresh model, DDP wrapper, optimizer and profiler.
3. Each trial's default-cap trace is diagnosed again: its predicted exposure at every cap and
   the gain interval at the advised cap are set against what the runs at those caps measured
   (the doctor's own reading of their traces: the exposure of the rank whose backward ended
   last, median over the profiled steps).

Reported: predicted vs realized exposure per cap (medians over trials, and whether within 30%
or 1 ms), the gain interval's coverage of the realized gain (trial by trial), how often the
doctor advised, and the current cap as inferred in every trial.

    flock /tmp/dplab-cpu.lock timeout 600 .venv/bin/python benchmarks/doctor_advice.py \
        [--trials 10] [--steps 5] [--keep DIR]
    .venv/bin/python benchmarks/doctor_advice.py --report DIR   # re-analyse a kept run
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT = "default"  # the cap left to torch (bucket_cap_mb not passed: 25 MiB, first 1 MiB)


# -- the user's job (runs on every rank under torchrun) ----------------------------------------


def _gpt(vocab: int = 65, block: int = 64, layers: int = 4, heads: int = 4, width: int = 128):
    """nanoGPT's shape, written plainly: token + position embedding, pre-norm blocks of causal
    self-attention and a 4x MLP, a tied head."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
            )

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.wte.weight  # tied, as in nanoGPT

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    return GPT()


def _train(out: Path, cap: str, steps: int, seed: int) -> None:
    """One run of the job at ``cap`` (a number of MiB, or DEFAULT): profiled optimizer steps."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, schedule

    rank = dist.get_rank()
    torch.manual_seed(seed)
    kwargs = {} if cap == DEFAULT else {"bucket_cap_mb": float(cap)}
    model = DDP(_gpt(), **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    accumulate, batch, block, vocab = 4, 12, 64, 65
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{rank}.pt.trace.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=1, warmup=1, active=steps),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for _ in range(2 + steps):
            for micro in range(accumulate):
                idx = torch.randint(vocab, (batch, block + 1), generator=gen)
                # the usual nanoGPT way: sync only on the last micro-batch
                model.require_backward_grad_sync = micro == accumulate - 1
                loss = model(idx[:, :-1], idx[:, 1:]) / accumulate
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    dist.barrier()


def worker(out: str, caps: list[str], trials: int, steps: int, seed: int) -> None:
    """Every rank: the runs of every trial, the caps in one shuffled order per trial."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        for t in range(trials):
            order = list(caps)
            random.Random(seed + t).shuffle(order)  # the same order on every rank
            for cap in order:
                _train(Path(out) / f"trial{t}" / cap, cap, steps, seed + t)
    finally:
        dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------


def _torchrun(out: Path, caps: list[str], trials: int, steps: int, seed: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), __file__, "--worker"]
    cmd += ["--out", str(out), "--caps", ",".join(caps), "--trials", str(trials)]
    cmd += ["--steps", str(steps), "--seed", str(seed)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TMPDIR=str(out))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}")


def _cap_name(cap_mb: float) -> str:
    return f"{cap_mb:.4g}"


def _measured(folder: Path) -> float:
    """The doctor's reading of a run's own trace: median exposure over its profiled steps."""
    from dplab.doctor import measured_steps
    from dplab.trace.profiler import from_profiler

    return statistics.median(m.exposed_ms for m in measured_steps(from_profiler(folder)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="profiled optimizer steps per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", default=None, help="keep the traces in this folder")
    parser.add_argument(
        "--report",
        default=None,
        help="only analyse the traces kept in this folder by an earlier --keep run",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--caps", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.out, args.caps.split(","), args.trials, args.steps, args.seed)
        return
    from dplab.doctor import diagnose

    if args.report:
        runs = Path(args.report) / "runs"
        caps = [float(c) for c in (runs / "caps.txt").read_text().split(",")]
        names = [DEFAULT, *(_cap_name(c) for c in caps)]
        trials = len([p for p in runs.iterdir() if p.name.startswith("trial")])
        report(runs, caps, names, trials)
        return
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dplab-doctor-"))
    t0 = time.perf_counter()
    try:
        _torchrun(root / "advice", [DEFAULT], 1, args.steps, args.seed + 1000)
        first = diagnose(str(root / "advice" / "trial0" / DEFAULT))
        print(first.summary(), "\n")
        advised = first.best_cap_mb
        others = [advised / 4, advised * 4]
        caps = [advised, *others]
        names = [DEFAULT, *(_cap_name(c) for c in caps)]
        _torchrun(root / "runs", names, args.trials, args.steps, args.seed)
        (root / "runs" / "caps.txt").write_text(",".join(str(c) for c in caps))
        report(root / "runs", caps, names, args.trials)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


def report(runs: Path, caps: list[float], names: list[str], trials: int) -> None:
    """Predicted (from each trial's default-cap trace) against realized (each cap's own run)."""
    from dplab.doctor import diagnose
    from dplab.trace.profiler import from_profiler

    predicted: dict[str, list[float]] = {n: [] for n in names}
    realized: dict[str, list[float]] = {n: [] for n in names}
    covered, advised_in, sources, rows = 0, 0, [], []
    bounds: dict[str, list[tuple[float, float]]] = {}
    for t in range(trials):
        folder = runs / f"trial{t}"
        d = diagnose(from_profiler(folder / DEFAULT), caps=caps)  # read once, used twice
        sources.append(d.cap_source)
        sweep = {_cap_name(s.cap_mb): s.exposed_ms for s in d.sweep}
        for s in d.sweep:
            bounds.setdefault(_cap_name(s.cap_mb), []).append((s.low_ms, s.high_ms))
        predicted[DEFAULT].append(d.predicted_current.median)
        for n in names:
            realized[n].append(d.measured_exposed.median if n == DEFAULT else _measured(folder / n))
            if n != DEFAULT:
                predicted[n].append(sweep[n])
        gain = realized[DEFAULT][-1] - realized[names[1]][-1]
        lo, hi = d.interval_at(caps[0])
        covered += lo <= gain <= hi
        advised_in += d.recommend
        rows.append((t, d.best_cap_mb, lo, hi, gain, d.recommend))
    print("per cap (medians over trials): predicted exposure from the default-cap trace, realized")
    print("(the prediction is the mean of the two bounds the trace leaves open, low to high)")
    print("  cap MiB    predicted ms   (low to high)     realized ms   within 30% or 1 ms")
    for n in names:
        p, r = statistics.median(predicted[n]), statistics.median(realized[n])
        key = "25" if n == DEFAULT else n
        lo = statistics.median(b[0] for b in bounds[key])
        hi = statistics.median(b[1] for b in bounds[key])
        ok = abs(p - r) <= max(0.3 * r, 1.0)
        print(
            f"  {n:>8}   {p:12.2f}   ({lo:5.2f} to {hi:5.2f})   {r:11.2f}   {'yes' if ok else 'NO'}"
        )
    print(f"\nper trial: the gain interval at the advised cap ({caps[0]:.3g} MiB), realized gain,")
    print("and the doctor's own best cap and verdict on that trial's default-cap trace")
    print("  trial   best cap   interval ms        realized ms   covered   advised")
    for t, best, lo, hi, gain, rec in rows:
        inside = lo <= gain <= hi
        print(
            f"  {t:>5}   {best:8.3g}   [{lo:6.2f}, {hi:6.2f}]   {gain:11.2f}   "
            f"{'yes' if inside else 'NO':>7}   {'yes' if rec else 'no':>7}"
        )
    print(f"\ncoverage: {covered}/{trials}; advised in {advised_in}/{trials} trials")
    counts = {s: sources.count(s) for s in sources}
    print("cap inferred: " + "; ".join(f"{k!r} x{v}" for k, v in counts.items()))
    if not math.isfinite(sum(predicted[DEFAULT])):
        raise SystemExit("a prediction was not finite")


if __name__ == "__main__":
    main()
