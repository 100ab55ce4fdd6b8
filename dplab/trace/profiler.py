"""``from_profiler``: a torch.profiler (Kineto) trace of a torch DDP job as dplab ``StepTrace``s.

The course measures steps inside dplab; a learner's own job runs torch's
``DistributedDataParallel`` and can only be watched from outside. ``torch.profiler`` records
enough to rebuild the same timeline, without touching the job:

- steps: the ``ProfilerStep#N`` ranges that ``prof.step()`` opens (only with a ``schedule=``);
- ``forward``: each ``DistributedDataParallel.forward`` annotation in the step;
- ``backward``: from the first autograd op after a forward (``autograd::engine::
  evaluate_function: …``) to the end of the last gradient accumulation
  (``torch::autograd::AccumulateGrad``), as :class:`dplab.Tracer` ends backward with the last
  gradient; DDP's hooks run just after it, inside the engine's evaluate_function, so launching
  the last bucket belongs to the wait;
- gradients: each ``torch::distributed::reducer::mul_out`` is the reducer copying (and dividing)
  one gradient into its bucket, in its hook right after the gradient's accumulation, whose end
  is the moment the gradient was ready; its recorded input (``record_shapes=True``) is the
  gradient's shape;
- ``allreduce``: on CPU the ``gloo:all_reduce`` range on a gloo worker thread (from when a worker
  started it: the start the Tracer draws), matched in order to the ``c10d::allreduce_`` launch
  on the training thread, and ending where the range ends unless the training thread proves it
  done earlier (see :func:`_completions`); on GPU the NCCL all-reduce kernel;
- ``wait``: from the end of backward until the reducer has copied the last reduced bucket back
  (``copy_bucket_to_grad``) or the last all-reduce ended;
- ``optimizer``: ``Optimizer.step#…``.

On GPU every compute range is moved to the kernels it launched (joined by Kineto's
``correlation`` ids), so that compute and NCCL kernels share the GPU's clock.

Bucket sizes come from the launches' recorded input sizes (``record_shapes=True``), otherwise
from ``ddp._get_ddp_logging_data()`` when it is passed. Times are ms from the step's first
forward; ``origin_ms`` places that on one time base for all ranks (Kineto's timestamps are
wall-clock microseconds, shared by the ranks of one host).

The GPU path has not been checked against a recorded GPU trace yet (no GPU was lent when it
was written): it follows Kineto's event schema, and its steps say ``meta["verified"] = False``.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dplab.trace.step import Span, StepTrace

STEP_PREFIX = "ProfilerStep#"
FORWARD = "DistributedDataParallel.forward"
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "
ACCUMULATED = "torch::autograd::AccumulateGrad"
GRAD_READY = "torch::distributed::reducer::mul_out"
COPY_BACK = "torch.distributed.ddp.reducer::copy_bucket_to_grad"
OPTIMIZER_PREFIX = "Optimizer.step#"
ALLREDUCE_LAUNCH = "c10d::allreduce_"
GLOO_ALLREDUCE = "gloo:all_reduce"
NCCL_ALLREDUCE = ("ncclDevKernel_AllReduce", "ncclKernel_AllReduce")
FORMAT_NOTE = "torch.profiler (Kineto) trace"

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
class _Event:
    name: str
    tid: Any
    start: float  # µs after the trace's baseTimeNanoseconds
    end: float
    args: Mapping[str, Any]
    cat: str = ""


# -- reading the files -------------------------------------------------------------------------


def _read(path: Path) -> Any:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"no profiler trace at {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable {FORMAT_NOTE}: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not JSON ({e.msg} at character {e.pos} of {len(text)}); expected the "
            "file prof.export_chrome_trace() writes"
        ) from None


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


def _is_kineto(doc: Any) -> bool:
    other = doc.get("otherData") if isinstance(doc, Mapping) else None
    return (
        isinstance(doc, Mapping)
        and isinstance(doc.get("traceEvents"), list)
        and "distributedInfo" in doc
        and not (isinstance(other, Mapping) and other.get("producer") == "dplab")
    )


def _documents(source: Any) -> list[tuple[str, Any]]:
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
            return [("profile object", _read(path))]
    if isinstance(source, Mapping):
        return [("trace dict", source)]
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            # a run folder may hold other JSON too (dplab's own traces, notes): skip what is
            # not a Kineto trace, and say so if nothing is left
            docs = [(str(p), _read(p)) for p in trace_files(path)]
            kept = [(label, doc) for label, doc in docs if _is_kineto(doc)]
            if not kept:
                raise ValueError(
                    f"none of the {len(docs)} JSON files in {path} is a {FORMAT_NOTE} "
                    "(no traceEvents with distributedInfo; dplab's own traces excepted)"
                )
            return kept
        return [(str(path), _read(path))]
    if isinstance(source, Sequence):
        return [d for item in source for d in _documents(item)]
    raise ValueError(
        "from_profiler needs a trace file, a folder of them, a torch.profiler.profile object "
        f"or a parsed trace dict; got {type(source).__name__}"
    )


def _events(label: str, doc: Any) -> tuple[dict[str, Any], list[_Event]]:
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
            _Event(str(e.get("name", "")), e.get("tid"), start, end, args, e.get("cat", ""))
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


def _numel(dims: Any) -> int | None:
    if not isinstance(dims, list) or not all(isinstance(d, int) for d in dims):
        return None
    return math.prod(dims)


def _launch_numel(e: _Event) -> int | None:
    """numel of a ``c10d::allreduce_`` launch's tensor list (one flat bucket)."""
    dims = e.args.get("Input Dims")
    if not isinstance(dims, list) or not dims or not isinstance(dims[0], list):
        return None
    sizes = [_numel(t) for t in dims[0]]
    return None if any(s is None for s in sizes) or not sizes else sum(sizes)


