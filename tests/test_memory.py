"""§9 the memory wall: the accounting reproduces published figures, and real tensors agree."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import dplab
from dplab.memory import (
    GB,
    GPUS,
    LLM_SHAPES,
    bytes_per_param,
    fits,
    gpt_activation_bytes,
    gpt_block_activation_bytes,
    min_world_size,
    model_state_bytes,
    state_bytes,
)
from dplab.memory.gpt import lm_loss, measured_gpt, random_batch
from dplab.memory.measure import (
    block_saved_bytes,
    layernorm_stats_bytes,
    make_recipe,
    measure_recipe,
    model_saved_bytes,
)
from dplab.memory.mixed import MixedPrecisionOptimizer

# ---------------------------------------------------------------------------------------------
# Bytes per parameter

EXPECTED_BYTES_PER_PARAM = {
    # (precision, optimizer): total, from the recipe's definition (weights + grads + master + opt)
    ("fp32", "sgd"): 8,
    ("fp32", "momentum"): 12,
    ("fp32", "adam"): 16,
    ("mixed", "sgd"): 8,
    ("mixed", "momentum"): 12,
    ("mixed", "adam"): 16,
    ("mixed_fp32_grads", "sgd"): 12,
    ("mixed_fp32_grads", "momentum"): 16,
    ("mixed_fp32_grads", "adam"): 20,
    ("bf16", "sgd"): 4,
    ("bf16", "momentum"): 6,
    ("bf16", "adam"): 8,
}


@pytest.mark.parametrize(("recipe", "total"), EXPECTED_BYTES_PER_PARAM.items())
def test_bytes_per_param_table(recipe, total):
    assert bytes_per_param(*recipe).total == total


def test_mixed_adam_is_the_zero_papers_2_2_12():
    b = bytes_per_param("mixed", "adamw")
    assert (b.weights, b.grads, b.optimizer_side) == (2, 2, 12)
    assert b.master_weights == 4 and b.optimizer_state == 8


# ---------------------------------------------------------------------------------------------
# Published figures


@pytest.mark.parametrize(("stage", "published_gb"), [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_figure_1(stage, published_gb):
    """ZeRO (Rajbhandari et al. 2020) Figure 1: Ψ = 7.5B, N = 64, K = 12."""
    got = model_state_bytes(7.5e9, world_size=64, zero_stage=stage) / GB
    assert round(got, 1) == published_gb


def test_zero_figure_1_exact_terms():
    psi, n = 7.5e9, 64
    exact = [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n]
    for stage, want in enumerate(exact):
        assert model_state_bytes(psi, world_size=n, zero_stage=stage) == want


@pytest.mark.parametrize(
    ("billions", "gb", "gb_fp32_accum"),
    [(1, 16, 20), (7, 112, 140), (70, 1120, 1400), (405, 6480, 8100)],
)
def test_ultrascale_playbook_table(billions, gb, gb_fp32_accum):
    """The Ultra-Scale Playbook's model-state table (decimal GB)."""
    n = billions * 10**9
    assert model_state_bytes(n) / GB == gb
    assert model_state_bytes(n, precision="fp32") / GB == gb  # fp32 Adam is 16 B too
    assert model_state_bytes(n, precision="mixed_fp32_grads") / GB == gb_fp32_accum


def test_the_wall_7b_does_not_fit_an_h100_at_any_dp_size():
    h100 = GPUS["h100-80gb"]
    for world in (1, 2, 8, 64, 1024):
        assert model_state_bytes(7e9, world_size=world) == 112 * GB > h100.capacity_bytes
    assert min_world_size(7e9, h100.capacity_bytes) is None
    assert min_world_size(7e9, h100.capacity_bytes, zero_stage=3) == 2


