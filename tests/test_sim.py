"""The simulator: invariants of a predicted step, its limits, its inputs, and its profile.

Synthetic profiles (sizes from the real models, ready times made up) test the arithmetic;
real ranks test that a measured profile and a measured step agree with it in form.
"""

from __future__ import annotations

import json
import math
import re

import pytest

import dplab
from dplab.cli import main
from dplab.ddp import measure_ddp
from dplab.models import make_model
from dplab.sim import (
    PRESETS,
    BackwardProfile,
    Contention,
    Link,
    ParamTiming,
    best_bucket_cap,
    candidate_caps,
    get_link,
    measure_profile,
    plan_buckets,
    schedule,
    simulate,
    sweep,
)
from dplab.trace import StepTrace

FAST = Link("fast", 1e-6, 1e15)  # comm ≪ compute
SLOW = Link("slow", 1e-3, 1e6)  # comm ≫ compute


def synthetic(
    model: str = "tiny-gpt", *, backward_ms: float = 100.0, divide_ms_per_mib: float = 0.0
) -> BackwardProfile:
    """The model's real parameters; gradients ready evenly, last registered first."""
    params = [(n, p) for n, p in make_model(model).named_parameters() if p.requires_grad]
    k = len(params)
    timings = tuple(
        ParamTiming(
            n,
            p.numel(),
            p.numel() * p.element_size(),
            "float32",
            backward_ms * (k - i) / k,  # index 0 (registered first) is ready last, at the end
        )
        for i, (n, p) in enumerate(params)
    )
    return BackwardProfile(
        model,
        timings,
        forward_ms=40.0,
        backward_ms=backward_ms,
        optimizer_ms=3,
        divide_ms_per_mib=divide_ms_per_mib,
    )


CONTENDED = Contention(compute_slowdown=0.5, alpha_factor=4.0, beta_factor=1.5)


def check_invariants(trace: StepTrace) -> None:
    assert trace.clock == "simulated"
    ready = {s.bucket: s.end_ms for s in trace.of("bucket_ready")}
    comms = sorted(trace.of("allreduce"), key=lambda s: s.bucket)
    assert [s.bucket for s in comms] == [b.index for b in trace.buckets]  # one per bucket
    assert sorted(ready) == [b.index for b in trace.buckets]
    previous_end = -math.inf
    for span in comms:
        assert span.start_ms >= ready[span.bucket] - 1e-9  # never before its bucket is ready
        assert span.start_ms >= previous_end - 1e-9  # never before the previous one ends
        assert span.end_ms >= span.start_ms
        previous_end = span.end_ms
    m = trace.metrics
    assert 0 <= m.exposed_comm_ms <= m.t_comm_ms + 1e-9
    assert 0 <= m.overlap_fraction <= 1
    assert m.t_step_ms >= m.predicted_step_ms - 1e-9  # never beats max(T_compute, T_comm)
    assert sum(m.exposed_ms.values()) == pytest.approx(m.exposed_comm_ms, abs=1e-9)


@pytest.mark.parametrize("model", ["tiny-gpt", "gpt-7m", "mlp"])
@pytest.mark.parametrize("cap", [0.001, 0.25, 1.0, 25.0, 100.0])
@pytest.mark.parametrize("link", [FAST, SLOW, PRESETS["ib-400g"], PRESETS["25gbe"]])
@pytest.mark.parametrize("contention", [None, CONTENDED])
def test_invariants(model, cap, link, contention):
    trace = simulate(
        synthetic(model, divide_ms_per_mib=0.3),
        bucket_cap_mb=cap,
        first_bucket_cap_mb=1.0,
        world_size=8,
        link=link,
        contention=contention,
    )
    check_invariants(trace)


def test_same_span_kinds_and_names_as_a_measured_step():
    trace = simulate(synthetic(), world_size=2, link=FAST)
    names = {s.name for s in trace.spans}
    assert {"forward", "backward", "wait", "optimizer"} <= names
    n = len(trace.buckets)
    assert {f"bucket {b} ready" for b in range(n)} <= names
    assert {f"all-reduce bucket {b}" for b in range(n)} <= names
    assert len(trace.spans) == 4 + 2 * n
    # and it round-trips like a measured one
    again = StepTrace.from_dict(json.loads(json.dumps(trace.to_dict())))
    assert again.metrics == trace.metrics
    assert again.meta["link"] == "fast"


