"""measure_link: the one α-β fit the lessons share."""

from __future__ import annotations

import pytest

from dplab.sim import Link, measure_link


def test_one_size_is_refused_naming_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"\[4096, 4096\]"):
        measure_link(object(), sizes=[4096, 4096])


def test_the_fit_on_two_ranks_is_a_link_that_says_where_it_came_from(cluster2) -> None:
    link = measure_link(cluster2)
    assert isinstance(link, Link)
    assert "fitted now" in link.source and "2 ranks" in link.source
    # β from the fit is what the link's bandwidth inverts: a sign or unit slip breaks this
    assert link.beta_s_per_byte == pytest.approx(1 / link.bandwidth_Bps)
    assert link.allreduce_s(4_194_304, 2) > link.allreduce_s(4_096, 2) > 0


class ScriptedCluster:
    """A cluster whose all-reduce timings are given: the retry logic needs no ranks."""

    def __init__(self, *timings: dict[int, float]) -> None:
        self.timings, self.calls, self.world_size = list(timings), 0, 2

    def run(self, fn, *, sizes, **kwargs):
        from dplab.collectives import BandwidthRow

        t = self.timings[min(self.calls, len(self.timings) - 1)]
        self.calls += 1
        return [[BandwidthRow("all_reduce", 2, s, t[s], 0.0, 0.0, 1) for s in sizes]]


LINEAR = {s: 50e-6 + s * 1e-9 for s in (4_096, 262_144, 1_048_576, 4_194_304)}
# A busy moment on the smallest size: 4 KiB as slow as 4 MiB, so the best fit has β = 0.
FLAT = {**LINEAR, 4_096: 10e-3, 262_144: 9e-3, 1_048_576: 8e-3, 4_194_304: 7e-3}


def test_a_fit_with_zero_beta_is_measured_again() -> None:
    from dplab.collectives import fit_rows

    rows = ScriptedCluster(FLAT).run(None, sizes=list(FLAT))[0]
    assert fit_rows(rows)[("all_reduce", 2)].beta_s_per_byte == 0.0  # the flat times are degenerate
    cluster = ScriptedCluster(FLAT, LINEAR)
    link = measure_link(cluster)
    assert cluster.calls == 2
    assert link.alpha_s == pytest.approx(25e-6) and link.beta_s_per_byte == pytest.approx(1e-9)


def test_every_fit_degenerate_is_an_error_that_gives_the_times() -> None:
    from dplab.collectives import measure_fit

    cluster = ScriptedCluster(FLAT)
    with pytest.raises(RuntimeError, match=r"3 measurements in a row.*4,096 B: 10000 µs"):
        measure_fit(cluster, list(FLAT))
    assert cluster.calls == 3


def test_fit_on_must_be_measured() -> None:
    from dplab.collectives import measure_fit

    with pytest.raises(ValueError, match=r"fit_on \[1, 2\]"):
        measure_fit(object(), [4096, 8192], fit_on=[1, 2])
