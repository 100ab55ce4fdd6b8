"""torch's own DDP tests, imported from the installed wheel, pointed at the DDP under test.

Importing this module (in a rank process) reads three environment variables:

- ``DPLAB_CONFORMANCE_DDP``: ``torch`` (the control: torch's ``DistributedDataParallel``) or
  ``dplab`` (``dplab.DDP`` in its place);
- ``DPLAB_CONFORMANCE_SHIM``: ``1`` to apply the CPU shim (:mod:`tests.conformance.shim`);
- ``WORLD_SIZE``.

The tests are torch's ``DistributedTest._DistTestBase`` from
``torch/testing/_internal/distributed/distributed_test.py``, imported, never copied. The DDP
under test replaces ``DistributedDataParallel`` where those tests look it up: the module global
``distributed_test.DistributedDataParallel`` and ``torch.nn.parallel.DistributedDataParallel``
(tests write both). Nothing else of torch is patched (torch's own code that names its class,
such as ``torch.distributed.algorithms.join``, keeps it).
"""

from __future__ import annotations

import inspect
import os
import re

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")

SHIM = os.environ.get("DPLAB_CONFORMANCE_SHIM") == "1"
WHICH = os.environ.get("DPLAB_CONFORMANCE_DDP", "torch")

if SHIM:
    from tests.conformance import shim

    shim.lift_gpu_gates()

import torch  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402

if WHICH == "dplab":
    from dplab.ddp.ddp import DDP as _UNDER_TEST
elif WHICH == "torch":
    _UNDER_TEST = torch.nn.parallel.DistributedDataParallel
else:
    raise ValueError(f"DPLAB_CONFORMANCE_DDP={WHICH!r}: expected 'torch' or 'dplab'")

if SHIM:
    shim.fake_cuda_runtime()
    _UNDER_TEST = shim.shimmed(_UNDER_TEST)

dt.DistributedDataParallel = _UNDER_TEST
torch.nn.parallel.DistributedDataParallel = _UNDER_TEST


class Conformance(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    """torch's test base with torch's per-rank set-up (``TestDistBackend``), as torch's own
    ``test/distributed/test_distributed_spawn.py`` builds it."""


_DDP_WORDS = re.compile(r"ddp|distributeddataparallel", re.IGNORECASE)


_HELPER_CALL = re.compile(r"self\.(_\w+)\(")


def _source(name: str) -> str:
    try:
        return inspect.getsource(inspect.unwrap(getattr(dt.DistributedTest._DistTestBase, name)))
    except (AttributeError, OSError, TypeError):
        return ""


def ddp_tests() -> list[str]:
    """The DDP tests of torch's suite: a name that says DDP, or a body (or a ``self._helper``
    it calls) that builds a ``DistributedDataParallel``."""
    names = []
    for name in sorted(dir(dt.DistributedTest._DistTestBase)):
        if not name.startswith("test_"):
            continue
        source = _source(name)
        helpers = "".join(_source(h) for h in set(_HELPER_CALL.findall(source)))
        if _DDP_WORDS.search(name) or "DistributedDataParallel" in source + helpers:
            names.append(name)
    return names
