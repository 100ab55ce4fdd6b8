"""The simulator under bad input (docs/reliability.md): a link whose all-reduce overflows is refused
within a second, a huge but finite one still simulates, the schedule refuses times it cannot add,
and a bad bucket-cap range is named.
"""

from __future__ import annotations

import math
import signal
import time

import pytest

from dplab.sim import BackwardProfile, Link, simulate
from dplab.sim.engine import candidate_caps, schedule
from dplab.sim.link import ASSETS

PROFILE = ASSETS / "profile_gpt-7m.json"


class _Alarm(Exception):
    pass


@pytest.fixture
def alarm():
    """Interrupt the test after 10 s (the old simulator looped forever on these inputs)."""

    def ring(*_):
        raise _Alarm("still running after 10 s")

    old = signal.signal(signal.SIGALRM, ring)
    t0 = time.monotonic()
    pending, _ = signal.setitimer(signal.ITIMER_REAL, 10.0)  # pytest-timeout's, if it set one
    yield
    signal.setitimer(signal.ITIMER_REAL, 0.0)
    signal.signal(signal.SIGALRM, old)
    if pending:
        signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - t0), 0.001))


@pytest.mark.parametrize(("alpha_s", "bandwidth_Bps"), [(1e306, 1e-300), (0.0, 1e-300)])
def test_a_link_whose_all_reduce_overflows_is_refused_within_a_second(
    alpha_s, bandwidth_Bps, alarm
):
    """Before: bandwidth 1e-300 B/s with α 1e306 s made the schedule's event loop spin forever
    (inf - inf is nan, so no event was ever reached)."""
    profile = BackwardProfile.load(PROFILE)
    link = Link("slow", alpha_s, bandwidth_Bps)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        simulate(profile, link=link, world_size=2)
    assert time.monotonic() - t0 < 1.0
    text = str(e.value)
    assert "'slow'" in text and f"bandwidth_Bps={bandwidth_Bps!r}" in text
    assert "bucket 0" in text and "out of any real range" in text


def test_a_huge_but_finite_link_still_simulates(alarm):
    """The negative control: a link that is slow but whose times fit in a float is simulated."""
    trace = simulate(BackwardProfile.load(PROFILE), link=Link("slow", 1e300, 1e3), world_size=2)
    assert math.isfinite(trace.metrics.t_step_ms) and trace.metrics.t_step_ms > 1e300


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"comm_ms": [math.inf, 1.0]}, "comm_ms[0] must be a finite number of ms >= 0, got inf"),
        ({"comm_ms": [1.0, math.nan]}, "comm_ms[1] must be a finite number of ms >= 0, got nan"),
        ({"comm_ms": [1e308, 1e308]}, "the step's times overflow"),
        ({"backward_ms": math.inf}, "backward_ms must be a finite number >= 0, got inf"),
        ({"prep_ms": [0.0, -1.0]}, "prep_ms[1] must be a finite number of ms >= 0, got -1.0"),
    ],
)
def test_the_schedule_refuses_times_it_cannot_add(kwargs, needle, alarm):
    """Before: the same inputs given to ``schedule`` directly looped forever or returned nan."""
    args = {"ready": [1.0, 2.0], "backward_ms": 3.0, "comm_ms": [1.0, 1.0], **kwargs}
    with pytest.raises(ValueError) as e:
        schedule(args["ready"], args["backward_ms"], args["comm_ms"], prep_ms=args.get("prep_ms"))
    assert needle in str(e.value)


@pytest.mark.parametrize(
    ("low_mb", "needle"),
    [
        (0, "low_mb must be > 0 MiB, got 0"),
        (-1.0, "low_mb must be > 0 MiB, got -1.0"),
        (math.nan, "low_mb must be a finite number of MiB, got nan"),
        (1e-12, "low_mb=1e-12 is 0 bytes"),
    ],
)
def test_candidate_caps_names_a_bad_low_mb(low_mb, needle):
    """Before: ``candidate_caps(low_mb=0)`` said "math domain error"."""
    with pytest.raises(ValueError) as e:
        candidate_caps(BackwardProfile.load(PROFILE), low_mb=low_mb)
    assert needle in str(e.value)
