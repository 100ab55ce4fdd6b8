"""The boxes people rent: a node's intra-node fabric as an input (NVSwitch, NVLink-bridged pairs,
PCIe), many NICs, one GPU per node, NICs calibrated on a sweep's own plateau, and a fabric built
from a user's own nccl-tests log.

Oracles: NCCL's own formulas (``topo.cc``: a PCIe link is ``width × speed / 80`` GB/s; ``topo.h``
per-link NVLink and inter-socket speeds; ``tuning.cc``: PCI latencies and no LL128 when the ring's
intra path is not NVLink), and synthetic logs printed from a fabric whose NICs are known.
"""

from __future__ import annotations

import pytest

from dplab.sim import Fabric
from dplab.sim.hardware import PRESETS, pcie_GBps
from dplab.sim.nccl_tests import format_nccl_tests, parse_nccl_tests


def test_pcie_is_nccls_width_times_speed_over_80():
    assert [pcie_GBps(g) for g in (3, 4, 5, 6)] == [12.0, 24.0, 48.0, 96.0]
    assert pcie_GBps(4, width=8) == 12.0
    with pytest.raises(ValueError, match=r"pcie_gen must be one of .* got 7"):
        pcie_GBps(7)


def test_the_node_defaults_to_what_the_gpu_ships_in():
    assert Fabric.from_hardware("a100").intra == "nvswitch"
    assert Fabric.from_hardware("a100-pcie").intra == "pcie"
    assert Fabric.from_hardware("h100-pcie").intra_GBps == 48.0  # Gen5 x16
    assert Fabric.from_hardware("a100-pcie").intra_GBps == 24.0  # Gen4 x16


def test_a_ring_over_bridged_pairs_runs_at_its_slowest_hop():
    pair = Fabric.from_hardware("a100-pcie", 2, intra_node="nvlink-pairs")
    four = Fabric.from_hardware("a100-pcie", 4, intra_node="nvlink-pairs")
    sockets = Fabric.from_hardware(
        "a100-pcie", 4, intra_node="nvlink-pairs", pcie_across="sockets", cpu="amd"
    )
    assert pair.intra_GBps == 240.0 and pair.intra_hw == "nvlink"  # 12 NVLink 3 links
    assert four.intra_GBps == 24.0 and four.intra_hw == "pci"  # the PCIe hop between pairs
    assert sockets.intra_GBps == 16.0  # NCCL's AMD inter-socket link
    # NCCL enables LL128 only on NVLink paths: the pair has it, the four-GPU ring does not
    assert ("ring", "LL128") in pair.topology.table
    assert ("ring", "LL128") not in four.topology.table
    # large messages: the four-GPU box is bound by PCIe, ten times slower than its bridge
    big = 2**30
    ratio = four.busbw_GBps(big) / pair.busbw_GBps(big)
    assert 0.05 < ratio < 0.15
    assert "NVLink bridge 240 + PCIe through a switch 24" in four.describe()
    with pytest.raises(ValueError, match=r"intra must be one of .*'nvlink-pair'"):
        Fabric.from_hardware("a100-pcie", 4, intra_node="nvlink-pair")
    with pytest.raises(ValueError, match="give intra_node or intra, not both"):
        Fabric.from_hardware("a100", intra_node="pcie", intra="nvswitch")


def test_one_gpu_per_node_and_many_nics():
    one = Fabric.from_hardware("h200", 1, 2, 1, 400, "roce")
    assert one.world_size == 2 and one.algorithms() == ("ring", "tree")
    assert "1 GPU" in one.describe()
    few = Fabric.from_hardware("a100", 8, 2, 4, 100, "roce")
    many = Fabric.from_hardware("a100", 8, 2, 16, 100, "roce")
    for s in (2**10, 2**20, 2**30):
        assert many.allreduce_s(s) <= few.allreduce_s(s)
    assert many.allreduce_s(2**32) < 0.5 * few.allreduce_s(2**32)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_names_its_source(name):
    kw, source = PRESETS[name]
    assert len(source) > 30
    fab = Fabric.preset(name, nodes=2 if kw.get("gpus_per_node", 8) else 1)
    assert fab.source == source and fab.allreduce_s(2**20) > 0


def test_nics_from_the_plateau_recover_a_known_speed():
    truth = Fabric.from_hardware("h200", 1, 2, 1, 200, "roce")
    big = 2**33
    guess = Fabric.from_hardware("h200", 1, 2, 1, 800, "roce")
    fitted = guess.with_nics_from_plateau(big, truth.allreduce_s(big))
    assert fitted.nic_gbps == pytest.approx(200, rel=0.01)
    assert "calibrated from the sweep's own plateau" in fitted.source
    with pytest.raises(ValueError, match="is one node: it has no NICs"):
        Fabric.from_hardware("h200").with_nics_from_plateau(big, 1.0)


def test_from_nccl_tests_log_calibrates_the_nics_and_says_so():
    truth = Fabric.from_hardware("h200", 1, 2, 1, 200, "roce")
    sizes = [2**k for k in range(10, 34)]
    log = format_nccl_tests([(s, truth.allreduce_s(s) * 1e6) for s in sizes], 2)
    fab = Fabric.from_nccl_tests_log(log, "h200", 1, network="roce")
    assert fab.nodes == 2 and fab.nic_gbps == pytest.approx(200, rel=0.02)
    assert "plateau" in fab.source and "fit to 24 measured sizes" in fab.source
    for s in (2**12, 2**20, 2**28):
        assert fab.allreduce_s(s) == pytest.approx(truth.allreduce_s(s), rel=0.05)
    given = Fabric.from_nccl_tests_log(log, "h200", 1, nic_gbps=200, network="roce")
    assert "plateau" not in given.source
    with pytest.raises(ValueError, match="not a whole number of 8-GPU nodes"):
        Fabric.from_nccl_tests_log(format_nccl_tests([(8, 20.0), (16, 20.0)], 12), "h100")


def test_nccl_tests_minus_g_is_read_and_costs_latency():
    text = "# nThread 1 nGpus 8 minBytes 64 maxBytes 1024\n  64 16 float sum -1 32.0 0 0 0\n"
    assert parse_nccl_tests(text).gpus_per_process == 8
    one = Fabric.from_hardware("a100")
    g8 = Fabric.from_hardware("a100", gpus_per_process=8)
    per_gpu = one.calibration.launch_us_per_gpu
    assert per_gpu > 0
    assert (g8.allreduce_s(64) - one.allreduce_s(64)) * 1e6 == pytest.approx(7 * per_gpu)
