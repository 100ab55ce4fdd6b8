"""A torch.profiler (Kineto) trace file as events: reading it safely, and what its ops say.

:mod:`dplab.trace.profiler` rebuilds DDP steps from these; this module knows only the file:
how to find and read one (a folder, a ``.json``/``.json.gz``, a live profile object), the
``X`` events it holds, the sizes recorded with ``record_shapes=True`` (an op's ``Input Dims``
and ``Input type``), and on GPU which kernel a CPU range launched (Kineto's ``correlation``).
"""

from __future__ import annotations

import bisect
import math
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dplab.trace.files import read_json_file

NCCL_ALLREDUCE = ("ncclDevKernel_AllReduce", "ncclKernel_AllReduce")

FORMAT_NOTE = "torch.profiler (Kineto) trace"
MAX_PROFILER_TRACE_BYTES = 512 * 2**20  # after gunzip; real DDP traces of a few steps: 1-200 MB

# Kineto's names for element types (the ``Input type`` of an op), to bytes per element.
ELEMENT_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "half": 2,
    "bfloat16": 2,
    "int": 4,
    "long int": 8,
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
}


@dataclass(frozen=True)
class Event:
    name: str
    tid: Any
    start: float  # µs after the trace's baseTimeNanoseconds
    end: float
    args: Mapping[str, Any]
    cat: str = ""


# -- reading the files -------------------------------------------------------------------------


def read_trace(path: Path) -> Any:
    # refuses FIFOs, devices and traces past the cap; a cut .gz is one ValueError (files.py)
    return read_json_file(
        path,
        MAX_PROFILER_TRACE_BYTES,
        what=FORMAT_NOTE,
        hint="expected the file prof.export_chrome_trace() writes",
    )


def trace_files(folder: str | Path) -> list[Path]:
    """The candidate traces in a folder: ``*.json`` and ``*.json.gz`` (the tensorboard
    handler's ``*.pt.trace.json`` included)."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"no folder {root}")
    files = sorted(p for p in root.iterdir() if p.name.endswith((".json", ".json.gz")))
    if not files:
        raise FileNotFoundError(f"no *.json or *.json.gz profiler traces in {root}")
    return files


def is_kineto(doc: Any) -> bool:
    other = doc.get("otherData") if isinstance(doc, Mapping) else None
    return (
        isinstance(doc, Mapping)
        and isinstance(doc.get("traceEvents"), list)
        and "distributedInfo" in doc
        and not (isinstance(other, Mapping) and other.get("producer") == "dplab")
    )


def documents(source: Any) -> list[tuple[str, Any]]:
    """(label, parsed JSON) for each rank's trace in ``source``."""
    if hasattr(source, "export_chrome_trace"):
        with tempfile.TemporaryDirectory(prefix="dplab-profile-") as tmp:
            path = Path(tmp) / "trace.json"
            try:
                source.export_chrome_trace(str(path))
            except Exception as e:  # torch raises several kinds when nothing was recorded
                raise ValueError(
                    f"the profile object could not export a trace ({e}); was it stopped after "
                    "recording at least one active step?"
                ) from e
            return [("profile object", read_trace(path))]
    if isinstance(source, Mapping):
        return [("trace dict", source)]
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            # a run folder may hold other JSON too (dplab's own traces, notes): skip what is
            # not a Kineto trace, and say so if nothing is left
            docs = [(str(p), read_trace(p)) for p in trace_files(path)]
            kept = [(label, doc) for label, doc in docs if is_kineto(doc)]
            if not kept:
                raise ValueError(
                    f"none of the {len(docs)} JSON files in {path} is a {FORMAT_NOTE} "
                    "(no traceEvents with distributedInfo; dplab's own traces excepted)"
                )
            return kept
        return [(str(path), read_trace(path))]
    if isinstance(source, Sequence):
        return [d for item in source for d in documents(item)]
    raise ValueError(
        "from_profiler needs a trace file, a folder of them, a torch.profiler.profile object "
        f"or a parsed trace dict; got {type(source).__name__}"
    )


