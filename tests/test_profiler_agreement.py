"""dplab.Tracer's all-reduce spans against torch.profiler's ``gloo:all_reduce`` ranges.

The oracle is the profiler: ProcessGroupGloo opens that range on the worker thread the moment
the worker begins a collective and closes it when the collective is done and its future's
callbacks have run, on a clock of its own (Kineto's). Both watch the same steps on real ranks at
the same time. A range is told apart by what it reduced: the model's buckets all differ in size,
and the profiler records each range's input shape. (Its start order is not the launch order:
two idle workers can begin consecutive collectives either way round, 1 to 3 times in 48 here.)

What it would catch: the start inferred from the launch (or from a free worker), which counts
an idle worker's wait for a CPU (often milliseconds on two busy cores) as the collective's own
time; an end taken as the callback is entered, not as it returns, which leaves out a worker
that lost its CPU inside it. Twenty recorded runs of this test's model (6 steps each),
re-resolved: the old start and end rules put 25 of 40 ranks on target, the old start rule with
the new end 30, the tracer's rules 39.
"""

from __future__ import annotations

import pytest
import torch

import dplab
from dplab.models import MLP

# Over 160 steps (1,280 spans a rank), so that sampling noise and one busy moment of the shared
# 2-core machine cannot decide the verdict; the goal, unchanged, is 90% close on every rank.
# Over 40 steps, twelve isolated runs on 2026-12-02 gave 89-95% a rank (mean 92%) and two of the
# twelve had a rank under 90%, as did one fresh-clone CI run (89%); over 160, eight runs gave
# 92.5-95.3% on every rank.
STEPS, WARMUP = 160, 2
# 8 Linear layers of slightly different widths: one bucket each (about 0.25 MiB), no two alike
WIDTHS = (256, 248, 264, 240, 272, 232, 280, 224, 288)
CAP_MB = 0.2


def _traced_and_profiled() -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    tracer = dplab.Tracer()
    ddp = dplab.DDP(MLP(WIDTHS), bucket_cap_mb=CAP_MB, tracer=tracer)
    opt = tracer.watch(torch.optim.SGD(ddp.parameters(), lr=1e-3))
    x, y = torch.randn(64, WIDTHS[0]), torch.randn(64, WIDTHS[-1])

    def step() -> None:
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(WARMUP):  # the rebuild of the buckets happens here
        step()
    tracer.clear()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            step()
    numel = [b.numel for b in ddp.buckets]
    ranges = sorted(
        (e for e in prof.events() if e.name == "gloo:all_reduce"), key=lambda e: e.time_range.start
    )
    return {
        "ours": [
            [(numel[s.bucket], s.duration_ms) for s in t.of("allreduce")] for t in tracer.steps
        ],
        # ranges of one step all begin before the next step's: its all-reduces end in its wait
        "profiler": [(e.input_shapes[0][0], e.time_range.elapsed_us() / 1e3) for e in ranges],
        "numel": numel,
        "start_from": tracer.steps[-1].meta.get("start_from"),
    }


def paired(r: dict) -> tuple[list[float], list[float]]:
    """(ours, the profiler's) durations of the same collectives, step by step, by bucket size."""
    n = len(r["numel"])
    ours, theirs = [], []
    for k, step in enumerate(r["ours"]):
        ranges = dict(r["profiler"][k * n : (k + 1) * n])
        assert sorted(ranges) == sorted(numel for numel, _ in step), f"step {k}: {ranges}"
        ours += [ms for _, ms in step]
        theirs += [ranges[numel] for numel, _ in step]
    return ours, theirs


@pytest.fixture(scope="module")
def measured(cluster2) -> list[dict]:
    return cluster2.run(_traced_and_profiled)


def agreement(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    """(sum of ours / sum of theirs, share of spans within 10% or 0.2 ms of theirs)."""
    close = [abs(a - b) <= max(0.1 * b, 0.2) for a, b in zip(ours, theirs, strict=True)]
    return sum(ours) / sum(theirs), sum(close) / len(close)


def test_agreement_rule_on_a_known_case():
    ratio, share = agreement([1.0, 2.0, 0.3, 5.0], [1.05, 2.0, 0.45, 4.0])
    assert ratio == pytest.approx(8.3 / 7.5)
    assert share == 0.75  # 1.0 vs 1.05 (5%), 2.0, 0.3 vs 0.45 (0.15 ms) in; 5.0 vs 4.0 out


def test_one_profiler_range_per_traced_all_reduce(measured):
    for r in measured:
        assert len(r["numel"]) >= 6, r["numel"]  # several buckets, or nothing to tell apart
        assert len(set(r["numel"])) == len(r["numel"]), r["numel"]  # each its own size
        assert len(r["ours"]) == STEPS
        assert len(r["profiler"]) == STEPS * len(r["numel"])
        paired(r)


def test_all_reduce_spans_agree_with_the_profiler_on_every_rank(measured):
    for rank, r in enumerate(measured):
        ratio, share = agreement(*paired(r))
        detail = f"rank {rank} (start from {r['start_from']}): sum {ratio:.3f}×, {share:.0%} close"
        assert abs(ratio - 1) <= 0.05, detail
        assert share >= 0.9, detail