def test_comm_much_cheaper_than_compute_leaves_only_the_last_bucket_exposed():
    trace = simulate(synthetic("gpt-7m"), bucket_cap_mb=1.0, world_size=64, link=FAST)
    last = max(trace.of("allreduce"), key=lambda s: s.bucket)
    assert last.duration_ms > 0
    assert trace.metrics.exposed_comm_ms == pytest.approx(last.duration_ms, rel=1e-9)
    assert trace.metrics.exposed_ms[last.bucket] == pytest.approx(last.duration_ms, rel=1e-9)


def test_comm_much_dearer_than_compute_makes_the_step_approach_t_comm():
    profile = synthetic("gpt-7m")
    trace = simulate(profile, bucket_cap_mb=1.0, world_size=64, link=SLOW)
    m = trace.metrics
    assert m.t_comm_ms > 100 * m.t_compute_ms
    assert m.t_step_ms / m.t_comm_ms == pytest.approx(1.0, abs=0.01)
    assert m.overlap_fraction < 0.01


def test_allreduce_times_follow_the_ring_formula_at_1024_ranks():
    link = get_link("ib-400g")
    trace = simulate(synthetic("gpt-7m"), bucket_cap_mb=25, world_size=1024, link=link)
    check_invariants(trace)
    assert trace.world_size == 1024
    n = 1024
    for span in trace.of("allreduce"):
        expected = 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * span.nbytes / link.bandwidth_Bps
        assert span.duration_ms == pytest.approx(expected * 1e3, rel=1e-12)


def test_one_rank_has_nothing_to_send():
    trace = simulate(synthetic(), world_size=1, link=PRESETS["100gbe"])
    assert trace.metrics.t_comm_ms == 0
    assert trace.metrics.t_step_ms == pytest.approx(40 + 100 + 3)


def test_schedule_with_contention_by_hand():
    # one bucket ready at once; 4 ms quiet all-reduce that takes 8 ms beside compute; backward
    # 10 ms that runs at half speed meanwhile: comm ends at 8, compute did 4 of 10 by then,
    # the other 6 at full speed: backward ends at 14.
    ready_wall, starts, ends, end = schedule(
        [0.0], 10.0, [4.0], busy_comm_ms=[8.0], compute_slowdown=1.0
    )
    assert (ready_wall, starts, ends, end) == ([0.0], [0.0], [8.0], 14.0)
    # the lane: the second bucket waits for the first, even though it is ready
    _, starts, ends, end = schedule([1.0, 2.0], 3.0, [5.0, 1.0])
    assert starts == [1.0, 6.0] and ends == [6.0, 7.0] and end == 3.0


def test_schedule_division_runs_on_the_compute_thread_before_the_launch():
    # ready at 1 and 2; dividing each costs 0.5 ms of compute, so bucket 0 launches at 1.5,
    # bucket 1 is marked ready at 2.5 (its gradients were pushed back by 0.5) and launches at
    # 3; backward, 3 ms of work plus 1 ms of division, ends at 4.
    ready_wall, starts, ends, end = schedule([1.0, 2.0], 3.0, [1.0, 1.0], prep_ms=[0.5, 0.5])
    assert (ready_wall, starts, ends, end) == ([1.0, 2.5], [1.5, 3.0], [2.5, 4.0], 4.0)
    # bucket 1 ready first: it waits for bucket 0, then both are divided back to back
    ready_wall, starts, ends, end = schedule([2.0, 1.0], 3.0, [1.0, 1.0], prep_ms=[0.5, 0.5])
    assert (ready_wall, starts, ends, end) == ([2.0, 1.0], [2.5, 3.5], [3.5, 4.5], 4.0)


def test_division_cost_adds_to_backward():
    profile = synthetic("gpt-7m", divide_ms_per_mib=1.0)
    trace = simulate(profile, bucket_cap_mb=5.0, world_size=2, link=FAST)
    total_mib = profile.total_bytes / 2**20
    assert trace.metrics.t_backward_ms == pytest.approx(100.0 + total_mib, rel=1e-12)


def test_contention_never_speeds_a_step_up():
    profile = synthetic("gpt-7m")
    for cap in (0.25, 5.0, 100.0):
        kw = {"bucket_cap_mb": cap, "world_size": 2, "link": PRESETS["25gbe"]}
        free = simulate(profile, **kw).metrics.t_step_ms
        assert simulate(profile, contention=CONTENDED, **kw).metrics.t_step_ms >= free - 1e-9


