"""torch's DDP logging data (``_get_ddp_logging_data``), kept by dplab.DDP the way torch keeps it.

torch's ``c10d::Logger`` (torch/csrc/distributed/c10d/logger.cpp) fills one dictionary: at
construction the arguments, the parameters and the environment
(``set_construction_data_and_log``); at the start of a synchronising forward, on the iterations
the reducer samples (``Reducer::should_collect_runtime_stats``: iterations 1 to 10, then every
``sample_rate``-th, default 100), the previous iteration's times, bucket rebuild and gradient
order (``set_runtime_stats_and_log``). An error raised by DDP sets ``has_error`` and
``error``. Times are host clock nanoseconds, as torch's CPU timer records them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate
_ENV = ("MASTER_PORT", "MASTER_ADDR", "TORCH_DISTRIBUTED_DEBUG", "CUDA_VISIBLE_DEVICES")
_NCCL_ENV = ("NCCL_SOCKET_IFNAME", "NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING")
_NCCL_ENV2 = ("NCCL_DEBUG", "NCCL_NTHREADS", "NCCL_IB_TIMEOUT")


def _env(name: str) -> str:
    return os.environ.get(name, "N/A")


_C10_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
}


def _dtype_name(dtype: torch.dtype) -> str:
    """torch's ``dtype().name()``: float, double, c10::Half, c10::BFloat16, ..."""
    return _C10_NAMES.get(dtype, str(dtype).removeprefix("torch."))


class LoggingData:
    """The dictionary torch's ``_get_ddp_logging_data`` returns, and the events behind it."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.iterations = 0  # synchronising forwards so far (torch's num_iterations_)
        self.recorded = 0  # iterations whose times were averaged in
        self.times: dict[str, int] = {}

    def construction(self, ddp: Any, bucket_sizes: list[int], bucket_caps: list[int]) -> None:
        """What torch's logger records when DDP is built."""
        params = [p for _, p in ddp._params]
        group = ddp.process_group
        backend = dist.get_backend(group)
        d = self.data
        d.update(
            module_name=type(ddp.module).__name__,
            world_size=ddp.world_size,
            rank=ddp.rank,
            iteration=0,
            is_multi_device_module=int(len({p.device for p in params}) > 1),
            num_parameter_tensors=len(params),
            total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
            dtypes=", ".join(sorted({_dtype_name(p.dtype) for p in params})),
            bucket_sizes=", ".join(map(str, bucket_sizes)),
            initial_bucket_size_limits=", ".join(map(str, bucket_caps)),
            device_ids=", ".join(map(str, ddp.device_ids or [])),
            output_device=-1 if ddp.output_device is None else ddp.output_device,
            broadcast_buffers=int(ddp.forward_sync_buffers),
            has_sync_bn=int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.modules())),
            bucket_cap_bytes=int(ddp.bucket_cap_mb * 1024 * 1024),
            find_unused_parameters=int(ddp.find_unused_parameters),
            gradient_as_bucket_view=int(ddp.gradient_as_bucket_view),
            backend_name=backend,
        )
        d.update({name.lower(): _env(name) for name in _ENV})
        if backend == "nccl":
            d.update({name.lower(): _env(name) for name in _NCCL_ENV + _NCCL_ENV2})
        if backend == "gloo":
            d.update(gloo_socket_ifname=_env("GLOO_SOCKET_IFNAME"))
            d.update(gloo_device_transport=_env("GLOO_DEVICE_TRANSPORT"))
            gloo = group._get_backend(torch.device("cpu"))
            d.update(gloo_num_threads=gloo.options._threads)

    def record(self, event: str, *, first: bool = False) -> None:
        """The host time of ``event`` in this iteration (``first``: keep the earliest)."""
        if not (first and event in self.times):
            self.times[event] = time.time_ns()

    def sampled(self) -> bool:
        """torch's ``should_collect_runtime_stats``."""
        n = self.iterations
        return n > 0 and (n <= 10 or n % self.sample_rate == 0)

    def before_forward(self, ddp: Any) -> None:
        """At a synchronising forward: log the last iteration if sampled, then count this one."""
        if self.sampled():
            self._runtime_stats(ddp)
        self.iterations += 1
        self.times = {}
        if self.sampled():
            self.record("forward")

    def _runtime_stats(self, ddp: Any) -> None:
        d, t = self.data, self.times
        self.recorded += 1
        d["iteration"] = self.iterations
        unused = getattr(ddp, "_unused_this_iteration", [])
        if ddp.find_unused_parameters:
            d["unused_parameter_size"] = sum(
                ddp._params[i][1].numel() * ddp._params[i][1].element_size() for i in unused
            )
        rebuilt = int(ddp._order_recorded and not ddp._rebuild_pending)
        if d.get("has_rebuilt_buckets") != rebuilt:
            d["has_rebuilt_buckets"] = rebuilt
            sizes, caps = ddp._bucket_bytes()
            d["rebuilt_bucket_sizes"] = ", ".join(map(str, sizes))
            d["rebuilt_bucket_size_limits"] = ", ".join(map(str, caps))
            d["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(map(str, m)) for m in ddp._bucket_params
            )
        d["num_buckets_reduced"] = ddp._buckets_reduced
        if ddp._last_ready_order:
            d["prev_iteration_grad_ready_order_indices"] = ", ".join(
                map(str, ddp._last_ready_order)
            )
        spans = {
            "forward_compute_time": ("forward", "backward_compute_start"),
            "backward_compute_time": ("backward_compute_start", "backward_compute_end"),
            "backward_comm_time": ("comm_start", "comm_end"),
            "backward_compute_comm_overlap_time": ("comm_start", "backward_compute_end"),
        }
        for key, (a, b) in spans.items():
            d[key] = 0
            if a in t and b in t:
                d[key] = t[b] - t[a]
                avg = d.get("avg_" + key, 0)
                d["avg_" + key] = (d[key] + avg * (self.recorded - 1)) // self.recorded
        starts = {
            "forward_compute_time_start": "forward",
            "backward_compute_time_start": "backward_compute_start",
            "backward_comm_time_start": "comm_start",
            "backward_compute_time_end": "backward_compute_end",
            "backward_comm_time_end": "comm_end",
        }
        for key, event in starts.items():
            d[key] = t.get(event, 0)

    def error(self, message: str) -> None:
        """torch's ``set_error_and_log``: the error DDP raised."""
        self.data.update(has_error=1, error=message)


class LoggingMixin:
    """The two torch methods on the logging data (mixed into :class:`dplab.ddp.ddp.DDP`)."""

    _logging: LoggingData

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's logging data: construction-time keys, then runtime stats when sampled."""
        return dict(self._logging.data)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """After iteration 10, collect runtime stats every ``sample_rate``-th iteration."""
        if sample_rate < 1:
            self._log_and_throw(
                ValueError, "DDP runtime logging sample rate should be equal or greater than 1"
            )
        self._logging.sample_rate = sample_rate

    def _log_and_throw(self, err_type: type[Exception], message: str) -> None:
        """Record the error in the logging data (``has_error``), then raise it, as torch."""
        self._logging.error(f"{err_type}: {message}")
        raise err_type(message)
