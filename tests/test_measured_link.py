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
