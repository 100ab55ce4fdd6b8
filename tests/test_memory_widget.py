"""The MemoryWall widget: values set as a user would, verdicts and refusals read back."""

from __future__ import annotations

import pytest

from dplab.memory import GB, LLM_SHAPES, fits
from dplab.memory.state import STAGE_LABELS
from dplab.viz.memory import fit_figure, memory_vs_world_size
from dplab.widgets.memory import CUSTOM, MemoryWall


def bar_totals(fig) -> dict[str, float]:
    """Sum the stacked bars of the left panel, per column."""
    totals: dict[str, float] = {}
    for trace in fig.data:
        if trace.type == "bar":
            for x, y in zip(trace.x, trace.y, strict=True):
                totals[x] = totals.get(x, 0.0) + y
    return totals


def test_default_is_the_wall():
    wall = MemoryWall()
    assert wall.message.value == ""
    assert "does not fit on an H100 at any data-parallel size" in wall.verdict.value
    assert wall.fit is not None and not wall.fit.fits
    totals = bar_totals(wall.figure)
    assert totals["plain DP ◀"] == pytest.approx(wall.fit.total / GB)  # ◀ marks the stage chosen


def test_custom_parameter_count_gives_the_seed_sentence():
    wall = MemoryWall()
    wall.model.value = CUSTOM
    wall.n_params.value = 7e9
    assert wall.fit.n_params == 7 * 10**9
    assert "7.00 B params × 16 B = 112 GB &gt; 85.9 GB" in wall.verdict.value
    assert not wall.n_params.disabled
    wall.model.value = "gpt2-124m"
    assert wall.n_params.disabled
    assert wall.fit.n_params == LLM_SHAPES["gpt2-124m"].n_params


def test_zero3_over_enough_ranks_fits_and_the_figure_follows():
    wall = MemoryWall(world_size=8)
    wall.zero_stage.value = 3
    assert wall.fit.fits and "With ZeRO-3 over 8 ranks" in wall.verdict.value
    assert "ZeRO-3 ◀" in bar_totals(wall.figure)
    expected = fits("llama2-7b", "h100-80gb", world_size=8, zero_stage=3)
    assert bar_totals(wall.figure)["ZeRO-3 ◀"] == pytest.approx(expected.total / GB)


def test_recipe_and_gpu_change_the_numbers():
    wall = MemoryWall(model="llama2-13b", world_size=1)
    before = wall.fit.state.total
    wall.precision.value = "mixed_fp32_grads"
    assert wall.fit.state.total == before * 20 // 16
    wall.optimizer.value = "sgd"
    wall.gpu.value = "mi300x-192gb"
    assert wall.fit.gpu.name == "MI300X 192GB"
    assert "MI300X" in wall.verdict.value


@pytest.mark.parametrize(
    ("control", "bad", "name"),
    [
        ("world_size", 0, "world_size"),
        ("world_size", -3, "world_size"),
        ("micro_batch", 0, "micro_batch"),
        ("seq_len", -5, "seq_len"),
    ],
)
def test_bad_values_show_a_message_not_a_traceback(control, bad, name):
    wall = MemoryWall()
    good_verdict = wall.verdict.value
    getattr(wall, control).value = bad  # must not raise
    assert f"{name} must be a positive int, got {bad}" in wall.message.value
    assert wall.verdict.value == good_verdict  # the last good result stays
    getattr(wall, control).value = 2
    assert wall.message.value == ""


def test_activation_controls_move_only_the_activations():
    wall = MemoryWall()
    act = wall.fit.activations
    wall.micro_batch.value = 4
    assert wall.fit.activations == 4 * act
    wall.recompute.value = "full"
    assert wall.fit.activations < act


def test_standalone_figures():
    cap = 80 * 2**30
    fig = memory_vs_world_size(7 * 10**9, world_sizes=(1, 2, 4), capacity_bytes=cap)
    dp = next(t for t in fig.data if t.name == "plain DP")
    assert list(dp.y) == [112.0, 112.0, 112.0]
    z3 = next(t for t in fig.data if t.name == "ZeRO-3")
    assert list(z3.y) == [112.0, 56.0, 28.0]
    big = fit_figure(fits("llama2-7b", "h100-80gb", world_size=3000))
    assert 3000 in next(t for t in big.data if t.name == "plain DP").x


def test_measured_points_of_the_chosen_recipe_sit_on_its_curves():
    # bytes per parameter as §9 and §9b measure them: plain DP 16 in mixed AdamW; ZeRO-1 and
    # ZeRO-3 in fp32 AdamW (the worst rank of each world size)
    measured = {
        ("mixed", "adam"): {0: {1: 16.0, 2: 16.0, 4: 16.0}},
        ("fp32", "adam"): {1: {1: 16.0, 2: 12.0, 4: 10.0}, 3: {2: 8.0, 4: 4.0}},
    }
    wall = MemoryWall(measured=measured)

    def crosses():
        return {t.name: t for t in wall.figure.data if t.name.startswith("measured per param")}

    (dp,) = crosses().values()  # the default recipe is mixed AdamW: plain DP's points only
    assert list(dp.x) == [1, 2, 4]
    act = wall.fit.activations
    assert list(dp.y) == pytest.approx([(16 * wall.fit.n_params + act) / GB] * 3)
    # on the curve: plain DP's per-rank bytes (state + activations) at every N
    curve = next(t for t in wall.figure.data if t.name == STAGE_LABELS[0])
    at = dict(zip(curve.x, curve.y, strict=True))
    assert [at[n] for n in dp.x] == pytest.approx(list(dp.y))
    wall.precision.value = "fp32"
    assert sorted(crosses()) == [f"measured per parameter, {STAGE_LABELS[s]}" for s in (1, 3)]
    wall.optimizer.value = "sgd"  # no measurement of this recipe: nothing drawn
    assert not crosses()
