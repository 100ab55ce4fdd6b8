"""What NCCL does after it has chosen an algorithm and protocol, and its cost model leaves out:
a small message runs on fewer channels, and a ring's share under one loop is cut into smaller
chunks, so the pipeline fills with less.

Oracles: NVIDIA/nccl at 5067397, numbers worked by hand here, not taken from the model:
``enqueue.cc`` ``topoGetAlgoInfo`` (channels dropped while nBytes < nc · nThreads ·
threadThreshold), ``comm.h`` (thresholds LL 8, LL128 8, Simple 64), ``tuning.cc`` (the ring's
LL threshold × nRanks; ring LL bus bandwidth = channels · speed · 0.5, capped by ``llMaxBws``),
``device.h`` (512 threads for LL and Simple, 640 for LL128), ``all_reduce.h`` (under one loop a
chunk is the channel's share / nRanks) and ``prims_simple.h`` (two slices per chunk, each at
least 1/32 of a full 1 MiB slice).
"""

from __future__ import annotations

import pytest

from dplab.sim import Fabric

KIB, MIB = 2**10, 2**20


@pytest.fixture(scope="module")
def a100():
    """8 × A100 on NVSwitch: 12 NVLinks × 20 GB/s, NCCL's search gives 12 channels of 20."""
    t = Fabric.preset("dgx-a100").topology
    assert t.nranks == 8 and t.channels_used(2**40, "ring", "Simple") == 12
    return t


def test_a_small_message_runs_on_fewer_channels(a100):
    # ring LL: 512 threads × 8 B × 8 ranks = 32 KiB per channel
    assert [a100.channels_used(n, "ring", "LL") for n in (1, 32 * KIB, 96 * KIB, MIB)] == [
        1, 1, 3, 12,
    ]  # fmt: skip
    # the same on 16 ranks needs twice as much per channel
    two = Fabric.preset("dgx-a100", nodes=2).topology
    assert two.channels_used(96 * KIB, "ring", "LL") == 1
    # Simple: 512 × 64 B = 32 KiB per channel whatever the ranks; LL128: 640 × 8 B = 5 KiB
    assert a100.channels_used(64 * KIB, "ring", "Simple") == 2
    assert a100.channels_used(64 * KIB, "tree", "LL128") == 12
    assert a100.channels_used(5 * 640 * 8, "ring", "LL128") == 5


def test_fewer_channels_carry_only_their_share_of_ll(a100):
    """Ring LL at 96 KiB runs on 3 of 12 channels: 3 × 20 GB/s × 0.5 = 30 GB/s of bus
    bandwidth; a 1 GiB message on all 12 reaches NCCL's cap, llMaxBws 87.7 (Ampere, 1 node)."""
    cal = a100.calibration
    algbw_per_bus = cal.bw_efficiency * cal.proto_bw["LL"] * 8 / 14  # × n / 2(n−1)
    lat = a100.table[("ring", "LL")][0]
    for nbytes, bus in ((96 * KIB, 30.0), (2**30, 87.7)):
        expected = lat + nbytes / (1e3 * bus * algbw_per_bus)
        assert a100.time_us(nbytes, "ring", "LL") == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("nbytes", "piece"),
    [
        (4 * 2**30, MIB),  # many loops: a full 1 MiB slice
        (16 * MIB, 16 * MIB / 12 / 8 / 2),  # one loop: share / 8 ranks, two slices
        (MIB, 32 * KIB),  # the floor: 1/32 of a full slice
    ],
)
def test_a_rings_pipeline_fills_with_the_slice_nccl_sends(a100, nbytes, piece):
    fill = a100.calibration.fill_slices
    assert fill > 0
    bare = Fabric.preset("dgx-a100").with_calibration(a100.calibration.with_(fill_slices=0.0))
    ch_bw = 20.0 * a100.calibration.bw_efficiency  # one channel's GB/s
    got = a100.time_us(nbytes, "ring", "Simple") - bare.topology.time_us(nbytes, "ring", "Simple")
    assert got == pytest.approx(fill * piece / (1e3 * ch_bw), rel=1e-9)
