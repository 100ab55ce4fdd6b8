"""§3's claims on real ranks: the functions the notebook calls, with the facts it asserts.

Tolerances: float64 comparisons of weights or gradients use 1e-12; the only differences allowed
are the order of sums (measured ~1e-17, a fraction of an ulp of entries ~0.3). float32 gradients
must agree to 4 ulps of the largest entry (measured 0.5 ulp).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from dplab import mechanics as M
from dplab.collectives import ring_bytes_per_rank
from dplab.mechanics.lr_scaling import CountTask, train_counts
from dplab.viz import mechanics as V

# -- B_global = B_local × N × A --------------------------------------------------------------------


def test_batch_calculator():
    assert M.global_batch_size(32, 256, 1) == 8192
    assert M.global_batch_size(4, 2, 4) == 32
    assert M.local_batch_size(32, 4, 2) == 4
    rows = M.batch_table(32, world_sizes=(1, 2, 3), accums=(1, 4))
    assert {(r["world_size"], r["accum"]) for r in rows} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(M.global_batch_size(r["b_local"], r["world_size"], r["accum"]) == 32 for r in rows)
    assert "B_global" in M.format_batch_table(rows)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: M.local_batch_size(30, 4, 1), "does not split"),
        (lambda: M.global_batch_size(0, 2, 1), "b_local must be a positive int, got 0"),
        (lambda: M.global_batch_size(8, 2, True), "accum must be a positive int"),
        (lambda: M.local_batch_size(32, 2.0, 1), "world_size must be a positive int"),
    ],
)
def test_batch_calculator_refuses_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_shard_and_dtype_checks():
    t = torch.arange(12)
    assert M.shard(t, 1, 3).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="does not split evenly over world_size=5"):
        M.shard(t, 0, 5)
    with pytest.raises(ValueError, match="'float16'"):
        M.as_dtype("float16")


# -- 3.1 sharded gradients -------------------------------------------------------------------------


def test_sharded_average_equals_the_global_gradient(cluster2):
    exact = cluster2.run(M.sharded_vs_global, global_batch=64, dtype="float64")
    single = cluster2.run(M.sharded_vs_global, global_batch=64, dtype="float32")
    for runs in (exact, single):
        assert len({r["avg_hash"] for r in runs}) == 1
        assert runs[0]["shard_vs_global"] > 1e-3  # a shard alone is not the global gradient
        assert runs[0]["ulps_of_max"] <= 4
    assert exact[0]["max_abs_diff"] < 1e-15
    assert single[0]["max_abs_diff"] > 0


def test_one_process_is_world_size_one():
    r = M.sharded_vs_global(global_batch=8)
    assert (r["world_size"], r["max_abs_diff"], r["shard_vs_global"]) == (1, 0.0, 0.0)


# -- 3.2 / 3.3: replicas, traffic ------------------------------------------------------------------


def test_replicas_identical_with_ddp_and_drift_without(cluster2):
    synced = cluster2.run(M.train_run, steps=5, different_init=True, dtype="float32")
    drifting = cluster2.run(
        M.train_run, steps=5, different_init=True, synchronise=False, dtype="float32"
    )
    assert synced[0]["hashes"]["initial"] != synced[1]["hashes"]["initial"]
    assert len({r["hashes"]["after_construction"] for r in synced}) == 1
    assert len({r["hashes"]["final"] for r in synced}) == 1
    assert len({r["hashes"]["after_construction"] for r in drifting}) == 1
    assert len({r["hashes"]["final"] for r in drifting}) == 2


def test_only_gradients_move_after_construction(cluster2):
    for r in cluster2.run(M.train_run, steps=3, dtype="float32"):
        assert M.comm_in_phase(r, "construction", "broadcast") == {
            "calls": 1,
            "nbytes": r["param_bytes"],
        }
        for step in M.comm_per_step(r):
            assert step == {
                "step": step["step"],
                "calls": r["n_buckets"],
                "nbytes": r["grad_bytes"],
            }
            assert M.comm_in_phase(r, f"step {step['step']}")["nbytes"] == r["grad_bytes"]


def test_several_buckets_still_move_exactly_the_gradient_bytes(cluster2):
    r = cluster2.run(M.train_run, steps=2, dtype="float32", bucket_cap_mb=0.01)[0]
    assert r["n_buckets"] > 1
    assert M.comm_per_step(r)[0] == {"step": 1, "calls": r["n_buckets"], "nbytes": r["grad_bytes"]}


def _count_some_collectives():
    t = torch.ones(10, dtype=torch.float64)
    originals = (dist.all_reduce, c10d.all_reduce, c10d.all_gather)
    with M.CommCounter() as counter:
        with counter.phase("a"):
            dist.all_reduce(t)
            dist.broadcast(t[:4], src=0)
        objects = [None] * dist.get_world_size()
        dist.all_gather_object(objects, {"rank": dist.get_rank()})  # all_gather inside c10d
    restored = (dist.all_reduce, c10d.all_reduce, c10d.all_gather) == originals
    return {
        "a": M.comm_table([r for r in counter.to_dicts() if r["phase"] == "a"]),
        "gather_calls": counter.calls("all_gather", phase="-"),
        "restored": restored,
        "objects": objects,
    }


def test_comm_counter_counts_every_door_and_restores_them(cluster2):
    r = cluster2.run(_count_some_collectives)[0]
    assert r["a"] == [
        {"phase": "a", "op": "all_reduce", "calls": 1, "nbytes": 80},
        {"phase": "a", "op": "broadcast", "calls": 1, "nbytes": 32},
    ]
    assert r["gather_calls"] == 2  # all_gather_object: sizes, then the pickled objects
    assert r["restored"]
    assert r["objects"] == [{"rank": 0}, {"rank": 1}]


def test_comm_counter_refuses_to_wrap_itself():
    original = dist.all_reduce
    counter = M.CommCounter()
    with counter, pytest.raises(RuntimeError, match="already counting"):
        counter.__enter__()
    assert dist.all_reduce is original is c10d.all_reduce


# -- 3.4 / 3.5: batch equivalence, accumulation and its bugs ---------------------------------------


def test_same_global_batch_same_weights(cluster2):
    reference = M.train_run(global_batch=32, accum=4)  # this process: world size 1
    for accum in (1, 2):
        r = cluster2.run(M.train_run, global_batch=32, accum=accum)[0]
        assert M.max_abs_diff(r["params"], reference["params"]) < 1e-12
    other = cluster2.run(M.train_run, global_batch=16, accum=1)[0]
    assert M.max_abs_diff(other["params"], reference["params"]) > 1e-4


def test_accumulation_and_its_two_bugs(cluster2):
    a = 4
    big = cluster2.run(M.train_run, global_batch=32, accum=1)[0]
    right = cluster2.run(M.train_run, global_batch=32, accum=a)[0]
    no_sync_bug = cluster2.run(M.train_run, global_batch=32, accum=a, no_sync=False)[0]
    scale_bug = cluster2.run(M.train_run, global_batch=32, accum=a, scale_loss=False)[0]
    b = right["n_buckets"]
    assert [s["calls"] for s in M.comm_per_step(right)] == [b] * 3
    assert [s["calls"] for s in M.comm_per_step(no_sync_bug)] == [a * b] * 3
    for r in (right, no_sync_bug):
        assert M.max_abs_diff(r["params"], big["params"]) < 1e-12
    ratio = (scale_bug["first_grad"].norm() / big["first_grad"].norm()).item()
    assert math.isclose(ratio, a, rel_tol=1e-9)
    assert M.max_abs_diff(scale_bug["params"], big["params"]) > 1e-3


def test_train_run_refuses_uneven_batches():
    with pytest.raises(ValueError, match="B_global=30"):
        M.train_run(global_batch=30, accum=4)


# -- activation memory -----------------------------------------------------------------------------


def test_saved_tensor_meter_counts_storages_not_parameters():
    w = nn.Parameter(torch.ones(1000))
    x = torch.randn(1000)
    with M.SavedTensorMeter(exclude=[w]) as meter:
        loss = (x * w).sum()  # mul saves both operands; w is model state
        assert meter.current == x.untyped_storage().nbytes() == 4000
        loss.backward()
    assert (meter.peak, meter.current) == (4000, 0)
    h = torch.randn(500)
    with M.SavedTensorMeter() as meter:
        a = nn.Parameter(torch.ones(500))
        loss = (torch.tanh(h * a) * a).sum()  # tanh's output is saved once, by two users
        loss.backward()
    assert meter.peak == 4 * 500 * 3  # h, tanh(h*a), a — each storage counted once


def test_activation_memory_is_set_by_the_micro_batch():
    rows = M.activation_memory(local_batch=64, accums=(1, 2, 4))
    assert len({r["peak_bytes"] / r["micro_batch"] for r in rows}) == 1
    assert rows[0]["peak_bytes"] == 4 * rows[2]["peak_bytes"]
    assert all(r["left_bytes"] == 0 for r in rows)
    with pytest.raises(ValueError, match="does not split"):
        M.activation_memory(local_batch=64, accums=(3,))


def test_activation_memory_on_a_transformer():
    rows = M.activation_memory(model="tiny-gpt", local_batch=4, accums=(1, 4))
    # Not exactly linear (a few saved tensors do not scale with the batch), but nearly.
    assert rows[0]["peak_bytes"] / rows[1]["peak_bytes"] == pytest.approx(4, rel=0.01)


# -- 3.6 linear LR scaling -------------------------------------------------------------------------


def test_warmup_schedule():
    assert [M.warmup_lr(s, 8.0, 4) for s in range(6)] == [2.0, 4.0, 6.0, 8.0, 8.0, 8.0]
    assert M.warmup_lr(0, 8.0, 0) == 8.0


def test_the_start_is_steep():
    rates = M.rates_at_start(seed=3)
    assert rates["predicted_at_init"] > 10 * rates["true"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch": 0, "lr": 0.1}, "batch must be a positive int"),
        ({"batch": 64, "lr": -1.0}, "lr must be > 0"),
        ({"batch": 64, "lr": 0.1, "warmup_epochs": -1}, "warmup_epochs must be >= 0"),
        ({"batch": 32768, "lr": 0.1}, "fewer than evals_per_epoch"),
    ],
)
def test_train_counts_refuses_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        train_counts(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_linear_scaling_facts_hold_on_other_seeds(seed):
    """The notebook asserts these on seed 0 on two ranks; here one process (proven equal to the
    ranks below) on two more seeds. Measured on seeds 0-9: same-η lag 2.9-6.4×, divergence at
    steps 4-11, warm-up within 1.11-1.27× of the small batch."""
    setup = M.ScalingSetup()
    runs = M.lr_scaling_runs(None, setup, seed=seed)
    summary = M.scaling_summary(runs)
    small, same_lr, scaled, warm = (summary[label] for label in setup.configs())
    assert same_lr["last_epoch_mean"] >= 2 * small["last_epoch_mean"]
    assert scaled["diverged_at_step"] is not None and scaled["diverged_at_epoch"] < 1
    assert warm["diverged_at_step"] is None
    assert warm["last_epoch_mean"] <= 1.5 * small["last_epoch_mean"]
    assert warm["epochs_to_target"] < same_lr["epochs_to_target"]
    assert warm["epochs_to_target"] > small["epochs_to_target"]
    runs_after = {k: M.mean_loss_in(v, setup.warmup_epochs, setup.epochs) for k, v in runs.items()}
    assert runs_after["kB, kη + warm-up"] <= 1.5 * runs_after["B, η"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3])
def test_only_the_linear_factor_tracks_the_small_batch_on_other_seeds(seed):
    """03b asserts this on seed 0 on two ranks. Measured in one process on seeds 0-3: k
    -0.08 to -0.16, k/2 +0.81 to +1.00, √k +2.3 to +2.7, 2k -0.81 to -1.03 (2 epochs)."""
    gap = M.factor_runs(None, M.FactorSetup(), seed=seed)["gap"]
    assert abs(gap["k"]) <= 0.3
    assert gap["k/2"] >= 0.5 and gap["√k"] >= 0.5
    assert gap["2k"] <= -0.5


def test_log_gap_is_zero_for_the_same_curve_and_nan_for_a_diverged_run():
    run = {"epochs": [0.0, 0.5, 1.0], "excess_loss": [1.0, 0.2, 0.1], "diverged_at_step": None}
    behind = dict(run, excess_loss=[1.0, 0.4, 0.2])
    assert M.log_gap(run, run) == 0.0
    assert M.log_gap(behind, run) == pytest.approx(math.log(2))
    assert math.isnan(M.log_gap(dict(run, diverged_at_step=3), run))


def test_two_ranks_train_the_count_task_like_one_process(cluster2):
    kwargs = {"batch": 2048, "lr": 0.24, "epochs": 1, "seed": 5}
    ranks = cluster2.run(train_counts, **kwargs)
    alone = train_counts(**kwargs)
    assert ranks[0]["excess_loss"] == ranks[1]["excess_loss"]
    assert ranks[0]["local_batch"] == 1024
    for a, b in zip(ranks[0]["excess_loss"], alone["excess_loss"], strict=True):
        assert a == pytest.approx(b, rel=1e-4)


def test_a_diverged_run_stops_on_every_rank_at_the_same_step(cluster2):
    ranks = cluster2.run(train_counts, batch=2048, lr=7.68, epochs=2, seed=0)
    assert ranks[0]["diverged_at_step"] == ranks[1]["diverged_at_step"] is not None
    assert math.isnan(ranks[0]["excess_loss"][-1])
    summary = M.scaling_summary({"x": ranks[0]})["x"]
    assert summary["epochs_to_target"] is None or summary["epochs_to_target"] < 1
    assert math.isnan(summary["last_epoch_mean"])


def test_count_task_is_reproducible():
    a = M.lr_scaling.count_data(CountTask(n_samples=64), seed=1)
    b = M.lr_scaling.count_data(CountTask(n_samples=64), seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- 3.7 the all-reduce ----------------------------------------------------------------------------


def test_all_reduce_demo_sums_and_counts_the_ring_bytes(cluster2):
    demo = cluster2.run(M.all_reduce_demo, 6)
    expected = [sum(col) for col in zip(*(r["input"] for r in demo), strict=True)]
    for r in demo:
        assert r["all_reduce"] == r["ring"] == expected
        assert r["ring_messages"] == 2
        assert r["ring_sent_bytes"] == r["counted_isend_bytes"] == ring_bytes_per_rank(24, 2)


# -- figures ---------------------------------------------------------------------------------------


def test_figures_build_and_refuse_empty_input(cluster2):
    r = cluster2.run(M.train_run, steps=2, dtype="float32")[0]
    fig = V.traffic_figure(r)
    assert {t.name for t in fig.data} == {"all_gather", "broadcast", "all_reduce"}
    with pytest.raises(ValueError, match="no collective calls"):
        V.traffic_figure(M.train_run(steps=1))
    rows = M.activation_memory(local_batch=16, accums=(1, 2))
    assert len(V.activation_memory_figure(rows).data[0].y) == 2
    with pytest.raises(ValueError, match="no rows"):
        V.activation_memory_figure([])
    run = train_counts(batch=2048, lr=7.68, epochs=1, seed=0)
    fig = V.loss_curves_figure({"kB, kη": run}, target=0.01)
    assert any("diverged at step" in str(t.text) for t in fig.data)
    with pytest.raises(ValueError, match="no runs"):
        V.loss_curves_figure({})


# -- where DP sits in 3D parallelism ------------------------------------------------------------


def test_3d_layout_keeps_tp_on_a_node_and_puts_dp_replicas_apart():
    from dplab.mechanics.parallel3d import Layout3D

    job = Layout3D(tp=4, pp=4, dp=2, gpus_per_node=8)
    assert job.world_size == 32 and job.nodes == 4
    assert all(job.rank(**job.coords(r)) == r for r in range(job.world_size))
    assert sorted(r for g in job.groups("dp") for r in g) == list(range(32))
    assert job.groups("tp")[0] == [0, 1, 2, 3] and job.groups("dp")[0] == [0, 16]
    assert job.nodes_spanned("tp") == 1 and job.nodes_spanned("dp") == 2
    # TP: 4 per layer of the stage (32 / 4 = 8) and micro-batch; a middle stage: 2 boundaries
    assert job.syncs_per_step(layers=32, micro_batches=8) == {"tp": 256, "pp": 32, "dp": 1}
    assert Layout3D(1, 2, 1).syncs_per_step(4, 3) == {"tp": 0, "pp": 6, "dp": 0}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 3, "pp": 1, "dp": 1}, "tp=3 must divide gpus_per_node=8"),
        ({"tp": 0, "pp": 1, "dp": 1}, "tp must be a positive int, got 0"),
        ({"tp": 2, "pp": 1, "dp": 1.5}, "dp must be a positive int, got 1.5"),
    ],
)
def test_3d_layout_refuses_bad_shapes(kwargs, message):
    from dplab.mechanics.parallel3d import Layout3D

    with pytest.raises(ValueError, match=re.escape(message)):
        Layout3D(**kwargs)


def test_3d_layout_refuses_bad_questions():
    from dplab.mechanics.parallel3d import Layout3D

    job = Layout3D(2, 2, 2)
    with pytest.raises(ValueError, match=re.escape("axis must be one of ('tp', 'pp', 'dp')")):
        job.groups("ep")
    with pytest.raises(ValueError, match=re.escape("rank must be in [0, 8), got 8")):
        job.coords(8)
    with pytest.raises(ValueError, match=re.escape("pp=2 stages must split layers=3 evenly")):
        job.syncs_per_step(3, 1)


# -- torch's DDP divides before the all-reduce (03 §3.3 says so) --------------------------------


def _torch_ddp_reducer_events() -> list[str]:
    """Rank function: the reducer's and the all-reduce's profiler events of one torch DDP step,
    in the order they started (the second step: the first one rebuilds the buckets)."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1)))
    x = torch.randn(8, 64)
    ddp(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ddp(x).sum().backward()
    events = sorted((e.time_range.start, e.name) for e in prof.events())
    return [name for _, name in events if "reducer" in name or name == "c10d::allreduce_"]


def test_torchs_reducer_scales_each_gradient_before_the_all_reduce(cluster2):
    """reducer.cpp, ``Reducer::mark_variable_ready_dense``: ``mul_out(bucket_view, grad, 1/N)``,
    recorded as ``torch::distributed::reducer::mul_out``, then the bucket's all-reduce: the sum
    the all-reduce returns is already the average. Checked on the installed torch, not its text."""
    for events in cluster2.run(_torch_ddp_reducer_events):
        scaled = [i for i, name in enumerate(events) if name.endswith("reducer::mul_out")]
        reduced = events.index("c10d::allreduce_")
        assert len(scaled) == 4, events  # one per parameter: two weights, two biases
        assert max(scaled) < reduced, events


# -- 00: a cell's function in a spawned process, and the course map -----------------------------


def _exits_cleanly() -> None:
    """Importable by name (a module-level function), so a spawned child finds it."""


def _sleeps() -> None:
    import time

    time.sleep(600)


def test_a_spawned_child_runs_an_importable_function():
    run = M.run_spawned(_exits_cleanly)
    assert run.exit_code == 0, run.stderr


def test_a_spawned_child_cannot_find_a_function_of_the_parents_main():
    import sys

    def whoami() -> None:
        pass

    main = sys.modules["__main__"]
    whoami.__module__, whoami.__qualname__ = "__main__", "dplab_test_whoami"
    main.dplab_test_whoami = whoami  # pickle, by reference, finds it here, in the parent only
    try:
        run = M.run_spawned(whoami)
    finally:
        del main.dplab_test_whoami
    assert run.exit_code != 0
    assert "Can't get attribute 'dplab_test_whoami' on <module '__main__'" in run.stderr
    assert run.last_line.startswith("AttributeError"), run.last_line


def test_a_spawned_child_past_its_time_is_killed():
    run = M.run_spawned(_sleeps, timeout_s=1.0)
    assert run.exit_code is not None and run.exit_code < 0  # killed by a signal, not hung


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: M.run_spawned(_exits_cleanly, timeout_s=0), ValueError, "timeout_s must be > 0"),
        (lambda: M.run_spawned("whoami"), TypeError, "needs a function, got 'whoami'"),
    ],
)
def test_run_spawned_refuses_bad_input(call, error, match):
    with pytest.raises(error, match=re.escape(match)):
        call()