def _element_bytes(e: _Event | None) -> int | None:
    if e is None:
        return None
    if e.name.startswith(NCCL_ALLREDUCE):  # e.g. ncclDevKernel_AllReduce_Sum_f32_RING_LL
        return next((w for t, w in NCCL_DTYPES.items() if f"_{t}_" in f"{e.name}_"), None)
    types = e.args.get("Input type") or []
    return ELEMENT_BYTES.get(types[0]) if types and isinstance(types[0], str) else None


def _logged_bucket_sizes(data: Mapping[str, Any] | None) -> list[int] | None:
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


# -- one rank ----------------------------------------------------------------------------------

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
NCCL_DTYPES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "f8e4m3": 1, "f8e5m2": 1}


class _GpuTimes:
    """When the GPU ran what a CPU range launched: each kernel is joined to the runtime call
    that launched it by Kineto's ``correlation`` id. (Unverified on a recorded GPU trace.)"""

    def __init__(self, events: Sequence[_Event]) -> None:
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


def _accumulations(events: Sequence[_Event], launches: Sequence[_Event]) -> list[_Event]:
    """Each gradient accumulation, ending where its gradient was ready.

    A hook registered on the tensor (``register_post_accumulate_grad_hook``, as dplab.DDP does)
    runs inside the accumulation's range, and a collective launched from it is no part of
    computing the gradient: such a range ends where the first launch inside it begins. (torch
    DDP's reducer hooks the autograd node instead, outside the range.)
    """
    starts = [e.start for e in launches]
    out = []
    for e in events:
        if e.name != ACCUMULATED:
            continue
        k = bisect.bisect_left(starts, e.start)
        end = starts[k] if k < len(starts) and starts[k] < e.end else e.end
        out.append(_Event(e.name, e.tid, e.start, end, e.args, e.cat))
    return out


def _within(events: Sequence[_Event], start: float, end: float) -> list[_Event]:
    return [e for e in events if start <= e.start < end]


def _match_runs(launches: list[_Event], runs: list[_Event]) -> dict[int, _Event]:
    """Which gloo run belongs to which launch (index into ``launches``).

    Gloo queues collectives and its worker threads take them first in, first out, so the k-th
    run of a size started after the k-th launch of that size. Runs are matched greedily in start
    order to the earliest unmatched launch of the same size that came before them.
    """
    out: dict[int, _Event] = {}
    used = [False] * len(launches)
    first = 0  # every launch before this one is matched
    for run in sorted(runs, key=lambda e: e.start):
        size = _numel(run.args.get("Input Dims", [None])[0]) if run.args.get("Input Dims") else None
        while first < len(launches) and used[first]:
            first += 1
        for i in range(first, len(launches)):
            launch = launches[i]
            if launch.start > run.start:
                break
            if used[i]:
                continue
            if size is not None and _launch_numel(launch) not in (None, size):
                continue
            used[i] = True
            out[i] = run
            break
    return out


