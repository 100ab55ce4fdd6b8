"""The linear learning-rate scaling rule and its warm-up (Goyal et al. 2017), measured.

The rule: when the batch grows k-fold, multiply the learning rate by k. Why: k steps of SGD at
rate η on batches of B move the weights by -η Σ_j g(w_{t+j}); one step at rate kη on the union
batch kB moves them by -kη g(w_t). The two agree when g(w_{t+j}) ≈ g(w_t) over those k steps,
i.e. when the gradient changes slowly. It fails where the loss is steep and the weights change
fast: at the start of training. Hence the warm-up: ramp the rate from ~0 to kη over the first
epochs, and switch to kη once the landscape has flattened.

The task here is small and generated in code: count regression. Each sample has 8 features and
a count y ~ Poisson(rate(x)) of a rare event (a few events per hundred samples); a small tanh
MLP predicts log rate(x) and trains on the Poisson negative log-likelihood. At initialisation
the network predicts rates near 1, tens of times too high (:func:`rates_at_start` measures
both), and there the loss is steep: its curvature in the output is the predicted rate. Once the
rates are right it is tens of times flatter. That is the shape the warm-up is for. The curves
report the *excess* loss over the true rates' loss (the best any model can do): 0 is perfect.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from dplab._checks import check_positive_int
from dplab.ddp import DDP
from dplab.mechanics._common import rank_and_world, shard


@dataclass(frozen=True)
class CountTask:
    """The data set and model of the experiment; all of it generated from a seed."""

    n_samples: int = 32768
    n_features: int = 8
    hidden: int = 32
    base_log_rate: float = -4.0  # e^-4 ≈ 0.018 events per sample before the features act
    signal: float = 1.0  # how strongly the features move the log rate

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def count_data(task: CountTask, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features x, counts y, and the true log rates (a random teacher network makes them)."""
    g = torch.Generator().manual_seed(seed)
    d, width = task.n_features, 16
    x = torch.randn(task.n_samples, d, generator=g)
    w1 = torch.randn(d, width, generator=g) / math.sqrt(d)
    w2 = torch.randn(width, 1, generator=g) * task.signal / math.sqrt(width)
    log_rate = torch.tanh(2 * x @ w1) @ w2 + task.base_log_rate
    y = torch.poisson(torch.exp(log_rate), generator=g)
    return x, y, log_rate


def count_model(task: CountTask, seed: int) -> nn.Module:
    """A one-hidden-layer tanh MLP that outputs a log rate (PyTorch's default initialisation)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(task.n_features, task.hidden), nn.Tanh(), nn.Linear(task.hidden, 1)
    )


def rates_at_start(task: CountTask | None = None, seed: int = 0) -> dict[str, float]:
    """Mean rate the untrained network predicts, and the data's mean true rate.

    The Poisson loss's curvature in the network's output is the predicted rate itself, so their
    ratio is how much steeper the loss is at the start than once the rates are right.
    """
    task = task or CountTask()
    x, _, log_rate = count_data(task, seed)
    with torch.no_grad():
        predicted = torch.exp(count_model(task, seed + 1)(x)).mean().item()
    return {"predicted_at_init": predicted, "true": torch.exp(log_rate).mean().item()}


def poisson_nll(log_rate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean Poisson negative log-likelihood, up to the log(y!) term that no model can change."""
    return (torch.exp(log_rate) - y * log_rate).mean()


