"""dplab.failures: each failure really happens on two gloo ranks, and each fix removes it.

One module-scoped pool runs every experiment (the hangs of §8e, which need fresh ranks, are in
tests/test_flight_recorder.py); each runs on its
own short-timeout group, so a failure that waits raises in seconds and the pool stays usable
(the last test checks it is). Bad arguments are refused before any rank waits.
"""

from __future__ import annotations

import time

import pytest

import dplab
from dplab.doctor import find_straggler
from dplab.failures import (
    PLACEMENTS,
    augmentations_seen,
    checkpointed_ddp,
    compiled_ddp,
    distributed_accuracy,
    epoch_orders,
    is_correct,
    no_sync_run,
    ragged_loss,
    rank0_evaluates,
    setup_errors,
    straggler_steps,
    two_forwards,
    uneven_with_join,
    uneven_without_join,
    unused_parameters,
)
from dplab.failures._common import MAX_WAIT_S, check_wait
from tests.conftest import child_pids


@pytest.fixture(scope="module")
def pool():
    with dplab.Cluster(2) as c:
        yield c


def test_unused_parameter_fails_on_the_next_step_named_and_find_unused_fixes_it(pool):
    bug = pool.run(unused_parameters, find_unused=False, debug="INFO")
    assert [r.failed_at_step for r in bug] == [1, 1]
    assert all("Expected to have finished reduction" in r.error for r in bug)
    assert all(r.named == ("skip.bias", "skip.weight") for r in bug)
    fixed = pool.run(unused_parameters, find_unused=True)
    assert all(r.error is None and r.steps_done == 3 for r in fixed)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_no_sync_placements(pool, placement):
    r = pool.run(no_sync_run, placement, steps=2, micro_batches=3)[0]
    expected_per_step = {"around_backward": 3}.get(placement, 1) * r.buckets
    assert r.allreduces_per_step == expected_per_step
    assert r.replicas_equal == (placement != "first_syncs"), r.digests


def test_ragged_lengths_need_the_global_token_count(pool):
    assert pool.run(ragged_loss, "per_rank_mean")[0].error > 0.1
    assert pool.run(ragged_loss, "global_count")[0].error < 1e-5
    # equal lengths: the per-rank mean is already the global one
    assert pool.run(ragged_loss, "per_rank_mean", tokens=(10, 10))[0].error < 1e-5


def test_uneven_inputs_are_caught_by_the_pool_and_join_fixes_them():
    before = child_pids()
    start = time.perf_counter()
    with pytest.raises(dplab.RankError, match="issued different collectives"):
        dplab.launch(uneven_without_join, 2, timeout_s=15)
    assert time.perf_counter() - start < 15
    assert child_pids() <= before, "no rank left behind"
    with dplab.Cluster(2) as c:
        joined = c.run(uneven_with_join, batches=3)
    assert [r.batches for r in joined] == [3, 2]
    assert all(r.replicas_equal for r in joined)


def test_rank0_only_work_times_out_and_sharing_it_does_not(pool):
    bug = pool.run(rank0_evaluates, sharded=False, batches=10, batch_s=0.1, group_timeout_s=0.5)
    assert "Timed out" in bug[1].error and bug[0].error
    shared = pool.run(rank0_evaluates, sharded=True, batches=4, batch_s=0.05, group_timeout_s=2.0)
    assert all(r.error is None for r in shared)


def test_the_straggler_is_the_rank_that_waits_least(pool):
    runs = pool.run(straggler_steps, slow_rank=0, delay_ms=40.0, steps=5)
    found = find_straggler(runs)
    assert found is not None and found.rank == 0
    assert 20.0 < found.behind_ms < 60.0, found  # the 40 ms sleep, ±50 % on busy cores


def test_batchnorm_two_forwards_and_what_forward_sync_buffers_changes(pool):
    synced = pool.run(two_forwards, forward_sync_buffers=True)
    own = pool.run(two_forwards, forward_sync_buffers=False)
    assert all(r.error is None for r in synced + own)  # torch 2.13 on CPU does not raise
    assert all(r.buffers_equal for r in synced) and not any(r.buffers_equal for r in own)


def test_sampler_without_set_epoch_repeats_and_padding_counts_twice(pool):
    forgot = epoch_orders(set_epoch=False)
    assert all(o == forgot[0] for o in forgot)
    assert len({tuple(o) for o in epoch_orders(set_epoch=True)}) == 3
    truth = sum(is_correct(i) for i in range(5)) / 5
    padded = pool.run(distributed_accuracy, exact=False)
    exact = pool.run(distributed_accuracy, exact=True)
    assert padded[0].seen == 6 and padded[0].accuracy != truth
    assert exact[0].seen == 5 and exact[0].accuracy == truth
    assert sorted(exact[0].indices + exact[1].indices) == list(range(5))


def test_compiled_ddp_overlaps_only_when_split(pool):
    split = pool.run(compiled_ddp, optimize_ddp=True, layers=3)[0]
    whole = pool.run(compiled_ddp, optimize_ddp=False, layers=3)[0]
    assert (split.graphs, whole.graphs) == (3, 1)
    assert split.launched_during_backward > 0 and whole.launched_during_backward == 0


def test_reentrant_checkpointing_is_marked_ready_twice_and_both_fixes_give_the_same_gradients(pool):
    bug = pool.run(checkpointed_ddp, "reentrant")
    assert all(r.error.startswith("Expected to mark a variable ready only once") for r in bug)
    assert all(r.steps_done == 0 and r.grad_diff is None for r in bug)
    for fix in ("non_reentrant", "reentrant_static_graph"):
        runs = pool.run(checkpointed_ddp, fix, steps=3)
        assert all(r.error is None and r.steps_done == 3 and r.grad_diff == 0.0 for r in runs), runs


def test_one_seed_on_every_rank_draws_the_same_augmentation_and_nothing_else_says_so(pool):
    same = pool.run(augmentations_seen, per_rank_seed=False, steps=2)
    own = pool.run(augmentations_seen, per_rank_seed=True, steps=2)
    assert same[0].flips == same[1].flips and same[0].same_on_every_rank
    assert own[0].flips != own[1].flips and not own[0].same_on_every_rank
    assert all(r.replicas_equal for r in same + own)


def test_setup_errors_in_torchs_words_and_the_prefix_fix(pool):
    r = pool.run(setup_errors)[0]
    assert "EADDRINUSE" in r.port_in_use
    assert r.saved_keys and all(k.startswith("module.") for k in r.saved_keys)
    assert "Unexpected key(s)" in r.load_error and "module." in r.load_error
    assert r.loaded_after_strip


def test_the_pool_survives_every_failure(pool):
    assert pool.alive
    assert pool.run(lambda: 1) == [1, 1]


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), MAX_WAIT_S + 1, True, "2"])
def test_a_wait_outside_the_bound_is_refused(bad):
    with pytest.raises(ValueError, match="group_timeout_s"):
        check_wait("group_timeout_s", bad)


def test_bad_names_are_refused_before_any_collective(pool):
    with pytest.raises(dplab.RankError, match="placement"):
        pool.run(no_sync_run, "inside_out")
    with pytest.raises(dplab.RankError, match="normalization"):
        pool.run(ragged_loss, "median")
    with pytest.raises(dplab.RankError, match="tokens"):
        pool.run(ragged_loss, "global_count", tokens=(3,))
    with pytest.raises(dplab.RankError, match="mode"):
        pool.run(checkpointed_ddp, "sometimes")
    assert pool.alive