def _rank_steps(
    meta: dict[str, Any],
    events: list[_Event],
    *,
    forward_name: str,
) -> list[tuple[int, float, dict[str, Any]]]:
    """(step number, its first forward's start in the file's µs, raw step) for every profiled
    step of one rank."""
    label = meta["source"]
    steps = sorted((e for e in events if e.name.startswith(STEP_PREFIX)), key=lambda e: e.start)
    if not steps:
        raise ValueError(
            f"{label} has no {STEP_PREFIX}N ranges, so its steps cannot be found: profile with "
            "schedule=torch.profiler.schedule(...) and call prof.step() once per step"
        )
    forwards = [e for e in events if e.name == forward_name]
    if not forwards:
        raise ValueError(
            f"{label} has no {forward_name!r} range: it is not a trace of a torch "
            "DistributedDataParallel job (pass forward_name= for a module whose forward is "
            "annotated otherwise)"
        )
    nccl = [e for e in events if e.name.startswith(NCCL_ALLREDUCE)]
    gloo = [e for e in events if e.name == GLOO_ALLREDUCE]
    launches_all = sorted((e for e in events if e.name == ALLREDUCE_LAUNCH), key=lambda e: e.start)
    if not nccl and not gloo:
        raise ValueError(
            f"{label} has no all-reduce: neither {GLOO_ALLREDUCE!r} ranges (gloo, CPU) nor "
            f"{' / '.join(n + '*' for n in NCCL_ALLREDUCE)} kernels (NCCL, GPU); was the "
            "profiled job synchronising gradients (not under no_sync(), world size > 1)?"
        )
    gpu = bool(nccl)
    runs = _match_runs(launches_all, gloo) if not gpu else {}
    nccl_sorted = sorted(nccl, key=lambda e: e.start)
    times = _GpuTimes(events) if gpu else None
    autograd = [e for e in events if e.name.startswith(AUTOGRAD_PREFIX)]
    accumulations = _accumulations(events, launches_all)
    grads = [e for e in events if e.name == GRAD_READY]
    copies = [e for e in events if e.name == COPY_BACK]
    optimizers = [e for e in events if e.name.startswith(OPTIMIZER_PREFIX)]
    out = []
    for step in steps:
        number = (
            int(step.name[len(STEP_PREFIX) :])
            if step.name[len(STEP_PREFIX) :].isdigit()
            else len(out)
        )
        fwd = sorted(_within(forwards, step.start, step.end), key=lambda e: e.start)
        if not fwd:
            continue
        bounds = [f.start for f in fwd[1:]] + [step.end]
        backwards = []
        for f, until in zip(fwd, bounds, strict=True):
            ops = _within(autograd, f.end, until)
            if not ops:
                continue
            # the accumulation itself, without the post hooks (DDP's) that run inside the
            # engine's evaluate_function around it
            acc = _within(accumulations, f.end, until) or ops
            backwards.append((min(e.start for e in ops), max(e.end for e in acc)))
            ops_end = max(e.end for e in ops)
        if not backwards:
            raise ValueError(
                f"{label}, step {number}: no backward ops ({AUTOGRAD_PREFIX}…) after the "
                "forward; was backward() called inside the profiled step?"
            )
        last_fwd_end = fwd[-1].end
        idx = [i for i, e in enumerate(launches_all) if last_fwd_end <= e.start < step.end]
        comms = []
        if gpu:
            # NCCL kernels launched from this step's backward (by correlation), else those
            # that ran in its range
            kernels = [k for t, k in times.nccl if last_fwd_end <= t < step.end] or [
                k for k in nccl_sorted if step.start <= k.start < step.end
            ]
            for b, k in enumerate(sorted(kernels, key=lambda k: k.start)):
                launch = launches_all[idx[b]] if b < len(idx) else None
                comms.append((b, launch, k))
        else:
            for b, i in enumerate(idx):
                if i in runs:
                    comms.append((b, launches_all[i], runs[i]))
        if not comms:
            raise ValueError(
                f"{label}, step {number}: no all-reduce was launched after the forward "
                "(was this step under no_sync()?)"
            )
        opt = sorted(_within(optimizers, last_fwd_end, step.end), key=lambda e: e.start)
        step_grads = sorted(_within(grads, backwards[-1][0], step.end), key=lambda e: e.end)
        done = sorted(e.end for e in _within(accumulations, backwards[-1][0], step.end))
        step_copies = _within(copies, backwards[-1][0], step.end)
        raw = {
            "window": (step.start, step.end),
            "forwards": [(f.start, f.end) for f in fwd],
            "backwards": backwards,
            "ops_end": ops_end,
            "comms": comms,
            "copies": step_copies,
            "copy_end": max((c.end for c in step_copies), default=None),
            "optimizer": [(o.start, o.end) for o in opt[:1]],
            "grads": step_grads,
            "ready": [_ready_cpu(done, g) for g in step_grads],
            "gpu": gpu,
        }
        if times is not None:
            _to_gpu_times(raw, times, step_copies)
        out.append((number, raw["forwards"][0][0], raw))
    if not out:
        raise ValueError(
            f"{label}: none of its {len(steps)} {STEP_PREFIX}N ranges holds a {forward_name!r}"
        )
    return out


