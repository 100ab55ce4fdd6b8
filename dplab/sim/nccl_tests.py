"""Reading nccl-tests ``all_reduce_perf`` output, as a learner pastes it from their own cluster.

A data line of nccl-tests (NVIDIA/nccl-tests ``src/common.cu``) is

    size  count  type  redop  root  | time  algbw  busbw  #wrong | time  algbw  busbw  #wrong

with the first trio out-of-place and the second in-place (µs, GB/s, GB/s). Variants seen in
published logs, all accepted: ``root`` missing (older versions), an error magnitude (``2e-07``)
instead of ``#wrong``, ``N/A`` for skipped checks, a rank prefix added by the launcher
(``0:`` from srun, ``[1,0]<stdout>:`` from Open MPI), thousands separators (``32_768``), and
trimmed tables of just ``size time algbw busbw``. Header and summary lines start with ``#``;
``#  Rank  3 Group ...`` lines count the ranks, ``NCCL version 2.18.5`` gives the version.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPES = {
    "int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float16", "float", "float32",
    "double", "float64", "bfloat16", "fp8_e4m3", "fp8_e5m2", "f8e4m3", "f8e5m2",
}  # fmt: skip
REDOPS = {"sum", "prod", "max", "min", "avg", "mulsum", "none"}
_PREFIX = re.compile(r"^\s*(?:\[[^\]]*\]<\w+>:|\d+:)\s?")
_RANK = re.compile(r"^#\s*Rank\s+(\d+)\b")
_VERSION = re.compile(r"NCCL version\s+(\d+\.\d+\.\d+)")
_NGPUS = re.compile(r"\bnGpus\s+(\d+)|\s-g\s+(\d+)\b")
ASSETS_DATA = Path(__file__).resolve().parents[2] / "assets" / "data"
PUBLISHED_JSON = ASSETS_DATA / "nccl-tests-published.json"


def published_runs() -> list[dict[str, Any]]:
    """The published nccl-tests runs the repository carries (``assets/data``, each with its source).

    They are the simulator's outside oracle: measured on clusters nobody here had, quoted from
    their sources, so the course checks its model against them in a learner's clone too.
    """
    return json.loads(PUBLISHED_JSON.read_text())


@dataclass(frozen=True)
class NcclTestsRow:
    """One size of an nccl-tests sweep. Times in µs, bandwidths in GB/s (1e9 B/s)."""

    bytes: int
    time_us: float
    algbw_GBps: float | None
    busbw_GBps: float | None
    in_place_time_us: float | None = None
    count: int | None = None
    dtype: str | None = None
    redop: str | None = None


@dataclass(frozen=True)
class NcclTestsRun:
    rows: list[NcclTestsRow]
    ranks: int | None
    nccl_version: str | None
    gpus_per_process: int | None = None  # nccl-tests' -g: one thread launching on g GPUs


def _int(tok: str) -> int | None:
    t = tok.replace("_", "").replace(",", "")
    return int(t) if t.isdigit() else None


def _num(tok: str) -> float | None:
    try:
        return float(tok)
    except ValueError:
        return None


def _parse_line(line: str, lineno: int) -> NcclTestsRow | None:
    toks = line.split()
    if not toks or _int(toks[0]) is None:
        return None
    size = _int(toks[0])
    lower = [t.lower() for t in toks]
    typ = next((i for i, t in enumerate(lower) if t in DTYPES), None)
    if typ is None:  # a trimmed table: size time algbw busbw
        vals = [_num(t) for t in toks[1:4]]
        if len(toks) >= 4 and all(v is not None for v in vals):
            return NcclTestsRow(size, vals[0], vals[1], vals[2])
    if typ != 2 or len(toks) < typ + 5 or lower[typ + 1] not in REDOPS:
        raise ValueError(
            f"line {lineno}: not an nccl-tests data line (size count type redop [root] time "
            f"algbw busbw ...): {line.strip()!r}"
        )
    i = typ + 2
    if (len(toks) - i) % 4 == 1:  # root, then one or two (time algbw busbw #wrong) groups
        i += 1
    trio = [_num(t) for t in toks[i : i + 3]]
    if any(v is None for v in trio):
        raise ValueError(f"line {lineno}: time/algbw/busbw are not numbers: {line.strip()!r}")
    rest = toks[i + 4 : i + 5]
    return NcclTestsRow(
        size,
        trio[0],
        trio[1],
        trio[2],
        in_place_time_us=_num(rest[0]) if rest else None,
        count=_int(toks[1]),
        dtype=lower[typ],
        redop=lower[typ + 1],
    )


def parse_nccl_tests(text: str) -> NcclTestsRun:
    """The rows (out-of-place, with the in-place time where printed) of an nccl-tests log."""
    if not isinstance(text, str):
        raise ValueError(f"nccl-tests output must be text, got {type(text).__name__}")
    rows: list[NcclTestsRow] = []
    ranks: set[int] = set()
    version = None
    gpus: int | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = _PREFIX.sub("", raw, count=1).strip()
        if m := _VERSION.search(line):
            version = m.group(1)
        if gpus is None and (m := _NGPUS.search(line)):
            gpus = int(m.group(1) or m.group(2))
        if line.startswith("#"):
            if m := _RANK.match(line):
                ranks.add(int(m.group(1)))
            continue
        row = _parse_line(line, lineno)
        if row is not None:
            rows.append(row)
    if not rows:
        raise ValueError("no nccl-tests data lines found (expected 'size count type redop ...')")
    return NcclTestsRun(rows, len(ranks) or None, version, gpus)


def format_nccl_tests(
    rows: list[tuple[int, float]], ranks: int, *, dtype: str = "float", prefix: str = ""
) -> str:
    """nccl-tests-style text for (bytes, µs) pairs: what ``all_reduce_perf`` prints, so a fit
    can be checked on output whose true parameters are known."""
    width = {"float": 4, "half": 2, "bfloat16": 2, "double": 8, "int8": 1}[dtype]
    bus = 2 * (ranks - 1) / ranks
    lines = [
        f"{prefix}# nThread 1 nGpus 1 minBytes 8 maxBytes 8589934592 step: 2(factor) "
        "warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0",
        f"{prefix}#",
        *(f"{prefix}#  Rank {r:2d} Group  0 Pid {1000 + r} on node device {r % 8}" for r in
          range(ranks)),
        f"{prefix}#",
        f"{prefix}#       size         count      type   redop    root     time   algbw   busbw "
        "#wrong     time   algbw   busbw #wrong",
        f"{prefix}#        (B)    (elements)                               (us)  (GB/s)  (GB/s)"
        "            (us)  (GB/s)  (GB/s)",
    ]  # fmt: skip
    for nbytes, us in rows:
        alg = nbytes / us / 1e3
        lines.append(
            f"{prefix}{nbytes:12d}  {nbytes // width:12d}  {dtype:>8}     sum      -1  "
            f"{us:7.5g}  {alg:6.2f}  {alg * bus:6.2f}      0  {us:7.5g}  {alg:6.2f}  "
            f"{alg * bus:6.2f}      0"
        )
    lines.append(f"{prefix}# Out of bounds values : 0 OK")
    return "\n".join(lines) + "\n"