def test_dp_per_rank_is_flat_and_each_zero_stage_falls():
    n = 10**9
    for stage in (1, 2, 3):
        per_rank = [model_state_bytes(n, world_size=w, zero_stage=stage) for w in (1, 2, 4, 8)]
        assert per_rank[0] == model_state_bytes(n)  # one rank: nothing to shard
        assert all(a > b for a, b in itertools.pairwise(per_rank))
    assert model_state_bytes(n, world_size=n, zero_stage=3) == 16  # one parameter per rank


def test_sharding_rounds_up_a_ragged_shard():
    s = state_bytes(10, world_size=4, zero_stage=3)
    assert s.weights == 3 * 2  # ⌈10/4⌉ = 3 parameters per rank


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_params": 0}, "n_params"),
        ({"n_params": -5}, "n_params"),
        ({"n_params": 1.5}, "n_params"),
        ({"n_params": float("nan")}, "n_params"),
        ({"n_params": True}, "n_params"),
        ({"n_params": "7e9"}, "n_params"),
        ({"n_params": 10, "world_size": 0}, "world_size.*0"),
        ({"n_params": 10, "world_size": 2.0}, "world_size"),
        ({"n_params": 10, "zero_stage": 4}, "zero_stage.*4"),
        ({"n_params": 10, "precision": "fp8"}, "precision.*fp8"),
        ({"n_params": 10, "optimizer": "lion"}, "optimizer.*lion"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs, match):
    n = kwargs.pop("n_params")
    with pytest.raises(ValueError, match=match):
        model_state_bytes(n, **kwargs)


# ---------------------------------------------------------------------------------------------
# Presets: counts computed from the configs equal the published counts