def _ready_cpu(done: Sequence[float], grad: _Event) -> float:
    """A gradient is ready when the accumulation just before the reducer's hook ended."""
    k = bisect.bisect_right(done, grad.start)
    return done[k - 1] if k else grad.start


def _to_gpu_times(raw: dict[str, Any], times: _GpuTimes, copies: Sequence[_Event]) -> None:
    """On GPU the CPU only launches: move every compute range to the kernels it launched."""
    raw["forwards"] = [times.on_gpu(a, b) for a, b in raw["forwards"]]
    raw["backwards"] = [times.on_gpu(a, b) for a, b in raw["backwards"]]
    raw["ops_end"] = max(raw["backwards"][-1][1], times.on_gpu(raw["ops_end"], raw["ops_end"])[1])
    raw["optimizer"] = [times.on_gpu(a, b) for a, b in raw["optimizer"]]
    # the reducer's copy of a gradient into its bucket is a kernel: its end is when it is in
    raw["ready"] = [
        (times.window(g.start, g.end) or (0.0, r))[1]
        for g, r in zip(raw["grads"], raw["ready"], strict=True)
    ]
    ends = [w[1] for c in copies if (w := times.window(c.start, c.end))]
    raw["copy_end"] = max(ends, default=None)
    raw["copies"] = []  # no clamping: an NCCL kernel's end is the GPU's own


def _bucket_sizes(raw: dict[str, Any], logged: list[int] | None) -> tuple[list[int], str]:
    comms = raw["comms"]
    sizes: list[int | None] = []
    for _, launch, run in comms:
        numel = _launch_numel(launch) if launch is not None else None
        if numel is None and run is not None and run.args.get("Input Dims"):
            numel = _numel(run.args["Input Dims"][0])
        width = _element_bytes(run) or _element_bytes(launch)
        sizes.append(numel * width if numel is not None and width else None)
    if all(s is not None for s in sizes):
        return [int(x) for x in sizes if x is not None], "record_shapes"
    if logged is not None and len(logged) == len(comms):
        return list(logged), "ddp_logging_data"
    if logged is not None:
        raise ValueError(
            f"the step has {len(comms)} all-reduces but ddp_logging_data lists {len(logged)} "
            "buckets: is it the same job, after its buckets were rebuilt?"
        )
    raise ValueError(
        "the all-reduces' sizes were not recorded: profile with record_shapes=True, or pass "
        "ddp_logging_data=ddp._get_ddp_logging_data()"
    )


