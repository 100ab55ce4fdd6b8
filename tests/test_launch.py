"""dplab.launch and dplab.Cluster: results by rank, failures as RankError, nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

import dplab
from dplab.launch import resolve_backend
from tests.conftest import child_pids


def _rank_and_sum(offset: float) -> tuple[int, int, float]:
    import torch

    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def test_results_come_back_indexed_by_rank():
    out = dplab.launch(_rank_and_sum, 3, args=(1.0,))
    assert out == [(r, 3, 0 + 1 + 2 + 3.0) for r in range(3)]


def test_kwargs_and_world_size_one():
    assert dplab.launch(_rank_and_sum, 1, kwargs={"offset": 5.0}) == [(0, 1, 5.0)]


def test_auto_backend_is_gloo_without_gpus_and_nccl_is_refused():
    assert resolve_backend("auto", 2, gpus=0) == "gloo"
    with pytest.raises(ValueError, match=r"(GPU|NCCL)"):
        resolve_backend("nccl", 2, gpus=1 if dist.is_nccl_available() else 0)
    with pytest.raises(ValueError, match="backend must be"):
        resolve_backend("mpi-ish", 2)


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch has no NCCL")
def test_auto_backend_picks_nccl_with_a_gpu_per_rank():
    assert resolve_backend("auto", 2, gpus=2) == "nccl"
    assert resolve_backend("auto", 4, gpus=2) == "gloo"


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", None, True])
def test_bad_world_size_is_refused(bad):
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        dplab.launch(_rank_and_sum, bad, args=(0.0,))
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        dplab.Cluster(bad)


def test_unpicklable_function_is_refused_before_starting_ranks():
    import threading

    lock = threading.Lock()

    def uses_lock():
        return lock.locked()

    before = child_pids()
    with pytest.raises(TypeError, match="cannot be pickled"):
        dplab.launch(uses_lock, 2)
    assert child_pids() == before


def test_rank_error_names_the_rank_and_its_traceback_and_leaves_nothing():
    def fails_on_rank_one():
        if dist.get_rank() == 1:
            raise ZeroDivisionError("planted on rank 1")
        dist.barrier()  # rank 0 waits here for a rank that will never come
        return "unreachable"

    before = child_pids()
    t0 = time.monotonic()
    with pytest.raises(dplab.RankError) as info:
        dplab.launch(fails_on_rank_one, 2)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 1
    assert isinstance(info.value, RuntimeError)
    assert "ZeroDivisionError: planted on rank 1" in str(info.value)
    assert "fails_on_rank_one" in str(info.value)
    assert 'raise ZeroDivisionError("planted on rank 1")' in str(info.value)  # source line back
    assert elapsed < 30
    assert child_pids() == before


def test_a_rank_that_dies_is_reported():
    def dies():
        if dist.get_rank() == 0:
            os._exit(7)
        dist.barrier()

    with pytest.raises(dplab.RankError, match="exited with code 7") as info:
        dplab.launch(dies, 2)
    assert info.value.rank == 0


def test_timeout_names_the_ranks_that_did_not_finish():
    def rank1_sleeps():
        if dist.get_rank() == 1:
            time.sleep(60)
        return dist.get_rank()

    before = child_pids()
    with pytest.raises(dplab.RankTimeout, match=r"ranks 1 did not finish") as info:
        dplab.launch(rank1_sleeps, 2, timeout_s=3)
    assert info.value.ranks == [1]
    assert child_pids() == before


def test_cluster_reuses_warm_ranks_and_survives_a_clean_failure():
    with dplab.Cluster(2) as c:
        pids = c.run(os.getpid)
        assert c.run(os.getpid) == pids  # the same processes: warm

        def raises_everywhere():
            raise KeyError(f"rank {dist.get_rank()}")

        with pytest.raises(dplab.RankError):
            c.run(raises_everywhere)
        assert c.alive  # every rank answered, so the pool is still good
        assert c.run(os.getpid) == pids


def test_cluster_whose_rank_died_says_so_and_restarts():
    before = child_pids()
    c = dplab.Cluster(2)
    try:

        def rank0_dies():
            if dist.get_rank() == 0:
                os._exit(3)
            dist.barrier()

        with pytest.raises(dplab.RankError):
            c.run(rank0_dies)
        assert not c.alive
        with pytest.raises(RuntimeError, match=r"stopped.*restart"):
            c.run(os.getpid)
        c.restart()
        assert c.run(_rank_and_sum, 0.0) == [(0, 2, 1.0), (1, 2, 1.0)]
    finally:
        c.close()
    assert child_pids() == before


def test_two_launches_at_once_do_not_collide():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(dplab.launch, _rank_and_sum, 2, args=(10.0,))
        b = pool.submit(dplab.launch, _rank_and_sum, 2, args=(20.0,))
        assert a.result() == [(0, 2, 21.0), (1, 2, 21.0)]
        assert b.result() == [(0, 2, 41.0), (1, 2, 41.0)]


def test_ranks_share_the_cores_and_gloo_stays_on_loopback(cluster2):
    def env():
        import torch

        return torch.get_num_threads(), os.environ["GLOO_SOCKET_IFNAME"], os.environ["MASTER_ADDR"]

    cores = len(os.sched_getaffinity(0))
    for threads, ifname, addr in cluster2.run(env):
        assert threads == max(1, cores // 2)
        assert ifname in ("lo", "lo0")
        assert addr == "127.0.0.1"


SCRIPT = textwrap.dedent(
    """
    import dplab
    import torch.distributed as dist

    def cell_function(x):  # defined in __main__, like a notebook cell
        return dist.get_rank() * x

    print(dplab.launch(cell_function, 2, args=(21,)))
    """
)


def test_function_defined_in_a_script_run_as_main(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)  # no __main__ guard needed: ranks never import the script
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 21]"


def test_function_defined_in_a_notebook_cell_runs_on_the_ranks():
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import dplab, torch.distributed as dist"),
        nbformat.v4.new_code_cell(
            "def in_a_cell(k):\n    return (dist.get_rank(), k * dist.get_world_size())"
        ),
        nbformat.v4.new_code_cell("print(dplab.launch(in_a_cell, 2, args=(3,)))"),
        nbformat.v4.new_code_cell(
            "def bad():\n    raise RuntimeError('cell boom')\n"
            "try:\n    dplab.launch(bad, 2)\nexcept dplab.RankError as e:\n"
            "    print('caught', e.rank, 'cell boom' in str(e))"
        ),
    ]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    assert nb.cells[2].outputs[0]["text"].strip() == "[(0, 6), (1, 6)]"
    assert nb.cells[3].outputs[-1]["text"].strip() in ("caught 0 True", "caught 1 True")


def test_inside_torchrun_the_call_runs_in_place(tmp_path):
    script = tmp_path / "under_torchrun.py"
    script.write_text(
        "import dplab, torch.distributed as dist\n"
        "def f():\n    return dist.get_rank() + 100\n"
        "out = dplab.launch(f, 2)\n"
        "open(f'rank{dist.get_rank()}.txt', 'w').write(repr(out))\n"
        "dist.destroy_process_group()\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):  # every rank gets every rank's result
        assert (tmp_path / f"rank{rank}.txt").read_text() == "[100, 101]"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_function_from_a_module_on_the_callers_path_runs(tmp_path, monkeypatch):
    (tmp_path / "next_to_the_notebook.py").write_text(
        "import torch.distributed as dist\n\ndef where():\n    return dist.get_rank() * 10\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import next_to_the_notebook

    assert dplab.launch(next_to_the_notebook.where, 2) == [0, 10]