# -- best cap -----------------------------------------------------------------------------------


def test_best_bucket_cap_is_the_minimum_of_the_candidates():
    profile = synthetic("gpt-7m")
    link = PRESETS["25gbe"]
    best = best_bucket_cap(profile, world_size=16, link=link)
    caps = candidate_caps(profile)
    steps = [t.metrics.t_step_ms for t in sweep(profile, caps, world_size=16, link=link)]
    at_best = simulate(profile, bucket_cap_mb=best, world_size=16, link=link).metrics.t_step_ms
    assert best in caps
    assert at_best == pytest.approx(min(steps), rel=1e-12)


def test_latency_bound_link_wants_one_big_bucket_and_bandwidth_bound_wants_small_ones():
    profile = synthetic("gpt-7m", backward_ms=1000.0)
    total_mib = profile.total_bytes / 2**20
    latency_bound = Link("latency", 1.0, 1e15)  # a second per ring step: fewest buckets win
    best = best_bucket_cap(profile, world_size=2, link=latency_bound)
    assert len(plan_buckets(profile, bucket_cap_mb=best, first_bucket_cap_mb=1.0)) == 2
    assert best >= total_mib
    bandwidth_bound = Link("bandwidth", 0.0, 1e9)  # no latency: small buckets hide the most
    assert best_bucket_cap(profile, world_size=2, link=bandwidth_bound) < 2.0


def test_candidate_caps_cover_everything_in_one_bucket():
    profile = synthetic("gpt-7m")
    caps = candidate_caps(profile)
    assert caps == sorted(caps) and caps[0] == 0.01
    assert caps[-1] >= profile.total_bytes / 2**20 > caps[-2]


# -- bad inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "8"])
def test_world_size_below_one_is_a_clear_error(n):
    with pytest.raises(ValueError, match=re.escape(f"world_size must be an int >= 1, got {n!r}")):
        simulate(synthetic(), world_size=n, link=FAST)
    with pytest.raises(ValueError, match="world_size"):
        best_bucket_cap(synthetic(), world_size=n, link=FAST)


@pytest.mark.parametrize("bandwidth", [-1.0, 0.0, math.inf, math.nan])
def test_bad_bandwidth_is_a_clear_error(bandwidth):
    with pytest.raises(ValueError, match=rf"bandwidth_Bps must be .*{bandwidth!r}"):
        Link("bad", 1e-6, bandwidth)


def test_bad_link_values_are_clear_errors():
    with pytest.raises(ValueError, match="alpha_s must be >= 0, got -1"):
        Link("bad", -1, 1e9)
    with pytest.raises(ValueError, match="beta_s_per_byte must be > 0, got -2"):
        Link.from_beta("bad", 1e-6, -2)
    with pytest.raises(ValueError, match="unknown link 'infiniband'"):
        get_link("infiniband")
    with pytest.raises(ValueError, match=r"link must be a dplab\.sim\.Link"):
        simulate(synthetic(), world_size=2, link="ib-400g")


def test_empty_profile_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no parameters \(params is empty\)"):
        BackwardProfile("empty", (), forward_ms=1, backward_ms=1, optimizer_ms=1)
    d = synthetic().to_dict()
    d["params"] = []
    with pytest.raises(ValueError, match="params is empty"):
        BackwardProfile.from_dict(d)


def test_other_bad_profiles_are_clear_errors():
    p = synthetic()
    with pytest.raises(ValueError, match="after backward ends"):
        BackwardProfile("x", p.params, forward_ms=1, backward_ms=1, optimizer_ms=1)
    with pytest.raises(ValueError, match="backward_ms must be >= 0, got -5"):
        BackwardProfile("x", p.params, forward_ms=1, backward_ms=-5, optimizer_ms=1)
    with pytest.raises(ValueError, match="nbytes must be an int > 0, got 0"):
        ParamTiming("w", 1, 0, "float32", 0.0)
    with pytest.raises(ValueError, match="twice"):
        BackwardProfile("x", p.params[:1] * 2, forward_ms=1, backward_ms=200, optimizer_ms=1)
    with pytest.raises(ValueError, match="not a backward profile"):
        BackwardProfile.from_dict({"format": "something else"})
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0 MiB, got -1"):
        simulate(p, bucket_cap_mb=-1, world_size=2, link=FAST)
    with pytest.raises(ValueError, match="alpha_factor must be >= 1"):
        Contention(alpha_factor=0.5)


