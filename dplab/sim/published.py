"""The published nccl-tests runs (``assets/data/nccl-tests-published.json``) as rows to check
:class:`~dplab.sim.Fabric` against: each run's own hardware read from its fields, each sized row
a measured time. :mod:`dplab.sim.constants_fit` fits the model's constants on rows,
:mod:`dplab.sim.validation` checks the model on the rows a fit never saw.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dplab.sim.fabric import Fabric
from dplab.sim.nccl_model import DEFAULT_CALIBRATION, Calibration
from dplab.sim.nccl_tests import published_runs

KIB, MIB = 2**10, 2**20


@dataclass(frozen=True)
class Row:
    """One published size of one run: what was measured and the fabric that run was."""

    run: str
    source: str
    config: str
    algorithm: str
    nbytes: int
    measured_us: float
    fabric: Fabric
    plateau: tuple[int, float] | None = None  # (bytes, µs) the NICs are calibrated on
    excluded: str = ""  # why the row is kept out of fits and bands

    def fabric_with(self, calibration: Calibration) -> Fabric:
        """The run's fabric with these constants (and, where its source gave no NIC fields,
        NICs calibrated on its own plateau under them)."""
        key = (self.run, calibration)
        f = _FABRICS.get(key)
        if f is None:
            f = self.fabric.with_calibration(calibration)
            if self.plateau is not None:
                b, us = self.plateau
                f = f.with_nics_from_plateau(b, us * 1e-6, self.algorithm)
            if len(_FABRICS) > 4096:
                _FABRICS.clear()
            _FABRICS[key] = f
        return f

    def ratio(self, fabric: Fabric | None = None) -> float:
        """predicted / measured time (with ``fabric``'s constants, default the shipped ones)."""
        f = fabric or self.fabric_with(DEFAULT_CALIBRATION)
        return f.allreduce_s(self.nbytes, algorithm=self.algorithm) * 1e6 / self.measured_us


_FABRICS: dict[tuple[str, Calibration], Fabric] = {}


def source_of(run: dict[str, Any]) -> str:
    """The source a run was quoted from: a GitHub repository (``owner/name``), a gist author
    (``gist:owner``), a repository named without a URL (``owner/name, ...``), or the text."""
    text = run["source"]
    if m := re.search(r"gist\.github\.com/([^/\s]+)", text):
        return f"gist:{m.group(1)}"
    if m := re.search(r"github\.com/([^/\s]+)/([^/\s#]+)", text):
        return f"{m.group(1)}/{m.group(2)}"
    if m := re.match(r"([\w.-]+/[\w.-]+),", text):
        return m.group(1)
    return text


def _gpu(text: str) -> str:
    t = text.lower()
    for g in ("gb200", "b200", "h200", "h100", "h20", "a100", "v100"):
        if g in t:
            return f"{g}-pcie" if "pcie" in t and g in ("a100", "h100") else g
    raise ValueError(f"unknown GPU in the data: {text!r}")


def intra_of(run: dict[str, Any], runs: dict[str, dict[str, Any]] | None = None) -> str | None:
    """The kind of node a run's ``intra_node`` text describes (None: the GPU's default)."""
    t = (run.get("intra_node") or "").lower()
    if m := re.search(r"same machine as ([\w.-]+)", t):
        other = (runs or {r["id"]: r for r in published_runs()}).get(m.group(1))
        return intra_of(other, runs) if other else None
    if "bridge" in t:
        return "nvlink-pairs"
    if "nvswitch" in t:
        return "nvswitch"
    if "cube-mesh" in t:
        return "nvlink"
    return None


def gpus_per_process(run: dict[str, Any]) -> int:
    """nccl-tests' ``-g``: how many GPUs one process drove (its command line or header in the
    quote, or its ``tool`` text), 1 where not given."""
    for text in (run.get("quote") or "", run.get("tool") or ""):
        if m := re.search(r"\bnGpus\s+(\d+)|(?:^|\s|\()-g\s+(\d+)\b", text):
            return int(m.group(1) or m.group(2))
    return 1


def network_of(run: dict[str, Any]) -> str:
    """``efa`` where the source says EFA, ``roce`` where it says RoCE, ``ib`` otherwise."""
    t = (run.get("inter_node") or "").lower()
    return "efa" if "efa" in t else "roce" if "roce" in t and "ib or roce" not in t else "ib"


def excluded_why(run: dict[str, Any]) -> str:
    """Why a run is kept out of the fits and the bands ('' if it is not): a configuration the
    model has no setting for (a preset ``NCCL_GRAPH_FILE`` dictates the channels)."""
    algo = (run.get("algo") or "").lower()
    if "graph_file" in algo and "graph_file disabled" not in algo:
        return "NCCL_GRAPH_FILE set: the channels are a preset file's, not NCCL's search"
    return ""


def box_class(fabric: Fabric) -> str:
    """The kind of box, for the validation table: one node by its intra-node fabric, several
    by their network."""
    if fabric.nodes > 1:
        return {"efa": "multi-node EFA", "roce": "multi-node RoCE", "tcp": "multi-node TCP"}.get(
            fabric.network, "multi-node IB"
        )
    return {"nvlink-pairs": "bridged pairs", "pcie": "PCIe", "nvlink": "NVLink mesh"}.get(
        fabric.intra, "NVSwitch"
    )


def forced_algorithm(text: str | None) -> str:
    """The algorithm a run's source forced (``NCCL_ALGO``, ``NCCL_NVLS_ENABLE=0``), else auto."""
    t = (text or "default").lower()
    if t.startswith("ring") or "nvls_enable=0" in t:
        return "ring"
    if "forced" in t and not t.startswith("default"):
        for a in ("nvlstree", "nvls", "tree", "ring"):
            if t.startswith(a):
                return a
    return "auto"


def fabric_of(run: dict[str, Any], calibration: Calibration = DEFAULT_CALIBRATION) -> Fabric:
    """A published run's own hardware as a Fabric: its GPU (a PCIe card where it says so), its
    node (:func:`intra_of`), network (:func:`network_of`), NICs where the source gives them
    (else the GPU's defaults, to be calibrated on the run's plateau: :func:`published_rows`),
    and nccl-tests' ``-g``."""
    nodes = int(run["nodes"])
    nics, gbps = run.get("nics_per_node"), run.get("nic_gbps")
    return Fabric.from_hardware(
        _gpu(run["gpu"]),
        int(run["gpus_per_node"]),
        nodes,
        int(nics) if nodes > 1 and nics else None,
        float(gbps) if nodes > 1 and gbps else None,
        network_of(run),
        intra_node=intra_of(run),
        gpus_per_process=gpus_per_process(run),
        calibration=calibration,
        name=run["id"],
    )


def published_rows(runs: Iterable[dict[str, Any]] | None = None) -> list[Row]:
    """Every sized row of the published runs. A row with only bus bandwidth is compared as the
    time it implies, ``t = bytes · 2(N−1)/N / busbw`` (nccl-tests' definition); a quoted peak
    with no size is left out (it has no size to put in a band). A multi-node run whose source
    gives no NIC speed has its NICs calibrated on its own largest row, which is then the
    calibration point, not a row (``Row.plateau``)."""
    rows = []
    for run in published_runs() if runs is None else runs:
        fab = fabric_of(run)
        n = fab.world_size
        nics = f"{run['nics_per_node'] or '?'}×{run['nic_gbps'] or '?'}G" if fab.nodes > 1 else ""
        config = f"{run['gpus_per_node']}×{fab.gpu.upper()} × {run['nodes']}" + (
            f", {nics} {fab.network}" if fab.nodes > 1 else ""
        )
        sized = []
        for r in run["rows"]:
            b, t, bus = r.get("bytes"), r.get("time_us"), r.get("busbw_GBps")
            if not b:
                continue
            if t is None:
                if not bus:
                    continue
                t = b * 2 * (n - 1) / n / (bus * 1e9) * 1e6
            sized.append((int(b), float(t)))
        plateau = None
        if fab.nodes > 1 and not run.get("nic_gbps") and sized:
            plateau = max(sized)
            sized.remove(plateau)
        why = excluded_why(run)
        algo = forced_algorithm(run.get("algo"))
        for b, t in sized:
            rows.append(Row(run["id"], source_of(run), config, algo, b, t, fab, plateau, why))
    return rows
