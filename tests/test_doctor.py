"""The bucket doctor (``dplab.doctor``, ``python -m dplab doctor``) on real torch DDP traces.

One launch of 2 gloo ranks records torch's own DistributedDataParallel under torch.profiler:
a small GPT at an explicit cap and at torch's default, a small MLP for the CLI, and the same
MLP twice more for the straggler: once with rank 1's backward slowed by a known sleep (a
gradient hook), once with both ranks alike. What the doctor is checked against:

- torch's reducer: the buckets it built (``_get_ddp_logging_data()``) and the cap it was given;
- the sleep itself, for the straggler's rank and lag;
- its own rules, restated here: the advice is given only when the model reproduces the job's
  cap and the whole interval of the realized gain is a gain.

How well the advice is kept when a job is re-run at the advised cap is a measurement, not a
unit test: ``benchmarks/doctor_advice.py`` (results in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
from pathlib import Path

import pytest

import dplab
from dplab.trace.profiler import from_profiler

CAP = 0.25
ACTIVE = (2, 3, 4)  # ProfilerStep numbers of schedule(wait=1, warmup=1, active=3)
SLEEP_MS = 40.0  # rank 1's extra backward time in the straggler job
STRAGGLER_STEPS = 8


def _record(out: str) -> dict:
    """On every rank: torch DDP at an explicit and at the default cap, and the straggler jobs."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, schedule

    from dplab.models import make_batch, make_model

    rank = dist.get_rank()
    root = Path(out)
    logging: dict = {}

    def run(folder: str, model, name: str, *, active: int = 3) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        (root / folder).mkdir(parents=True, exist_ok=True)
        path = root / folder / f"rank{rank}.pt.trace.json"
        with profile(
            activities=[ProfilerActivity.CPU],
            record_shapes=True,
            schedule=schedule(wait=1, warmup=1, active=active),
            on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        ) as prof:
            for i in range(2 + active):
                x, y = make_batch(name, 8, seed=100 * i + rank)
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                prof.step()

    explicit = DistributedDataParallel(make_model("tiny-gpt", seed=0), bucket_cap_mb=CAP)
    run("gpt-explicit", explicit, "tiny-gpt")
    logging["explicit"] = explicit._get_ddp_logging_data()
    default = DistributedDataParallel(make_model("tiny-gpt", seed=0))  # bucket_cap_mb left out
    run("gpt-default", default, "tiny-gpt")
    logging["default"] = default._get_ddp_logging_data()
    mlp = DistributedDataParallel(make_model("mlp", seed=0), bucket_cap_mb=0.01)
    run("mlp", mlp, "mlp")
    # the straggler: the first layer's gradient is the last one backward computes, so a sleep
    # in its hook delays the end of rank 1's backward by SLEEP_MS, and nothing else
    for folder, slow in (("even", False), ("straggler", True)):
        model = make_model("mlp", seed=0)
        if slow and rank == 1:
            first = next(model.parameters())
            first.register_hook(lambda g: time.sleep(SLEEP_MS / 1e3) or g)
        run(folder, DistributedDataParallel(model), "mlp", active=STRAGGLER_STEPS)
    return logging


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor")
    results = dplab.launch(_record, 2, args=(str(out),), timeout_s=240)
    return out, results[0]


@functools.cache
def _parsed(folder: Path) -> list[list[dplab.StepTrace]]:
    return from_profiler(folder)


def _torch_sizes(logging: dict) -> list[int]:
    return [int(x) for x in logging["rebuilt_bucket_sizes"].split(",")]


def test_profile_cuts_torchs_buckets_and_the_cap_is_read_right(recorded):
    """The profile derived from the trace, planned at the job's cap, gives exactly the buckets
    torch's reducer built; an explicit cap is inferred as one that cuts them, and a job that
    left the cap to torch is said to run at torch's default."""
    from dplab.doctor import diagnose, first_cap, profile_from_trace
    from dplab.sim import plan_buckets

    out, logging = recorded
    runs = _parsed(out / "gpt-explicit")
    profile = profile_from_trace(runs)
    sizes = _torch_sizes(logging["explicit"])
    plan = plan_buckets(profile, bucket_cap_mb=CAP, first_bucket_cap_mb=first_cap(CAP))
    assert [b.nbytes for b in plan] == sizes and profile.total_bytes == sum(sizes)
    d = diagnose(runs)
    assert d.steps == list(ACTIVE) and d.world_size == 2
    same = plan_buckets(
        profile, bucket_cap_mb=d.current_cap_mb, first_bucket_cap_mb=first_cap(d.current_cap_mb)
    )
    assert [b.nbytes for b in same] == sizes
    assert d.cap_source.startswith("inferred: every cap tried from")
    assert diagnose(runs, ddp_logging_data=logging["explicit"]).current_cap_mb == CAP
    default = diagnose(_parsed(out / "gpt-default"))
    assert default.cap_source == "inferred: torch's default"
    assert (default.current_cap_mb, default.current_first_cap_mb) == (25.0, 1.0)
    assert len(_torch_sizes(logging["default"])) == len(default.buckets)


