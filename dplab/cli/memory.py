"""``python -m dplab memory``: one rank's memory for a model, a recipe and a GPU, and the verdict.

python -m dplab memory --model llama2-7b --gpu h100-80gb
python -m dplab memory --model llama2-7b --gpu h100-80gb --zero-stage 1 --world-size 64
python -m dplab memory --params 7e9 --gpu h100-80gb
"""

from __future__ import annotations

import argparse
import sys

from dplab.memory.activations import RECOMPUTE
from dplab.memory.fit import fits, fmt_gb
from dplab.memory.presets import GPUS, LLM_SHAPES
from dplab.memory.recipes import (
    OPTIMIZER_LABELS,
    OPTIMIZERS,
    PRECISION_LABELS,
    PRECISIONS,
    bytes_per_param,
)
from dplab.memory.state import STAGE_LABELS

_ROWS = [
    ("weights", "weights"),
    ("grads", "gradients"),
    ("master_weights", "fp32 master weights"),
    ("optimizer_state", "optimizer state"),
    ("activations", "activations"),
]


def report(args: argparse.Namespace) -> str:
    """The text the verb prints (built from :func:`~dplab.memory.fit.fits`)."""
    model = args.model if args.params is None else args.params
    fit = fits(
        model,
        args.gpu,
        precision=args.precision,
        optimizer=args.optimizer,
        world_size=args.world_size,
        zero_stage=args.zero_stage,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        recompute=args.recompute,
    )
    per = bytes_per_param(args.precision, args.optimizer)
    name = fit.model.name if args.params is None else "a custom model"
    lines = [
        f"{name}: {fit.n_params:,} parameters"
        + (" (computed from its config)" if args.params is None else ""),
        f"GPU: {fit.gpu.name}, {fit.gpu.memory_gib} GiB = {fmt_gb(fit.gpu.capacity_bytes)}",
        f"recipe: {PRECISION_LABELS[args.precision]}, {OPTIMIZER_LABELS[args.optimizer]}: "
        f"{per.total} B/param (weights {per.weights}, grads {per.grads}, "
        f"master {per.master_weights}, optimizer {per.optimizer_state})",
        f"per rank, {STAGE_LABELS[args.zero_stage]}, world size {args.world_size:,}:",
    ]
    parts = fit.parts()
    for key, label in _ROWS:
        lines.append(f"  {label:<22}{fmt_gb(parts[key]):>12}")
    lines.append(f"  {'total':<22}{fmt_gb(fit.total):>12}")
    act = (
        f"activations: micro-batch {args.micro_batch} × {args.seq_len} tokens, GPT block "
        f"(Korthikanti et al. 2022), 16-bit, recompute={args.recompute}"
    )
    if args.params is not None:
        act += f", for a {fit.model.name}"
    lines.append(act)
    lines.append(fit.reason)
    return "\n".join(lines)


def cmd_memory(args: argparse.Namespace) -> int:
    if args.list:
        print("models:")
        for m in LLM_SHAPES.values():
            print(f"  {m.key:<14}{m.name:<18}{m.n_params:>18,} parameters")
        print("gpus:")
        for g in GPUS.values():
            print(f"  {g.key:<14}{g.name:<18}{g.memory_gib:>5} GiB = {fmt_gb(g.capacity_bytes)}")
        return 0
    try:
        print(report(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _count(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``memory`` verb."""
    p = subparsers.add_parser(
        "memory",
        help="per-rank memory of a model under DP/ZeRO on a GPU, and whether it fits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="llama2-7b", choices=list(LLM_SHAPES))
    p.add_argument("--params", type=_count, help="a bare parameter count instead of --model")
    p.add_argument("--gpu", default="h100-80gb", choices=list(GPUS))
    p.add_argument("--precision", default="mixed", choices=list(PRECISIONS))
    p.add_argument("--optimizer", default="adam", choices=list(OPTIMIZERS))
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--recompute", default="none", choices=list(RECOMPUTE))
    p.add_argument("--list", action="store_true", help="list the model and GPU presets")
    p.set_defaults(func=cmd_memory)
