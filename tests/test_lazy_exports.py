"""The packages that import their names on first use (``dplab._lazy``): every public name is the
object its module defines, no public name is hidden by a submodule of the same name, and the
simulator's command answers without importing torch (issue 28: ``simulate`` under 2 s; torch's
import alone takes about 1.9 s on the 2-core machine)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

LAZY = ("dplab", "dplab.ddp", "dplab.trace", "dplab.collectives", "dplab.memory")


@pytest.mark.parametrize("package", LAZY)
def test_every_public_name_resolves_to_its_home_object(package):
    pkg = importlib.import_module(package)
    home = pkg.__getattr__.home  # name -> the module the package's table says holds it
    for name in pkg.__all__:
        value = getattr(pkg, name)
        if name in home:  # dplab's eagerly imported launch names are plain attributes
            assert getattr(importlib.import_module(home[name]), name) is value, name
        assert name in dir(pkg)
    with pytest.raises(AttributeError, match=f"{package!r} has no attribute 'no_such_name'"):
        pkg.no_such_name  # noqa: B018


@pytest.mark.parametrize("package", LAZY)
def test_no_public_name_is_also_a_submodule(package):
    pkg = importlib.import_module(package)
    submodules = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    # ``launch`` is both: dplab imports it eagerly, so the function wins (checked below)
    clashes = (set(pkg.__all__) & submodules) - ({"launch"} if package == "dplab" else set())
    assert not clashes


def test_launch_and_accumulate_stay_functions_after_their_modules_are_imported():
    import dplab
    import dplab.ddp
    import dplab.ddp.accumulation
    import dplab.launch.cluster

    assert callable(dplab.launch) and dplab.launch.__name__ == "launch"
    assert dplab.ddp.accumulate.__name__ == "accumulate"


def test_a_subpackage_read_as_an_attribute_after_a_bare_import_is_imported():
    code = "import dplab\nprint(dplab.trace.NullObserver.__name__, dplab.ddp.DDP.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["NullObserver", "DDP"], out.stderr


def _imports_torch(code: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    return out[-1] == "True"


def test_the_simulator_command_does_not_import_torch():
    run = (
        "import contextlib, io\nfrom dplab.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    argv = ['simulate', '--preset', 'aws-p5', '--nodes', '16', '--model', 'gpt-7m']\n"
        "    assert main(argv) == 0\n"
        "    assert main([*argv, '--sharding', 'zero3']) == 0"
    )
    assert not _imports_torch(run)
    # the control: a verb that trains does import it, so the probe can tell
    assert _imports_torch("import dplab\ndplab.DDP")