def warmup_lr(step: int, lr: float, warmup_steps: int) -> float:
    """Goyal et al.'s gradual warm-up: rise linearly to ``lr`` over ``warmup_steps``, then hold."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return lr
    return lr * (step + 1) / warmup_steps


def train_counts(
    *,
    batch: int,
    lr: float,
    warmup_epochs: float = 0.0,
    epochs: int = 4,
    seed: int = 0,
    evals_per_epoch: int = 16,
    task: CountTask | None = None,
) -> dict[str, Any]:
    """Rank function (or one process): SGD on the count task with global batch ``batch``.

    Under a process group each step's batch is sharded over the ranks and the gradients are
    averaged by :class:`dplab.DDP`, so ``batch`` is B_global = B_local × N. The excess loss over
    the whole data set is recorded ``evals_per_epoch`` times an epoch. Training stops at the
    first step whose weights are not finite (a diverged run); every rank sees the same weights,
    so every rank stops at the same step and nobody waits in an all-reduce alone.
    """
    task = task or CountTask()
    rank, n = rank_and_world()
    steps_per_epoch = _check_counts_run(task, batch, lr, warmup_epochs, epochs, evals_per_epoch, n)
    t0 = time.perf_counter()
    x, y, true_log_rate = count_data(task, seed)
    floor = poisson_nll(true_log_rate, y).item()
    model = count_model(task, seed + 1)
    net = DDP(model) if n > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    warmup_steps = round(warmup_epochs * steps_per_epoch)
    every = steps_per_epoch // evals_per_epoch
    order = torch.Generator().manual_seed(seed + 2)

    def excess() -> float:
        with torch.no_grad():
            return poisson_nll(model(x), y).item() - floor

    curve_epochs, curve = [0.0], [excess()]
    lrs: list[float] = []
    diverged_at: int | None = None
    step = 0
    for _ in range(epochs):
        perm = torch.randperm(task.n_samples, generator=order)
        for i in range(steps_per_epoch):
            idx = shard(perm[i * batch : (i + 1) * batch], rank, n)
            rate = warmup_lr(step, lr, warmup_steps)
            for group in opt.param_groups:
                group["lr"] = rate
            lrs.append(rate)
            poisson_nll(net(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            finite = all(torch.isfinite(p).all() for p in model.parameters())
            if not finite or (step % every == 0):
                curve_epochs.append(step / steps_per_epoch)
                curve.append(excess() if finite else math.nan)
            if not finite:
                diverged_at = step
                break
        if diverged_at is not None:
            break
    return {
        "rank": rank,
        "world_size": n,
        "batch": batch,
        "local_batch": batch // n,
        "lr": lr,
        "warmup_epochs": warmup_epochs,
        "warmup_steps": warmup_steps,
        "steps_per_epoch": steps_per_epoch,
        "epochs": curve_epochs,
        "excess_loss": curve,
        "lrs": lrs,
        "diverged_at_step": diverged_at,
        "floor": floor,
        "wall_s": time.perf_counter() - t0,
        "task": task.to_dict(),
    }


def _check_counts_run(
    task: CountTask, batch: int, lr: float, warmup_epochs: float, epochs: int,
    evals_per_epoch: int, world_size: int,
) -> int:  # fmt: skip
    """Refuse a run :func:`train_counts` cannot make; return its steps per epoch."""
    check_positive_int("batch", batch)
    check_positive_int("epochs", epochs)
    check_positive_int("evals_per_epoch", evals_per_epoch)
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if warmup_epochs < 0:
        raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs!r}")
    if batch % world_size:
        raise ValueError(f"batch={batch} does not split over world_size={world_size}")
    steps_per_epoch = task.n_samples // batch
    if steps_per_epoch < evals_per_epoch:
        raise ValueError(
            f"batch={batch} leaves {steps_per_epoch} steps per epoch, fewer than "
            f"evals_per_epoch={evals_per_epoch}"
        )
    return steps_per_epoch


@dataclass(frozen=True)
class ScalingSetup:
    """Batch B and rate η of the small-batch reference, the factor k, the warm-up length."""

    base_batch: int = 64
    base_lr: float = 0.24
    k: int = 32
    warmup_epochs: float = 1.0
    epochs: int = 4

    def configs(self) -> dict[str, dict[str, Any]]:
        """The four runs, by label: (batch, lr, warm-up epochs)."""
        b, lr, k = self.base_batch, self.base_lr, self.k
        return {
            "B, η": {"batch": b, "lr": lr, "warmup_epochs": 0.0},
            "kB, η": {"batch": k * b, "lr": lr, "warmup_epochs": 0.0},
            "kB, kη": {"batch": k * b, "lr": k * lr, "warmup_epochs": 0.0},
            "kB, kη + warm-up": {"batch": k * b, "lr": k * lr, "warmup_epochs": self.warmup_epochs},
        }


def lr_scaling_runs(
    cluster: Any = None, setup: ScalingSetup | None = None, *, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """Run the four configurations, on ``cluster``'s ranks (or in this process if None)."""
    setup = setup or ScalingSetup()
    out = {}
    for label, cfg in setup.configs().items():
        kwargs = dict(cfg, epochs=setup.epochs, seed=seed)
        out[label] = cluster.run(train_counts, **kwargs)[0] if cluster else train_counts(**kwargs)
    return out


