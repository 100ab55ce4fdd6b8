"""The flakiness benchmark's bookkeeping: runs spread over sessions add up, loads never mix.

Only the tallies are tested here (the notebooks' runs are faked): the runs themselves are the
benchmark's, and their results live in docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "notebook_flakiness", ROOT / "benchmarks" / "notebook_flakiness.py"
    )
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    outcomes = iter([(True, [], 10.0, ""), (False, ["Cell 4"], 30.0, "boom"), (True, [], 20.0, "")])
    monkeypatch.setattr(mod, "run_once", lambda nb: next(outcomes))
    return mod


def test_appended_runs_add_up_and_the_report_reads_them(bench, tmp_path, capsys):
    saved = tmp_path / "quiet.json"
    for _ in range(3):
        assert bench.main(["--runs", "1", "--only", "03_dp_mechanics", "--append", str(saved)]) == 0
    t = json.loads(saved.read_text())["notebooks"]["03_dp_mechanics.ipynb"]
    assert (t["runs"], t["red"], t["failed_cells"], t["seconds"]) == (
        3,
        1,
        {"Cell 4": 1},
        [10, 30, 20],
    )
    capsys.readouterr()
    assert bench.main(["--report", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "| 03_dp_mechanics.ipynb | 3 | 1 | Cell 4 (1) | 20 | 30 |" in out
    assert "stale" not in out


def test_a_file_of_quiet_runs_refuses_loaded_ones_before_running(bench, tmp_path, monkeypatch):
    saved = tmp_path / "quiet.json"
    bench.main(["--runs", "1", "--only", "03_dp_mechanics", "--append", str(saved)])
    monkeypatch.setattr(bench, "cpu_hog", lambda: pytest.fail("a hog was started"))
    with pytest.raises(SystemExit, match="load 'none', not 'cpu'"):
        bench.main(["--runs", "1", "--load", "cpu", "--only", "03_dp_mechanics",
                    "--append", str(saved)])  # fmt: skip


def test_a_changed_notebook_starts_over(bench, tmp_path, monkeypatch, capsys):
    saved = tmp_path / "quiet.json"
    args = ["--runs", "1", "--only", "03_dp_mechanics", "--append", str(saved)]
    bench.main(args)
    real_sha = bench.notebook_sha
    monkeypatch.setattr(bench, "notebook_sha", lambda nb: "another version")
    bench.main(args)
    assert "changed since its 1 saved runs: they are dropped" in capsys.readouterr().out
    t = json.loads(saved.read_text())["notebooks"]["03_dp_mechanics.ipynb"]
    assert (t["runs"], t["sha"]) == (1, "another version")
    monkeypatch.setattr(bench, "notebook_sha", real_sha)  # the notebook on disk is not that
    bench.main(["--report", str(saved)])
    assert "03_dp_mechanics.ipynb: its runs are of an older version" in capsys.readouterr().out


def test_a_red_cell_is_kept_as_its_failing_line_without_colour(bench):
    from _pytest.junitxml import bin_xml_escape

    nbval = (
        "\x1b[0;31mAssertionError\x1b[0m   Traceback (most recent call last)\n"
        "Cell In[1], line 3\n      1 x = 1\n      2 y = 2\n"
        "\x1b[0;32m----> 3\x1b[0m assert x == y, (x, y)\n\n"
        "\x1b[0;31mAssertionError\x1b[0m: (1, 2)\n"
    )
    failure = ET.Element("failure")
    failure.text = bin_xml_escape(nbval)  # as pytest's junit report holds it: ESC is "#x1B"
    from_junit = ET.fromstring(ET.tostring(failure)).text
    for text in (nbval, from_junit):
        kept = bench.failing_line(text)
        assert "\x1b" not in kept and "#x1B" not in kept, kept
        assert "----> 3 assert x == y, (x, y)" in kept and kept.endswith("AssertionError: (1, 2)")
    deep = nbval.replace("----> 3", "--> 120").replace("line 3", "line 120")
    assert "--> 120 assert x == y" in bench.failing_line(deep)  # IPython's arrow at line >= 100
    assert bench.failing_line("a\nb\nc", context=2) == "b\nc"  # no mark: the last lines
