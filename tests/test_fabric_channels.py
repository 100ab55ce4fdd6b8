"""What NCCL does after it has chosen an algorithm and protocol, and its cost model leaves out:
it launches twice the channels its search found, runs a small message on fewer of them, and a
ring's share under one loop is cut into smaller chunks, so the pipeline fills with less.

Oracles: NVIDIA/nccl at 5067397, numbers worked by hand here, not taken from the model:
``connect.cc`` ``ncclTopoPostset`` (channels doubled, up to 64; doubled again below 16 on
Hopper across nodes when a ring channel runs above 45 GB/s), ``enqueue.cc``
``topoGetAlgoInfo`` (channels dropped while nBytes < nc · nThreads · threadThreshold),
``comm.h`` (thresholds LL 8, LL128 8, Simple 64), ``tuning.cc`` (the ring's LL threshold ×
nRanks), ``device.h`` (512 threads for LL and Simple, 640 for LL128), ``all_reduce.h`` (under
one loop a chunk is the channel's share / nRanks) and ``prims_simple.h`` (two slices per chunk,
each at least 1/32 of a full 1 MiB slice).
"""

from __future__ import annotations

import pytest

from dplab.sim import Fabric

KIB, MIB = 2**10, 2**20


@pytest.fixture(scope="module")
def a100():
    """8 × A100 on NVSwitch: 12 NVLinks × 20 GB/s; NCCL's search: 12 channels of 20 GB/s."""
    return Fabric.preset("dgx-a100").topology


def test_nccl_launches_twice_the_channels_its_search_found(a100):
    assert a100.runtime_channels == 24  # 2 × 12
    # two H100 nodes: 7 search channels of 53 GB/s (8 × 400 Gb/s NICs), doubled to 14, and
    # doubled again because 14 < 16 on Hopper across nodes with a channel above 45 GB/s
    assert Fabric.preset("dgx-h100", nodes=2).topology.runtime_channels == 28
    assert Fabric.preset("dgx-a100", nodes=2).topology.runtime_channels == 16  # Ampere: no


def test_a_small_message_runs_on_fewer_channels(a100):
    # ring LL: 512 threads × 8 B × 8 ranks = 32 KiB per channel
    sizes = (1, 32 * KIB, 96 * KIB, MIB)
    assert [a100.channels_used(n, "ring", "LL") for n in sizes] == [1, 1, 3, 24]
    # the same on 16 ranks needs twice as much per channel
    two = Fabric.preset("dgx-a100", nodes=2).topology
    assert two.channels_used(96 * KIB, "ring", "LL") == 1
    # Simple: 512 × 64 B = 32 KiB per channel whatever the ranks; LL128: 640 × 8 B = 5 KiB
    assert a100.channels_used(64 * KIB, "ring", "Simple") == 2
    assert a100.channels_used(64 * KIB, "tree", "LL128") == 12
    assert a100.channels_used(5 * 640 * 8, "ring", "LL128") == 5


@pytest.mark.parametrize(
    ("nbytes", "piece"),
    [
        (4 * 2**30, MIB),  # many loops: a full 1 MiB slice
        (16 * MIB, 16 * MIB / 24 / 8 / 2),  # one loop: a channel's share / 8 ranks, two slices
        (MIB, 32 * KIB),  # the floor: 1/32 of a full slice
        (64 * KIB, 32 * KIB),  # on 2 channels (Simple's 32 KiB each): the floor again
    ],
)
def test_a_rings_pipeline_fills_with_the_slice_nccl_sends(a100, nbytes, piece):
    """The fill is ``fill_slices`` of NCCL's slice at one launched channel's speed: 12 search
    channels of 20 GB/s run as 24 of 10."""
    cal = a100.calibration
    assert cal.fill_slices > 0
    bare = Fabric.preset("dgx-a100").with_calibration(cal.with_(fill_slices=0.0)).topology
    launched = 10.0 * cal.bw_efficiency  # GB/s
    got = a100.time_us(nbytes, "ring", "Simple") - bare.time_us(nbytes, "ring", "Simple")
    assert got == pytest.approx(cal.fill_slices * piece / (1e3 * launched), rel=1e-9)