def epochs_to_reach(run: dict[str, Any], target: float) -> float | None:
    """The first evaluated epoch at which the excess loss is at or below ``target``."""
    for e, v in zip(run["epochs"], run["excess_loss"], strict=True):
        if math.isfinite(v) and v <= target:
            return e
    return None


def mean_loss_in(run: dict[str, Any], start: float, stop: float) -> float:
    """Mean excess loss over the evaluations with ``start < epoch <= stop`` (nan if it diverged)."""
    values = [
        v for e, v in zip(run["epochs"], run["excess_loss"], strict=True) if start < e <= stop
    ]
    if not values or run["diverged_at_step"] is not None:
        return math.nan
    return sum(values) / len(values)


def scaling_summary(runs: dict[str, dict[str, Any]], *, target: float = 0.01) -> dict[str, dict]:
    """Per run: where it diverged (step, epoch), epochs to reach ``target``, last-epoch mean."""
    out = {}
    for label, run in runs.items():
        d = run["diverged_at_step"]
        last = run["epochs"][-1]
        out[label] = {
            "batch": run["batch"],
            "lr": run["lr"],
            "warmup_epochs": run["warmup_epochs"],
            "diverged_at_step": d,
            "diverged_at_epoch": None if d is None else d / run["steps_per_epoch"],
            "epochs_to_target": epochs_to_reach(run, target),
            "last_epoch_mean": mean_loss_in(run, last - 1, last),
            "target": target,
        }
    return out


EXCESS_FLOOR = 1e-6  # nats: far below any excess loss the lessons reach


@dataclass(frozen=True)
class FactorSetup:
    """Which factor of η reproduces the small batch's training, at a rate gentle enough that
    no factor needs a warm-up: B at η against kB at f·η for each f, the same epochs."""

    base_batch: int = 64
    base_lr: float = 0.03
    k: int = 32
    epochs: int = 2

    def factors(self) -> dict[str, float]:
        """The linear rule's k against k/2, 2k and the square-root rule √k: the usual advice for
        Adam (Malladi et al. 2022), which for SGD, here, should lose to k."""
        k = self.k
        return {"√k": math.sqrt(k), "k/2": k / 2, "k": float(k), "2k": 2.0 * k}


def log_gap(run: dict[str, Any], reference: dict[str, Any], *, after: float = 0.25) -> float:
    """Mean of log(excess loss / reference's) over the evaluations past ``after`` epochs:
    0 when the two curves coincide epoch for epoch, +0.69 when ``run`` is 2× behind throughout,
    negative when it is ahead. nan if either diverged (its curve stops early)."""
    if run["diverged_at_step"] is not None or reference["diverged_at_step"] is not None:
        return math.nan
    if run["epochs"] != reference["epochs"]:
        raise ValueError("the two runs were evaluated at different epochs: compare like with like")
    curves = zip(reference["epochs"], reference["excess_loss"], run["excess_loss"], strict=True)
    # the floor is measured on the same samples, so a fit can dip just below it: clamp there
    logs = [
        math.log(max(w, EXCESS_FLOOR) / max(v, EXCESS_FLOOR)) for e, v, w in curves if e >= after
    ]
    return sum(logs) / len(logs) if logs else math.nan


def factor_runs(
    cluster: Any = None, setup: FactorSetup | None = None, *, seed: int = 0
) -> dict[str, Any]:
    """The small batch at η, then kB at each factor of η; each factor's :func:`log_gap`."""
    setup = setup or FactorSetup()

    def run(batch: int, lr: float) -> dict[str, Any]:
        kwargs = {"batch": batch, "lr": lr, "warmup_epochs": 0.0, "epochs": setup.epochs}
        if cluster is None:
            return train_counts(**kwargs, seed=seed)
        return cluster.run(train_counts, **kwargs, seed=seed)[0]

    small = run(setup.base_batch, setup.base_lr)
    large = {
        name: run(setup.k * setup.base_batch, f * setup.base_lr)
        for name, f in setup.factors().items()
    }
    return {
        "small": small,
        "large": large,
        "gap": {name: log_gap(r, small) for name, r in large.items()},
    }