def test_contention_from_probe_recovers_planted_factors_despite_drift():
    """Synthetic probe timings from known α, β and slowdowns, on a machine whose speed drifts by
    20% between repeats (each busy backward is compared with the solo one of its repeat)."""
    n, small, large = 2, 256 * 1024, 4 * 1024 * 1024
    alpha, beta = 0.3, 1e-6  # ms per ring step, ms per byte

    def ring(size, a, b):
        return 2 * (n - 1) * a + 2 * (n - 1) / n * size * b

    def rank(drifts):
        out = {"world_size": n, "sizes": [small, large]}
        out["solo_small"] = [ring(small, alpha, beta)] * 3
        out["solo_large"] = [ring(large, alpha, beta)] * 3
        out["busy_small"] = [ring(small, 4 * alpha, 1.5 * beta)] * 3
        out["busy_large"] = [ring(large, 4 * alpha, 1.5 * beta)] * 3
        # 100 ms of overlap costs backward 25 ms: a share of 0.2 -> slowdown 0.25
        out["solo_backward"] = [300.0 * d for d in drifts]
        out["busy_backward"] = [325.0 * d for d in drifts]
        out["overlap"] = [125.0 * d for d in drifts]
        return out

    got = Contention.from_probe([rank([1.0, 1.2, 0.8]), rank([1.2, 1.0, 1.0])])
    assert got.alpha_factor == pytest.approx(4.0)
    assert got.beta_factor == pytest.approx(1.5)
    assert got.compute_slowdown == pytest.approx(0.25, rel=0.05)
    quiet = rank([1.0] * 3) | {"busy_backward": [300.0] * 3}
    assert Contention.from_probe([quiet]).compute_slowdown == 0.0
    # A backward too short for any large all-reduce to finish inside it: one factor for both.
    short = rank([1.0] * 3) | {"busy_large": []}
    got = Contention.from_probe([short, short])
    ratio = ring(small, 4 * alpha, 1.5 * beta) / ring(small, alpha, beta)
    assert got.alpha_factor == got.beta_factor == pytest.approx(ratio)
    assert got.probe["busy_sizes_seen"] == ["small"]
    nothing = short | {"busy_small": []}
    assert Contention.from_probe([nothing]).alpha_factor == 1.0


def test_profile_json_round_trip(tmp_path):
    profile = BackwardProfile(
        "tiny-gpt",
        synthetic().params,
        forward_ms=1.5,
        backward_ms=100.0,
        optimizer_ms=0.25,
        contention=CONTENDED,
        meta={"machine": {"cpu": "x"}, "date": "today"},
    )
    path = tmp_path / "p.json"
    profile.save(path)
    again = BackwardProfile.load(path)
    assert again == profile
    assert json.loads(path.read_text())["format"] == "dplab.backward_profile/1"


# -- real ranks -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_profile(cluster2) -> BackwardProfile:
    return measure_profile("tiny-gpt", cluster=cluster2, steps=3, warmup=1, contention_repeats=1)


def test_a_profile_on_one_rank_has_no_contention_to_probe():
    """One rank sends nothing: the contention probe used to divide by its zero bytes."""
    from dplab.sim import measure_profile

    p = measure_profile("tiny-gpt", world_size=1, batch_size=2, steps=2, warmup=1)
    assert p.contention is None and p.meta["world_size"] == 1 and p.backward_ms > 0


