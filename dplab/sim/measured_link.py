"""The link between these ranks, measured once: the α-β fit every lesson after §3.7 reuses.

§3.7 derives the ring all-reduce's cost, α per step plus β per byte, and fits it to timed
all-reduces. Later lessons need that same fit as a :class:`~dplab.sim.link.Link` to feed the
simulator; each calls :func:`measure_link` instead of repeating the fit in its own cells, so the
course makes the fit one way, with one set of sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dplab.collectives import measure_fit
from dplab.sim.link import Link

# Four sizes a factor 4 to 64 apart: the smallest is all α on loopback gloo, the largest all β,
# so the two constants are both pinned and the fit takes about a second on two ranks.
FIT_SIZES: tuple[int, ...] = (4_096, 262_144, 1_048_576, 4_194_304)


def measure_link(
    cluster: Any, *, sizes: Sequence[int] = FIT_SIZES, repeats: int = 3, name: str = "these ranks"
) -> Link:
    """Time all-reduces of ``sizes`` on a warm ``dplab.Cluster`` and fit the ring's α and β.

    The result is a :class:`Link` whose ``source`` says it was fitted now, on how many ranks;
    ``link.alpha_s`` and ``link.beta_s_per_byte`` are the fit's constants.
    """
    fit, _ = measure_fit(cluster, sizes, repeats=repeats)
    source = f"fitted now: ring all-reduce of {len(set(sizes))} sizes on {cluster.world_size} ranks"
    return Link.from_beta(name, fit.alpha_s, fit.beta_s_per_byte, source=source)
