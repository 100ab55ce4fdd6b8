"""The install story: pyproject and environment.yml name the same packages; README ↔ CI."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"pytorch": "torch"}  # conda's name → PyPI's name
CONDA_ONLY = {"python", "pip", "pytorch-cuda"}  # the interpreter and conda's CUDA selector


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_side = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["lab"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_side = set()
    for dep in env["dependencies"]:
        if isinstance(dep, str):
            name = _name(dep.split("=")[0])
            conda_side.add(CONDA_NAMES.get(name, name))
    assert conda_side - CONDA_ONLY == pip_side


def test_torch_is_a_range_not_a_pin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch,) = [r for r in project["dependencies"] if _name(r) == "torch"]
    assert torch.replace(" ", "") == "torch>=2.4"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"^\s*(make \w+)\s*$", readme, flags=re.M)
    assert "make test" in commands and "make lab" in commands
    assert re.search(r"^make test$", ci, flags=re.M)
