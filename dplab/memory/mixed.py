"""Mixed-precision training on real tensors: 16-bit weights and grads, an fp32 optimizer.

The model's parameters (and so its gradients) are bf16 or fp16: 2 + 2 bytes per parameter. The
optimizer keeps an fp32 *master* copy of every weight (4 bytes) because a 16-bit weight cannot
absorb updates much smaller than itself, and runs Adam's moments in fp32 (4 + 4 bytes). After
each update the master copy is rounded back into the 16-bit weight the next forward pass uses.

The update runs one parameter at a time, so the fp32 view of a gradient exists for one tensor
only and the held state stays at 16 bytes per parameter (the ZeRO paper's accounting). With
``grad_accum_dtype=torch.float32`` every parameter also gets a persistent fp32 ``main_grad`` that
micro-batches accumulate into (Megatron's recipe): 20 bytes per parameter.

The optimizer maths is torch's: AdamW (decoupled weight decay, bias-corrected moments), SGD and
SGD with momentum; the tests check it against ``torch.optim`` step for step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from dplab.memory.recipes import check_optimizer


class MixedPrecisionOptimizer:
    """An fp32-master optimizer for a model whose parameters are 16-bit."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        optimizer: str = "adam",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        momentum: float = 0.9,
        grad_accum_dtype: torch.dtype | None = None,
    ):
        self.optimizer = check_optimizer(optimizer)
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MixedPrecisionOptimizer got no parameters that require grad")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if grad_accum_dtype not in (None, torch.float32):
            raise ValueError(
                f"grad_accum_dtype must be None or torch.float32, got {grad_accum_dtype}"
            )
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.momentum = weight_decay, momentum
        self.master = [p.detach().to(torch.float32, copy=True) for p in self.params]
        n_stats = {"sgd": 0, "momentum": 1, "adam": 2}[self.optimizer]
        self.stats = [[torch.zeros_like(m) for m in self.master] for _ in range(n_stats)]
        self.main_grads = (
            [torch.zeros_like(m) for m in self.master] if grad_accum_dtype is not None else None
        )
        self.steps = 0

    def accumulate(self) -> None:
        """Add this micro-batch's 16-bit grads into the fp32 ``main_grad`` and zero them."""
        if self.main_grads is None:
            raise RuntimeError("accumulate() needs grad_accum_dtype=torch.float32")
        for p, main in zip(self.params, self.main_grads, strict=True):
            if p.grad is not None:
                main.add_(p.grad)
                p.grad.zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
        if self.main_grads is not None:
            for main in self.main_grads:
                main.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One update of every master weight, then round it into the 16-bit weight."""
        self.steps += 1
        for i, (p, master) in enumerate(zip(self.params, self.master, strict=True)):
            if self.main_grads is not None:
                grad = self.main_grads[i]
            elif p.grad is None:
                continue
            else:
                grad = p.grad.to(torch.float32)  # transient: one parameter's worth
            if self.optimizer == "adam":
                self._adamw(master, grad, self.stats[0][i], self.stats[1][i])
            elif self.optimizer == "momentum":
                buf = self.stats[0][i]
                if self.steps == 1:
                    buf.copy_(grad)
                else:
                    buf.mul_(self.momentum).add_(grad)
                master.add_(buf, alpha=-self.lr)
            else:
                master.add_(grad, alpha=-self.lr)
            p.copy_(master)

    def _adamw(self, master, grad, exp_avg, exp_avg_sq) -> None:
        beta1, beta2 = self.betas
        master.mul_(1.0 - self.lr * self.weight_decay)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias1 = 1.0 - beta1**self.steps
        bias2 = 1.0 - beta2**self.steps
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(self.eps)
        master.addcdiv_(exp_avg, denom, value=-self.lr / bias1)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this optimizer holds, by part of the model state."""
        held = {
            "master_weights": list(self.master),
            "optimizer_state": [t for stat in self.stats for t in stat],
        }
        if self.main_grads is not None:
            held["grads"] = list(self.main_grads)
        return held
