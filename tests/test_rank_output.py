"""What a rank prints reaches the caller prefixed by rank, except Kineto's profiler markers."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from dplab.launch.output import RankOutput

MARKERS = (
    "USDT:2026-12-02 21:43:06 9914:9914 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    "USDT:2026-12-02 21:43:06 9914:9914 SyncActivityProfilerHandler.cpp:59] profiler_stop\n"
)


def test_profiler_markers_stay_in_the_log_and_every_other_line_is_relayed(tmp_path: Path):
    log = tmp_path / "rank1.log"
    log.write_text(
        "loss 0.25\n" + MARKERS + "USDT: a line of the learner's own\n"
        "Warning: profiler_start is a word here\n"
    )
    out, shown = RankOutput(1, str(log)), io.StringIO()
    out.relay(shown)
    out.close()
    assert shown.getvalue().splitlines() == [
        "[rank 1] loss 0.25",
        "[rank 1] USDT: a line of the learner's own",
        "[rank 1] Warning: profiler_start is a word here",
    ]
    assert MARKERS in log.read_text()  # kept where a debugger looks


def _profiled_step() -> str:
    with torch.profiler.profile():
        torch.ones(8).sum()
    print("step done", flush=True)
    return "ok"


def test_a_traced_call_shows_the_ranks_lines_without_the_markers(cluster2, capsys):
    assert cluster2.run(_profiled_step) == ["ok", "ok"]
    err = capsys.readouterr().err
    assert "[rank 0] step done" in err and "[rank 1] step done" in err
    if not all("] profiler_start" in Path(log.path).read_text() for log in cluster2._logs):
        pytest.skip(f"torch {torch.__version__}'s profiler prints no markers (2.13 does)")
    assert "profiler_start" not in err and "profiler_stop" not in err, err