def test_profile_from_real_ranks_is_one_plausible_entry_per_trainable_parameter(real_profile):
    model = make_model("tiny-gpt")
    expected = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    assert [(p.name, p.numel) for p in real_profile.params] == expected
    assert all(p.nbytes == 4 * p.numel for p in real_profile.params)
    assert real_profile.forward_ms > 0 and real_profile.optimizer_ms > 0
    ready = {p.name: p.ready_ms for p in real_profile.params}
    assert all(0 <= t <= real_profile.backward_ms for t in ready.values())
    # backward runs last block first: every gradient of block i+1 is ready before any of block i
    blocks = [
        [t for n, t in ready.items() if n.startswith(f"blocks.{i}.")]
        for i in range(model.cfg.n_layers)
    ]
    for later, earlier in zip(blocks[1:], blocks[:-1], strict=True):
        assert max(later) <= min(earlier)
    assert max(blocks[-1]) <= min(ready["tok.weight"], ready["pos.weight"])
    assert ready["ln_f.weight"] <= min(blocks[-1])
    assert ready["tok.weight"] == max(ready.values())  # tied to the head: its sum ends last
    assert real_profile.meta["world_size"] == 2 and real_profile.meta["steps_timed"] == 3
    c = real_profile.contention
    assert c is not None and c.alpha_factor >= 1 and c.beta_factor >= 1
    assert real_profile.divide_ms_per_mib > 0


def test_simulated_buckets_and_spans_match_a_measured_dplab_ddp_step(cluster2, real_profile):
    for cap in (0.1, 1.0, 25.0):
        measured = cluster2.run(measure_ddp, "tiny-gpt", bucket_cap_mb=cap, steps=1, warmup=0)[0][0]
        simulated = simulate(
            real_profile, bucket_cap_mb=cap, first_bucket_cap_mb=1.0, world_size=2, link=FAST
        )
        assert simulated.buckets == measured.buckets
        assert sorted((s.kind, s.name) for s in simulated.spans) == sorted(
            (s.kind, s.name) for s in measured.spans
        )
        assert simulated.metrics.to_dict().keys() == measured.metrics.to_dict().keys()
        assert simulated.meta["bucket_cap_mb"] == measured.meta["bucket_cap_mb"]


def _ddp_buckets(model: str, cap: float, first: float) -> list[dict]:
    ddp = dplab.DDP(make_model(model), bucket_cap_mb=cap, first_bucket_cap_mb=first)
    return [b.to_dict() for b in ddp.buckets]


@pytest.mark.parametrize("model", ["gpt-7m", "mlp"])
def test_buckets_equal_dplab_ddps_for_the_same_model_and_caps(cluster2, model):
    for cap, first in ((0.25, 1.0), (2.0, 0.5), (25.0, 1.0), (0.0001, 0.0001)):
        ranks = cluster2.run(_ddp_buckets, model, cap, first)
        planned = plan_buckets(synthetic(model), bucket_cap_mb=cap, first_bucket_cap_mb=first)
        assert [b.to_dict() for b in planned] == ranks[0] == ranks[1]


# -- CLI ------------------------------------------------------------------------------------------


def test_cli_simulate_prints_metrics_and_the_best_cap(tmp_path, capsys):
    path = tmp_path / "p.json"
    synthetic("gpt-7m").save(path)
    out_json = tmp_path / "trace.json"
    argv = ["simulate", "--profile", str(path), "--world-size", "1024", "--link", "ib-400g"]
    assert main([*argv, "--bucket-cap-mb", "25", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "1,024 ranks" in out and "ib-400g" in out
    assert re.search(r"exposed comm\s+[\d,.]+ ms", out)
    best = re.search(r"best bucket cap: ([\d.]+) MiB", out)
    expected = best_bucket_cap(synthetic("gpt-7m"), world_size=1024, link=get_link("ib-400g"))
    assert best and float(best.group(1)) == expected
    saved = json.loads(out_json.read_text())
    assert StepTrace.from_dict(saved["trace"]).world_size == 1024


def test_cli_simulate_bad_inputs_are_messages_not_tracebacks(tmp_path, capsys):
    path = tmp_path / "p.json"
    synthetic().save(path)
    assert main(["simulate", "--profile", str(tmp_path / "none.json")]) == 2
    assert "no profile at" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(path), "--world-size", "0"]) == 2
    assert "world_size must be an int >= 1, got 0" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(path), "--contention"]) == 2
    assert "no measured contention" in capsys.readouterr().err


def test_cli_profile_measures_and_saves(tmp_path, capsys):
    path = tmp_path / "p.json"
    argv = ["profile", "--model", "mlp", "--out", str(path), "--steps", "1", "--warmup", "0"]
    assert main([*argv, "--contention-repeats", "0"]) == 0
    profile = BackwardProfile.load(path)
    assert profile.model == "mlp" and len(profile.params) == 8
    assert "python -m dplab" in profile.meta["command"]
    assert "wrote" in capsys.readouterr().out