PUBLISHED_COUNTS = {
    "gpt2-124m": 124_439_808,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize(("key", "count"), PUBLISHED_COUNTS.items())
def test_preset_counts_match_the_published_counts(key, count):
    assert LLM_SHAPES[key].n_params == count


@pytest.mark.parametrize(
    ("key", "rounded"),
    [
        ("gpt2-124m", "124M"),
        ("llama2-7b", "6.74B"),
        ("llama2-13b", "13.0B"),
        ("llama2-70b", "69.0B"),
        ("llama3-8b", "8.03B"),
        ("llama3-70b", "70.6B"),
        ("llama3-405b", "406B"),
    ],
)
def test_preset_counts_round_to_their_names(key, rounded):
    n = LLM_SHAPES[key].n_params
    text = f"{n / 1e6:.0f}M" if n < 1e9 else f"{n / 1e9:#.3g}".rstrip(".") + "B"
    assert text == rounded


def test_gpu_capacities_are_nominal_gib():
    assert GPUS["h100-80gb"].capacity_bytes == 80 * 2**30
    assert GPUS["h200-141gb"].capacity_bytes == 141 * 2**30
    assert {g.memory_gib for g in GPUS.values()} == {40, 80, 141, 192}


# ---------------------------------------------------------------------------------------------
# Activations (Korthikanti et al. 2022)


@pytest.mark.parametrize(
    ("s", "b", "h", "a"), [(2048, 1, 12288, 96), (4096, 4, 4096, 32), (1024, 8, 768, 12)]
)
def test_korthikanti_formula(s, b, h, a):
    per_layer = gpt_block_activation_bytes(s, b, h, a)
    assert per_layer == s * b * h * 34 + 5 * a * s * s * b  # = s·b·h·(34 + 5as/h)
    assert math.isclose(per_layer, s * b * h * (34 + 5 * a * s / h))
    assert gpt_block_activation_bytes(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert gpt_block_activation_bytes(s, b, h, a, recompute="full") == 2 * s * b * h
    assert gpt_activation_bytes(s, b, h, a, 10) == 10 * per_layer


def test_activations_are_proportional_to_the_micro_batch():
    one = gpt_block_activation_bytes(2048, 1, 4096, 32)
    assert gpt_block_activation_bytes(2048, 4, 4096, 32) == 4 * one


@pytest.mark.parametrize("bad", [0, -1, 2.5, None])
def test_bad_activation_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="micro_batch"):
        gpt_block_activation_bytes(128, bad, 64, 4)
    with pytest.raises(ValueError, match="recompute"):
        gpt_block_activation_bytes(128, 1, 64, 4, recompute="some")
    with pytest.raises(ValueError, match="multiple of heads"):
        gpt_block_activation_bytes(128, 1, 64, 5)


@pytest.mark.parametrize(("s", "b"), [(32, 2), (64, 1), (16, 8)])
def test_measured_block_activations_equal_the_formula_in_bf16(s, b):
    """A real block's saved tensors, bf16 on the CPU: exactly 34·sbh + 5·as²b, plus the
    LayerNorm statistics the paper leaves out (bf16 here)."""
    saved = block_saved_bytes(s, b, hidden=64, heads=4, dtype=torch.bfloat16)
    formula = gpt_block_activation_bytes(s, b, 64, 4)
    assert saved.nbytes == formula + layernorm_stats_bytes(s, b, 2)
    assert set(saved.by_dtype) == {"bfloat16", "bool"}  # masks are 1 byte, as in the paper


def test_measured_block_activations_in_fp32_use_4_byte_elements():
    s, b = 32, 2
    saved = block_saved_bytes(s, b, hidden=64, heads=4, dtype=torch.float32)
    formula = gpt_block_activation_bytes(s, b, 64, 4, act_bytes=4, mask_bytes=1)
    assert saved.nbytes == formula + layernorm_stats_bytes(s, b, 4)


def _saved_by_one_block(s, b, attention, dtype, h=64, a=4):
    """A measured-GPT block without dropout, with the given attention; what autograd saves."""
    import dataclasses

    from dplab.memory.gpt import MEASURED_GPT
    from dplab.memory.measure import SavedTensors
    from dplab.models import Block

    torch.manual_seed(0)
    cfg = dataclasses.replace(
        MEASURED_GPT, d_model=h, n_heads=a, seq_len=s, attention=attention, p_drop=0.0
    )
    block = Block(cfg).to(dtype=dtype).train()
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    with SavedTensors(block) as saved:
        block(x)
    return saved


@pytest.mark.parametrize(("s", "b"), [(32, 2), (64, 1), (16, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_measured_block_without_dropout_equals_the_formula(s, b, dtype, attention):
    """No dropout, as in dplab's DDP models: the explicit block keeps one a·s²·b tensor (the
    softmax output); SDPA keeps none, only its fp32 log-sum-exp (a·s·b·4 bytes)."""
    saved = _saved_by_one_block(s, b, attention, dtype)
    act = torch.tensor([], dtype=dtype).element_size()
    formula = gpt_block_activation_bytes(
        s, b, 64, 4, act_bytes=act, attention=attention, dropout=False
    )
    assert saved.nbytes == formula + layernorm_stats_bytes(s, b, act)
    assert "bool" not in saved.by_dtype  # no dropout, no masks


def test_sdpa_drops_the_quadratic_term():
    s, b, h, a = 2048, 1, 4096, 32
    explicit = gpt_block_activation_bytes(s, b, h, a, dropout=False)
    sdpa = gpt_block_activation_bytes(s, b, h, a, attention="sdpa", dropout=False)
    assert explicit - sdpa == 2 * a * s * s * b - 4 * a * s * b
    assert sdpa == 32 * s * b * h + 4 * a * s * b
    # The sdpa block is linear in s; the explicit one is not.
    assert gpt_block_activation_bytes(2 * s, b, h, a, attention="sdpa", dropout=False) == 2 * sdpa


def test_sdpa_with_dropout_and_bad_attention_are_refused():
    with pytest.raises(ValueError, match="not modelled"):
        gpt_block_activation_bytes(128, 1, 64, 4, attention="sdpa")
    with pytest.raises(ValueError, match="attention"):
        gpt_block_activation_bytes(128, 1, 64, 4, attention="flash")
    with pytest.raises(ValueError, match="dropout"):
        gpt_block_activation_bytes(128, 1, 64, 4, dropout=0)


def test_accumulation_lowers_activation_memory_and_keeps_the_gradient():
    torch.manual_seed(0)
    model = measured_gpt(p_drop=0.0)
    big = model_saved_bytes(model, 8, 32).nbytes
    small = model_saved_bytes(model, 2, 32).nbytes
    assert big / small == pytest.approx(4, rel=0.01)

    x, y = random_batch(model.vocab, 8, 32, seed=1)
    model.zero_grad()
    lm_loss(model, x, y).backward()
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for i in range(4):
        (lm_loss(model, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]) / 4).backward()
    for g_full, p in zip(full, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g_full, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Model state measured on real tensors


def test_measured_mixed_precision_adamw_holds_16_bytes_per_param():
    m = measure_recipe("mixed", "adam")
    assert m.bytes_per_param == pytest.approx(16, rel=0.01)
    n = m.n_params
    assert m.parts["weights"] == 2 * n and m.parts["grads"] == 2 * n
    assert m.parts["master_weights"] == 4 * n and m.parts["optimizer_state"] == 8 * n


@pytest.mark.parametrize(("recipe", "total"), EXPECTED_BYTES_PER_PARAM.items())
def test_every_recipe_measures_its_table_value(recipe, total):
    m = measure_recipe(*recipe, model_kwargs={"n_layers": 2})
    assert m.bytes_per_param == pytest.approx(total, rel=0.01)
    assert m.bytes_per_param == pytest.approx(bytes_per_param(*recipe).total, rel=0.01)


@pytest.mark.parametrize("optimizer", ["adam", "momentum", "sgd"])
def test_mixed_precision_optimizer_matches_torch(optimizer):
    """On fp32 parameters the master copy is exact: the update must be torch's, step for step."""
    torch.manual_seed(0)
    a = measured_gpt(n_layers=1, p_drop=0.0)
    b = measured_gpt(n_layers=1, p_drop=0.0)
    b.load_state_dict(a.state_dict())
    ours = MixedPrecisionOptimizer(a.parameters(), optimizer=optimizer, lr=1e-2)
    if optimizer == "adam":
        ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.01)
    else:
        ref = torch.optim.SGD(b.parameters(), lr=1e-2, momentum=0.9 if optimizer != "sgd" else 0)
    for step in range(3):
        x, y = random_batch(a.vocab, 2, 16, seed=step)
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            lm_loss(model, x, y).backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_fp32_grad_accumulation_keeps_main_grads_and_20_bytes():
    torch.manual_seed(0)
    model, opt = make_recipe(measured_gpt(n_layers=1), "mixed_fp32_grads", "adam")
    assert opt.main_grads is not None and opt.main_grads[0].dtype == torch.float32
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        MixedPrecisionOptimizer(model.parameters(), grad_accum_dtype=torch.float16)


# ---------------------------------------------------------------------------------------------
# fits() and its verdict


def test_fits_verdict_for_the_seed_example():
    fit = fits(7e9, "h100-80gb")
    assert not fit.fits
    assert fit.state.total == 112 * GB
    assert fit.reason.startswith("7.00 B params × 16 B = 112 GB > 85.9 GB")
    assert "does not fit on an H100 at any data-parallel size" in fit.reason


def test_fits_llama2_7b_with_zero3_over_8():
    fit = fits("llama2-7b", "h100-80gb", zero_stage=3, world_size=8)
    assert fit.fits
    assert fit.state.total == math.ceil(LLM_SHAPES["llama2-7b"].n_params / 8) * 16
    assert "With ZeRO-3 over 8 ranks" in fit.reason and "fits" in fit.reason


def test_fits_names_the_world_size_needed():
    fit = fits("llama3-405b", "h100-80gb", zero_stage=3, world_size=8, recompute="full")
    assert not fit.fits and fit.min_world_size is not None
    assert f"needs at least {fit.min_world_size:,} ranks" in fit.reason
    at_min = fits(
        "llama3-405b", "h100-80gb", zero_stage=3, world_size=fit.min_world_size, recompute="full"
    )
    below = fits(
        "llama3-405b",
        "h100-80gb",
        zero_stage=3,
        world_size=fit.min_world_size - 1,
        recompute="full",
    )
    assert at_min.fits and not below.fits


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [10**6, 7 * 10**9, 123_456_789_012])
def test_min_world_size_is_the_first_that_fits(stage, n):
    cap = GPUS["a100-40gb"].capacity_bytes
    act = 3 * GB
    got = min_world_size(n, cap, activations=act, zero_stage=stage)

    def ok(w):
        return state_bytes(n, world_size=w, zero_stage=stage).total + act <= cap

    if got is None:
        assert not ok(10**7)
    else:
        assert ok(got) and (got == 1 or not ok(got - 1))


def test_fits_refuses_bad_values():
    with pytest.raises(ValueError, match="gpu"):
        fits("llama2-7b", "tpu-v5")
    with pytest.raises(ValueError, match="model"):
        fits("llama9-1t", "h100-80gb")
    with pytest.raises(ValueError, match="seq_len"):
        fits("llama2-7b", "h100-80gb", seq_len=0)


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_memory(capsys):
    from dplab.cli import main

    assert main(["memory", "--model", "llama2-7b", "--gpu", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616 parameters" in out
    assert "does not fit on an H100 at any data-parallel size" in out
    args = ["memory", "--model", "llama2-7b", "--gpu", "h100-80gb"]
    assert main([*args, "--zero-stage", "1", "--world-size", "64"]) == 0
    assert "With ZeRO-1 over 64 ranks" in capsys.readouterr().out
    assert main(["memory", "--world-size", "0"]) == 2
    assert "world_size must be a positive int, got 0" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Real ranks: per-rank state does not depend on the world size


@pytest.mark.slow
def test_per_rank_state_is_the_same_at_world_sizes_1_2_4():
    from dplab.memory.ranks import rank_state

    with dplab.Cluster(4, backend="gloo") as c:
        runs = {w: [r for r in c.run(rank_state, group_size=w) if r] for w in (1, 2, 4)}
        views = [r for r in c.run(rank_state, group_size=2, gradient_as_bucket_view=True) if r]
        ours = [
            r
            for r in c.run(rank_state, group_size=2, ddp="dplab", gradient_as_bucket_view=True)
            if r
        ]
        zero1 = {
            w: [r for r in c.run(rank_state, "fp32", zero1=True, group_size=w) if r] for w in (1, 4)
        }
    one = runs[1][0]
    assert one["bytes_per_param"] == pytest.approx(16, rel=0.01)
    for w, results in runs.items():
        assert [r["world_size"] for r in results] == [w] * w
        assert {r["state_bytes"] for r in results} == {one["state_bytes"]}
        # torch DDP's buckets: a second copy of every (bf16) gradient, outside the model state
        assert all(r["bucket_extra_bytes"] == r["parts"]["grads"] for r in results)
    # gradient_as_bucket_view=True: the grads *are* the buckets, nothing extra
    assert all(r["bucket_bytes"] == r["parts"]["grads"] for r in views)
    assert all(r["bucket_extra_bytes"] == 0 for r in views)
    # dplab.DDP keeps its gradients in its buckets too, and holds the same 16 B/param
    assert all(r["bucket_extra_bytes"] == 0 and r["buckets"] >= 1 for r in ours)
    assert all(r["bucket_bytes"] == r["parts"]["grads"] for r in ours)
    assert {r["state_bytes"] for r in ours} == {one["state_bytes"]}
    # ZeRO-1 (torch's ZeroRedundancyOptimizer): optimizer state per rank falls about as 1/N
    whole = zero1[1][0]["parts"]["optimizer_state"]
    shards = [r["parts"]["optimizer_state"] for r in zero1[4]]
    assert sum(shards) == pytest.approx(whole, rel=0.001)
    assert max(shards) < 0.3 * whole