def _notebook(path, *markdown: str) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(m) for m in markdown]
    nb.cells.insert(1, nbformat.v4.new_code_cell("print('[not](a_link.ipynb)')"))
    nbformat.write(nb, path)


def test_the_map_reads_links_in_order_and_the_folder_in_path_order(tmp_path):
    for name in ("03_a.ipynb", "03b_b.ipynb", "08_c.ipynb", "00_start_here.ipynb", "notes.ipynb"):
        _notebook(tmp_path / name, "x")
    start = tmp_path / "00_start_here.ipynb"
    _notebook(start, "| [A](03_a.ipynb) | [C](08_c.ipynb) |", "[B](03b_b.ipynb) [A](03_a.ipynb)")
    assert M.map_links(start) == ["03_a.ipynb", "08_c.ipynb", "03b_b.ipynb"]  # code cells skipped
    assert M.last_link(start) == "03_a.ipynb"
    assert M.lessons_in(tmp_path) == ["03_a.ipynb", "03b_b.ipynb", "08_c.ipynb"]


@pytest.mark.parametrize(
    "text",
    [None, "not json", "[1, 2]", '{"seconds": 3}', '{"seconds": {"03_a.ipynb": "slow"}}'],
)
def test_missing_or_partial_times_read_as_not_measured(tmp_path, text):
    path = tmp_path / "times.json"
    if text is not None:
        path.write_text(text)
    times = M.recorded_times(path)
    assert times.describe("03_a.ipynb") == "not measured yet"
    assert times.recorded == {}


def test_recorded_times_are_read_with_how_they_were_recorded(tmp_path):
    path = tmp_path / "times.json"
    path.write_text('{"recorded": {"cores": 2}, "seconds": {"03_a.ipynb": 18.7, "x": true}}')
    times = M.recorded_times(path)
    assert times.describe("03_a.ipynb") == "  19 s"
    assert times.describe("x") == "not measured yet"  # a bool is not a time
    assert times.recorded == {"cores": 2}
