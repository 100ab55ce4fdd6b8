"""The DDP step simulator: a measured compute profile plus a link model gives a ``StepTrace``.

Measure once, on real ranks, when each gradient is ready (:func:`measure_profile` →
:class:`BackwardProfile`); then ask what a step would look like for any bucket cap, world size
and fabric (:func:`simulate`), and which cap is best (:func:`best_bucket_cap`). The answer is
the same kind of object a measured step is, so it draws and measures the same way.

    profile = dplab.sim.measure_profile("gpt-7m")
    trace = dplab.sim.simulate(profile, bucket_cap_mb=25, first_bucket_cap_mb=1,
                               fabric=dplab.sim.Fabric.preset("dgx-h100", nodes=128))
    trace.metrics.exposed_comm_ms
"""

from dplab.sim.at_scale import (
    WORLD_SIZES,
    CommsRule,
    accumulated_step_ms,
    comm_time_ms,
    crossover_world_size,
    error_band_line,
    faster_compute,
    rule_profile,
    verdict,
)
from dplab.sim.engine import (
    best_bucket_cap,
    candidate_caps,
    plan_buckets,
    schedule,
    simulate,
    sweep,
)
from dplab.sim.fabric import GPUS, Fabric, overlap_contention, with_straggler
from dplab.sim.fabric import PRESETS as FABRIC_PRESETS
from dplab.sim.link import LINK_NAMES, PRESETS, Link, get_link, loopback_link
from dplab.sim.measured_link import FIT_SIZES, measure_link
from dplab.sim.nccl_model import Calibration
from dplab.sim.nccl_tests import parse_nccl_tests
from dplab.sim.profile import (
    BackwardProfile,
    Contention,
    ParamTiming,
    measure_profile,
    merge_runs,
    profile_from_ranks,
    profile_rank,
)
from dplab.sim.sharded import UnitProfile, simulate_sharded, zero3_costs
from dplab.sim.validation import BandError, validation_bands

__all__ = [
    "FABRIC_PRESETS",
    "FIT_SIZES",
    "GPUS",
    "LINK_NAMES",
    "PRESETS",
    "WORLD_SIZES",
    "BackwardProfile",
    "BandError",
    "Calibration",
    "CommsRule",
    "Contention",
    "Fabric",
    "Link",
    "ParamTiming",
    "UnitProfile",
    "accumulated_step_ms",
    "best_bucket_cap",
    "candidate_caps",
    "comm_time_ms",
    "crossover_world_size",
    "error_band_line",
    "faster_compute",
    "get_link",
    "loopback_link",
    "measure_link",
    "measure_profile",
    "merge_runs",
    "overlap_contention",
    "parse_nccl_tests",
    "plan_buckets",
    "profile_from_ranks",
    "profile_rank",
    "rule_profile",
    "schedule",
    "simulate",
    "simulate_sharded",
    "sweep",
    "validation_bands",
    "verdict",
    "with_straggler",
    "zero3_costs",
]