def _grad_rows(raw: dict[str, Any], backward_start: float) -> list[dict[str, Any]]:
    """Each gradient torch's reducer took (one ``mul_out`` each, in its post-accumulate hook),
    with its ready time (:func:`_ready_cpu`, or on GPU its bucket copy's kernel end)."""
    rows = []
    for g, ready in zip(raw["grads"], raw["ready"], strict=True):
        dims = g.args.get("Input Dims")
        numel = _numel(dims[0]) if dims else None
        width = _element_bytes(g)
        types = g.args.get("Input type") or [None]
        rows.append(
            {
                "numel": numel,
                "nbytes": numel * width if numel is not None and width else None,
                "dtype": types[0],
                "ready_ms": (ready - backward_start) / 1e3,
            }
        )
    return rows


def _assign_params(grads: list[dict[str, Any]], sizes: list[int | None]) -> list[list[int]] | None:
    """Gradients (in ready order) per bucket: torch's rebuilt buckets are runs of that order, so
    cumulative bytes must meet each bucket's size exactly; otherwise None (not inferable)."""
    if not grads or any(g["nbytes"] is None for g in grads) or any(s is None for s in sizes):
        return None
    out, k = [], 0
    for size in sizes:
        members, total = [], 0
        while k < len(grads) and total < size:
            members.append(k)
            total += grads[k]["nbytes"]
            k += 1
        if total != size:
            return None
        out.append(members)
    return out if k == len(grads) else None


def _completions(raw: dict[str, Any], members: list[list[int]] | None) -> list[float]:
    """When each all-reduce was done: the end of its gloo range, unless the trace proves it
    done earlier.

    Gloo closes its range in a callback on the work's future, after the result is already
    visible; on a busy machine the worker can be descheduled in between and the range can even
    end after the optimizer has stepped. The training thread bounds it: torch's reducer copies
    bucket b back (``copy_bucket_to_grad``, one per gradient, bucket by bucket) only once b is
    done, and nothing steps the optimizer before every bucket is.
    """
    ends = [run.end for _, _, run in raw["comms"]]
    copies = sorted(raw["copies"], key=lambda e: e.start)
    if members and len(copies) == sum(len(m) for m in members):
        k = 0
        for b, m in enumerate(members):
            if m:
                ends[b] = min(ends[b], copies[k].start)
            k += len(m)
    if raw["optimizer"]:
        ends = [min(e, raw["optimizer"][0][0]) for e in ends]
    starts = [run.start for _, _, run in raw["comms"]]
    return [max(e, a) for e, a in zip(ends, starts, strict=True)]