def events_of(label: str, doc: Any) -> tuple[dict[str, Any], list[Event]]:
    if not isinstance(doc, Mapping) or not isinstance(doc.get("traceEvents"), list):
        found = sorted(doc)[:6] if isinstance(doc, Mapping) else type(doc).__name__
        raise ValueError(
            f"{label} is not a {FORMAT_NOTE}: it has no traceEvents list (found {found})"
        )
    other = doc.get("otherData")
    if isinstance(other, Mapping) and other.get("producer") == "dplab":
        raise ValueError(
            f"{label} is a dplab trace (Chrome export of StepTraces), not a torch.profiler "
            "one: read the run's rank*.json with dplab.trace.load_run"
        )
    info = doc.get("distributedInfo")
    if not isinstance(info, Mapping) or "rank" not in info:
        raise ValueError(
            f"{label} has no distributedInfo with a rank: it was not recorded inside a "
            "torch.distributed job (init_process_group before profiling)"
        )
    events = []
    for e in doc["traceEvents"]:
        if not isinstance(e, Mapping) or e.get("ph") != "X":
            continue
        try:
            start = float(e["ts"])
            end = start + float(e.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        args = e.get("args") if isinstance(e.get("args"), Mapping) else {}
        events.append(
            Event(str(e.get("name", "")), e.get("tid"), start, end, args, e.get("cat", ""))
        )
    meta = {
        "rank": int(info["rank"]),
        "world_size": int(info.get("world_size", 1)),
        "backend": str(info.get("backend", "unknown")),
        "source": label,
        "record_shapes": bool(doc.get("record_shapes", False)),
        "host": doc.get("host_name"),
        # timestamps are µs after this wall-clock instant; kept apart, as adding it to every
        # timestamp would leave a double only a quarter-µs resolution
        "base_ns": int(doc.get("baseTimeNanoseconds", 0)),
    }
    return meta, events


# -- sizes -------------------------------------------------------------------------------------


def numel(dims: Any) -> int | None:
    if not isinstance(dims, list) or not all(isinstance(d, int) for d in dims):
        return None
    return math.prod(dims)


def launch_numel(e: Event) -> int | None:
    """numel of a ``c10d::allreduce_`` launch's tensor list (one flat bucket)."""
    dims = e.args.get("Input Dims")
    if not isinstance(dims, list) or not dims or not isinstance(dims[0], list):
        return None
    sizes = [numel(t) for t in dims[0]]
    return None if any(s is None for s in sizes) or not sizes else sum(sizes)


def element_bytes(e: Event | None) -> int | None:
    if e is None:
        return None
    if e.name.startswith(NCCL_ALLREDUCE):  # e.g. ncclDevKernel_AllReduce_Sum_f32_RING_LL
        return next((w for t, w in NCCL_DTYPES.items() if f"_{t}_" in f"{e.name}_"), None)
    types = e.args.get("Input type") or []
    return ELEMENT_BYTES.get(types[0]) if types and isinstance(types[0], str) else None


def logged_bucket_sizes(data: Mapping[str, Any] | None) -> list[int] | None:
    """Bucket bytes from ``_get_ddp_logging_data()``: the rebuilt buckets if DDP rebuilt them."""
    if not data:
        return None
    for key in ("rebuilt_bucket_sizes", "bucket_sizes"):
        text = data.get(key)
        if isinstance(text, str) and text.strip():
            try:
                return [int(x) for x in text.split(",")]
            except ValueError:
                raise ValueError(
                    f"ddp_logging_data[{key!r}] is not a list of ints: {text!r}"
                ) from None
    return None


# -- the GPU's clock ---------------------------------------------------------------------------

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
NCCL_DTYPES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "f8e4m3": 1, "f8e5m2": 1}


class GpuTimes:
    """When the GPU ran what a CPU range launched: each kernel is joined to the runtime call
    that launched it by Kineto's ``correlation`` id. (Unverified on a recorded GPU trace.)"""

    def __init__(self, events: Sequence[Event]) -> None:
        launched = {
            e.args["correlation"]: e.start
            for e in events
            if e.cat in LAUNCH_CATS and "correlation" in e.args
        }
        pairs = sorted(
            (launched[k.args["correlation"]], k.start, k)
            for k in events
            if k.cat in GPU_CATS and k.args.get("correlation") in launched
        )
        self.compute = [(t, k) for t, _, k in pairs if not k.name.startswith(NCCL_ALLREDUCE)]
        self.nccl = [(t, k) for t, _, k in pairs if k.name.startswith(NCCL_ALLREDUCE)]
        self._at = [t for t, _ in self.compute]

    def window(self, start: float, end: float) -> tuple[float, float] | None:
        """(first kernel start, last kernel end) of what was launched in [start, end]."""
        ks = [
            k
            for _, k in self.compute[
                bisect.bisect_left(self._at, start) : bisect.bisect_right(self._at, end)
            ]
        ]
        return (min(k.start for k in ks), max(k.end for k in ks)) if ks else None

    def on_gpu(self, start: float, end: float) -> tuple[float, float]:
        return self.window(start, end) or (start, end)