def test_the_advice_follows_its_rules_and_its_interval(recorded):
    """Typed rows, the sweep's best cap, and advice only when trusted and the whole interval
    of the realized gain is above zero (else the recommendation says why not)."""
    from dplab.doctor import BucketRow, CapRow, StepRow, diagnose

    out, _ = recorded
    d = diagnose(_parsed(out / "gpt-explicit"))
    assert all(isinstance(m, StepRow) for m in d.measured) and len(d.measured) == len(ACTIVE)
    assert all(isinstance(b, BucketRow) for b in d.buckets)
    assert all(isinstance(s, CapRow) for s in d.sweep)
    assert d.predicted_current.low <= d.predicted_current.median <= d.predicted_current.high
    measured = statistics.median(m.exposed_ms for m in d.measured)
    assert d.model_miss_ms == pytest.approx(abs(d.predicted_current.median - measured))
    row = {s.cap_mb: s for s in d.sweep}
    assert row[d.best_cap_mb].exposed_ms == min(s.exposed_ms for s in d.sweep)
    assert d.predicted_best.median == pytest.approx(row[d.best_cap_mb].exposed_ms)
    assert d.predicted_current.median == pytest.approx(row[d.current_cap_mb].exposed_ms)
    lo, hi = d.gain_interval
    assert lo <= measured - d.predicted_best.median <= hi and d.noise_ms >= 0
    assert d.trusted == (d.model_miss_ms <= max(0.3 * measured, 1.0, 1.645 * d.noise_ms))
    assert d.recommend == (d.best_cap_mb != d.current_cap_mb and d.trusted and lo > 0)
    text = d.summary()
    assert "recommendation:" in text and f"{d.best_cap_mb:.3g} MiB" in text
    if not d.trusted:
        assert "cannot be trusted" in d.recommendation()
    elif not d.recommend:
        assert "keep the cap" in d.recommendation() and "within the noise" in d.recommendation()


def test_the_slowed_rank_is_named_with_its_lag(recorded):
    """Rank 1 slept SLEEP_MS in every backward: it waits least, and the other waits about
    SLEEP_MS more (± half of it: the box's own noise between two ranks is milliseconds)."""
    from dplab.doctor import diagnose, find_straggler

    out, _ = recorded
    runs = _parsed(out / "straggler")
    found = find_straggler(runs)
    assert found is not None, [[t.metrics.exposed_comm_ms for t in r] for r in runs]
    assert found.rank == 1 and found.steps == STRAGGLER_STEPS
    assert 0.5 * SLEEP_MS <= found.behind_ms <= 1.5 * SLEEP_MS, found
    assert found.exposed_by_rank[0] > found.exposed_by_rank[1]
    d = diagnose(runs)
    assert d.straggler == found and "rank 1 is a straggler" in d.summary()


def test_even_ranks_name_no_straggler(recorded):
    from dplab.doctor import diagnose, find_straggler

    out, _ = recorded
    runs = _parsed(out / "even")
    leads = [[t.metrics.exposed_comm_ms for t in r] for r in runs]
    assert find_straggler(runs) is None, leads
    assert "straggler: none" in diagnose(runs).summary()


def test_doctor_cli_prints_summary_and_writes_an_offline_timeline(recorded, tmp_path, capsys):
    from dplab.cli import doctor

    out, _ = recorded
    folder = tmp_path / "job"
    shutil.copytree(out / "mlp", folder)
    parser = argparse.ArgumentParser()
    doctor.add_cli(parser.add_subparsers())
    args = parser.parse_args(["doctor", str(folder), "--html", str(tmp_path / "t.html")])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "per bucket" in printed and "recommendation:" in printed and "straggler:" in printed
    html = (tmp_path / "t.html").read_text()
    # offline: plotly.js is in the page, not fetched from a CDN
    assert len(html) > 1_000_000 and '<script src="https://cdn.plot.ly' not in html


def test_default_cap_is_recognised_from_the_sizes_alone():
    """torch cut its default buckets in its first iteration's order, which a profiled step
    need not repeat: the check is on sizes (each bucket reached its cap, and went past it by
    less than the largest gradient), not on one order."""
    from dplab.doctor import consistent_with_default, infer_cap
    from dplab.sim import BackwardProfile, ParamTiming

    mib = 1024 * 1024
    sizes = [mib // 4] * 12 + [mib // 16]  # 3.06 MiB of 0.25 MiB gradients and a small one
    params = [ParamTiming(f"p{k}", s // 4, s, "float32", float(k)) for k, s in enumerate(sizes)]
    profile = BackwardProfile("m", tuple(params), 1.0, 13.0, 1.0)
    assert consistent_with_default(profile, [mib, sum(sizes) - mib])
    assert consistent_with_default(profile, [mib + mib // 16, sum(sizes) - mib - mib // 16])
    assert infer_cap(profile, [mib, sum(sizes) - mib])[:2] == (25.0, 1.0)
    assert not consistent_with_default(profile, [sum(sizes)])  # one bucket: not the default
    assert not consistent_with_default(profile, [mib // 2, sum(sizes) - mib // 2])
    assert not consistent_with_default(profile, [mib, mib])  # not every gradient