def _to_step(
    meta: dict[str, Any],
    number: int,
    zero: float,
    raw: dict[str, Any],
    origin: float,
    shift_us: float,
    logged: list[int] | None,
    param_names: Sequence[str] | None,
) -> StepTrace:
    def ms(t: float) -> float:
        return (t - zero) / 1e3

    spans: list[Span] = []
    for kind, pairs in (("forward", raw["forwards"]), ("backward", raw["backwards"])):
        for n, (a, b) in enumerate(pairs):
            spans.append(Span(kind if len(pairs) == 1 else f"{kind} {n}", kind, ms(a), ms(b)))
    try:
        sizes, size_source = _bucket_sizes(raw, logged)
    except ValueError as e:
        raise ValueError(f"{meta['source']}, step {number}: {e}") from None
    backward_end = raw["backwards"][-1][1]
    grads = _grad_rows(raw, raw["backwards"][-1][0])
    members = _assign_params(grads, sizes)
    ends = _completions(raw, members)
    copy_end = backward_end if raw["copy_end"] is None else raw["copy_end"]
    wait_end = max(max(ends), copy_end, backward_end)
    if raw["optimizer"]:
        wait_end = min(wait_end, max(raw["optimizer"][0][0], backward_end))
    spans.append(Span("wait", "wait", ms(backward_end), ms(wait_end)))
    for a, b in raw["optimizer"]:
        spans.append(Span("optimizer", "optimizer", ms(a), ms(b)))
    backward_start = ms(raw["backwards"][-1][0])
    for b, (_, launch, run) in enumerate(raw["comms"]):
        # ready when its last gradient is in (if the gradients are known), else at its launch
        ready = (
            backward_start + max(grads[k]["ready_ms"] for k in members[b])
            if members
            else ms(launch.start)
            if launch is not None
            else None
        )
        if ready is not None:
            spans.append(Span(f"bucket {b} ready", "bucket_ready", ready, ready, b, sizes[b]))
        spans.append(
            Span(f"all-reduce bucket {b}", "allreduce", ms(run.start), ms(ends[b]), b, sizes[b])
        )

    def name(k: int) -> str:
        if param_names is not None and len(param_names) == len(grads):
            # torch DDP's reducer sees parameters in registration order; the ready order is
            # roughly its reverse, but only the caller can say which gradient is which
            return str(param_names[k])
        return f"grad {k}"

    buckets = [
        {
            "index": b,
            "param_names": [name(k) for k in members[b]] if members else [],
            "nbytes": sizes[b],
        }
        for b in range(len(raw["comms"]))
    ]
    lanes = len({run.tid for _, _, run in raw["comms"]})
    return StepTrace(
        rank=meta["rank"],
        world_size=meta["world_size"],
        backend=meta["backend"],
        device="cuda" if raw["gpu"] else "cpu",
        clock="cuda_event" if raw["gpu"] else "host",
        step=number,
        spans=sorted(spans, key=lambda s: (s.start_ms, s.end_ms)),
        buckets=buckets,
        origin_ms=(zero + shift_us - origin) / 1e3,
        meta={
            "source": "torch.profiler",
            "model": "torch DDP job (torch.profiler)",
            "file": meta["source"],
            "start_unix_us": meta["base_ns"] / 1e3 + zero,
            "start_ts_us": zero,  # in the file's own timestamps (µs after baseTimeNanoseconds)
            "host": meta["host"],
            "profiler_step_ms": [ms(raw["window"][0]), ms(raw["window"][1])],
            "bucket_sizes_from": size_source,
            "comm_lanes": max(lanes, 1),
            "grads": grads,
            "backward_ops_end_ms": ms(raw["ops_end"]),
            "launch_ms": [ms(launch.start) if launch else None for _, launch, _ in raw["comms"]],
            "verified": not raw["gpu"],
        },
    )


def from_profiler(
    source: Any,
    *,
    ddp_logging_data: Mapping[str, Any] | None = None,
    param_names: Sequence[str] | None = None,
    forward_name: str = FORWARD,
) -> list[list[StepTrace]]:
    """Per rank (ordered by rank), the profiled steps of a torch DDP job as ``StepTrace``s.

    ``source``: a trace file (``prof.export_chrome_trace(path)``, ``.json`` or ``.json.gz``), a
    folder of them (one per rank), a list of files, a parsed trace dict, or a live
    ``torch.profiler.profile``. ``ddp_logging_data``: ``ddp._get_ddp_logging_data()``, the bucket
    sizes when the trace was recorded without ``record_shapes=True``. ``param_names``: names for
    the gradients in the order they became ready (else ``grad 0``, ``grad 1``, …).
    Unusable input is a ``ValueError`` that says what is missing.
    """
    logged = _logged_bucket_sizes(ddp_logging_data)
    ranks: dict[int, list[tuple[int, float, dict[str, Any], dict[str, Any]]]] = {}
    for label, doc in _documents(source):
        meta, events = _events(label, doc)
        if meta["rank"] in ranks:
            raise ValueError(
                f"two traces of rank {meta['rank']} ({ranks[meta['rank']][0][3]['source']} and "
                f"{label}): keep one file per rank"
            )
        found = _rank_steps(meta, events, forward_name=forward_name)
        ranks[meta["rank"]] = [(n, zero, raw, meta) for n, zero, raw in found]
    base = min(steps[0][3]["base_ns"] for steps in ranks.values())

    def shift_us(meta: dict[str, Any]) -> float:
        return (meta["base_ns"] - base) / 1e3

    origin = min(zero + shift_us(meta) for steps in ranks.values() for _, zero, _, meta in steps)
    return [
        [
            _to_step(meta, n, zero, raw, origin, shift_us(meta), logged, param_names)
            for n, zero, raw, meta in ranks[r]
        ]
        for r in sorted(ranks)
    ]
