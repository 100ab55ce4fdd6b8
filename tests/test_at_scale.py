"""§8c's closed-form rule (``dplab.sim.CommsRule``) and the what-if profile it feeds the simulator.

The rule is checked against numbers worked by hand from the datasheets, and against the
simulator on a flat link with no latency, where the ring's time is exactly the rule's T_comm: an
independent path (``ring_time`` of ``dplab.collectives``) to the same seconds.
"""

from __future__ import annotations

import math

import pytest

from dplab.sim import (
    BackwardProfile,
    CommsRule,
    Link,
    ParamTiming,
    accumulated_step_ms,
    error_band_line,
    rule_profile,
    simulate,
)
from dplab.sim.validation import BANDS

H100_FLOPS = 989.4e12  # NVIDIA H100 SXM datasheet, dense bf16
NIC_BYTES_S = 400e9 / 8


def shape() -> BackwardProfile:
    """Four tensors, the last registered ready first, as a measured profile would have them."""
    params = [ParamTiming(f"w{i}", 1000 * (i + 1), 4000 * (i + 1), "float32", 10.0 - 2 * i)
              for i in range(4)]  # fmt: skip
    return BackwardProfile("toy", params, forward_ms=5.0, backward_ms=10.0, optimizer_ms=1.0)


def test_the_threshold_is_worked_by_hand_from_the_datasheet():
    rule = CommsRule.from_bandwidth(H100_FLOPS, 400, grad_bytes=2, world_size=1024)
    by_hand = H100_FLOPS / NIC_BYTES_S * (1023 / 1024) * 2 / 3
    assert rule.threshold_tokens == pytest.approx(by_hand, rel=1e-12)
    assert rule.flops_per_byte == pytest.approx(19_788, rel=1e-12)


@pytest.mark.parametrize("n_params", [1e6, 7e9, 4.05e11])
def test_at_the_threshold_compute_equals_comm_whatever_the_model(n_params):
    rule = CommsRule.from_bandwidth(H100_FLOPS, 400, grad_bytes=4, world_size=16)
    d = rule.threshold_tokens
    assert rule.compute_s(n_params, d) == pytest.approx(rule.comm_s(n_params), rel=1e-12)
    assert rule.compute_bound(d) and not rule.compute_bound(0.99 * d)


def test_accumulation_is_the_fewest_micro_batches_that_reach_the_threshold():
    rule = CommsRule.from_bandwidth(H100_FLOPS, 400)
    a = rule.accumulation_steps(4096)
    assert a == math.ceil(rule.threshold_tokens / 4096) == 4
    assert not rule.compute_bound((a - 1) * 4096) and rule.compute_bound(a * 4096)
    assert rule.accumulation_steps(10**9) == 1


def test_the_simulator_on_a_latency_free_ring_gives_the_rules_comm():
    rule = CommsRule(flops_per_s=1e12, beta_s_per_byte=1e-9, grad_bytes=2, world_size=8)
    link = Link.from_beta("no latency", 0.0, rule.beta_s_per_byte)
    profile = rule_profile(shape(), 1e8, 4 * rule.threshold_tokens, rule)
    trace = simulate(profile, world_size=8, link=link, bucket_cap_mb=1e6, first_bucket_cap_mb=1e6)
    assert len(trace.buckets) == 1
    assert trace.metrics.t_comm_ms == pytest.approx(rule.comm_s(profile.n_params) * 1e3, rel=1e-9)
    assert trace.metrics.t_compute_ms > trace.metrics.t_comm_ms  # four times D*: compute-bound


def test_rule_profile_has_the_rules_compute_and_the_shapes_order():
    rule = CommsRule(flops_per_s=2e12, beta_s_per_byte=1e-9, grad_bytes=2, world_size=4)
    p = rule_profile(shape(), 1e9, 1000, rule)
    total_ms = (p.forward_ms + p.backward_ms) / 1e3
    assert total_ms == pytest.approx(rule.compute_s(1e9, 1000), rel=1e-12)
    assert p.backward_ms == pytest.approx(2 * p.forward_ms)
    assert p.n_params == pytest.approx(1e9, rel=1e-6)
    assert p.total_bytes == 2 * p.n_params
    order = [q.name for q in sorted(p.params, key=lambda q: q.ready_ms)]
    assert order == [q.name for q in sorted(shape().params, key=lambda q: q.ready_ms)]


def test_accumulated_step_adds_compute_only_micro_batches():
    rule = CommsRule(flops_per_s=1e12, beta_s_per_byte=1e-9, world_size=8)
    link = Link.from_beta("no latency", 0.0, rule.beta_s_per_byte)
    trace = simulate(rule_profile(shape(), 1e8, 100, rule), world_size=8, link=link)
    m = trace.metrics
    assert accumulated_step_ms(trace, 1) == m.t_step_ms
    assert accumulated_step_ms(trace, 4) == pytest.approx(
        3 * (m.t_forward_ms + m.t_backward_ms) + m.t_step_ms
    )
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1, got 0"):
        accumulated_step_ms(trace, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"flops_per_s": 0, "beta_s_per_byte": 1e-9}, "flops_per_s must be a number > 0, got 0"),
        ({"flops_per_s": 1e12, "beta_s_per_byte": -1}, "beta_s_per_byte must be a number > 0"),
        ({"flops_per_s": 1e12, "beta_s_per_byte": 1e-9, "grad_bytes": 3}, "grad_bytes must be"),
        ({"flops_per_s": 1e12, "beta_s_per_byte": 1e-9, "world_size": 1}, "got 1"),
    ],
)
def test_bad_input_names_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CommsRule(**kwargs)


def test_the_error_band_line_names_every_band():
    line = error_band_line()
    assert all(name in line for name, _, _ in BANDS), line
