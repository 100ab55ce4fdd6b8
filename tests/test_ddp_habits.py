"""Habits torch's DDP takes, run the same way under dplab.DDP and torch 2.13's DDP on 2 gloo ranks.

Each case runs one snippet under both wrappers, on identical copies of one model, and compares
what torch does with what dplab does: the gradients (float64, compared exactly: at world size 2
each element's average is (a + b) / 2 in either order, so both give the same bits), or the
refusal's message where dplab refuses (lazy modules, a dtype changed after wrapping), with
torch's behaviour beside it to show why. The habits: a BatchNorm model called on
two views before one backward; a backward that gives no parameter a gradient (FGSM, a GAN
generator step, a gradient penalty); a second backward with ``retain_graph=True``;
``copy.deepcopy``/``pickle``/``torch.save`` of the wrapper; two wrapped modules sharing a
parameter; lazy modules; ``.double()`` after wrapping (sparse gradients: test_ddp_torch).
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import torch
import torch.distributed as dist
from torch import nn

import dplab

TORCH = nn.parallel.DistributedDataParallel
WRAPPERS = {"torch": TORCH, "dplab": dplab.DDP}


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    """This rank's batch: different on every rank, the same for both wrappers."""
    g = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return True


def _both(snippet) -> dict:
    """``snippet(wrapper)`` under torch's DDP and under dplab.DDP; an exception is its result."""
    out = {}
    for name, wrapper in WRAPPERS.items():
        try:
            out[name] = snippet(wrapper)
        except Exception as e:  # the comparison below names what went wrong
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _assert_same_as_torch(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert not isinstance(r["dplab"], str), f"rank {rank}: dplab raised {r['dplab']}"
        assert not isinstance(r["torch"], str), f"rank {rank}: torch raised {r['torch']}"
        assert r["same"], f"rank {rank}: dplab's gradients differ from torch's"


# -- BatchNorm on two views before one backward ------------------------------------------------


def _two_views(wrapper) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double()
    net = wrapper(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        (net(_x(6, 4, seed=step)) - net(_x(6, 4, seed=step + 10))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def _batchnorm_two_views() -> dict:
    r = _both(_two_views)
    r["same"] = not isinstance(r["dplab"], str) and _same(r["dplab"], r["torch"])
    return r


def test_batchnorm_on_two_views_before_one_backward_trains_as_torch(cluster2):
    # Before: autograd's "modified by an inplace operation" (the broadcast bumped running_mean).
    _assert_same_as_torch(cluster2.run(_batchnorm_two_views))


# -- a backward that gives no parameter a gradient -----------------------------------------------


def _fgsm(wrapper) -> list:
    """The adversarial example from the input's gradient, then the step on it."""
    model = _mlp()
    net = wrapper(model)
    x = _x(3, 4).requires_grad_()
    (gx,) = torch.autograd.grad(net(x).sum(), x)  # no parameter gets a gradient
    net((x + 0.1 * gx.sign()).detach()).sum().backward()
    return _grads(model)


def _fgsm_same_forward(wrapper) -> list:
    """The input's gradient first, then the same forward's own backward (retain_graph)."""
    model = _mlp()
    net = wrapper(model)
    x = _x(3, 4).requires_grad_()
    loss = net(x).sum()
    torch.autograd.grad(loss, x, retain_graph=True)
    loss.backward()
    return _grads(model)


def _gan(wrapper) -> list:
    """D step, G step through the frozen D (D's wrapper gets no gradient), D step again."""
    torch.manual_seed(0)
    g_model, d_model = nn.Linear(4, 4).double(), nn.Linear(4, 1).double()
    g, d = wrapper(g_model), wrapper(d_model)
    z = _x(3, 4)
    d(g(z).detach()).sum().backward()
    d_model.requires_grad_(False)
    d(g(z)).sum().backward()
    d_model.requires_grad_(True)
    d(g(z).detach()).sum().backward()
    return _grads(g_model) + _grads(d_model)


def _no_gradient_backwards() -> dict:
    out = {}
    for snippet in (_fgsm, _fgsm_same_forward, _gan):
        r = _both(snippet)
        ok = not isinstance(r["dplab"], str) and not isinstance(r["torch"], str)
        out[snippet.__name__] = {
            "dplab": r["dplab"] if isinstance(r["dplab"], str) else "ok",
            "torch": r["torch"] if isinstance(r["torch"], str) else "ok",
            "same": ok and _same(r["dplab"], r["torch"]),
        }
    return out


def test_a_backward_that_gives_no_parameter_a_gradient_is_not_a_sync(cluster2):
    # Before: "these parameters got no gradient in this backward" (blaming unused parameters).
    for r in cluster2.run(_no_gradient_backwards):
        for case, result in r.items():
            assert result == {"dplab": "ok", "torch": "ok", "same": True}, case


# -- a second backward of one forward ------------------------------------------------------------


def _retain(wrapper) -> list:
    model = _mlp()
    net = wrapper(model)
    loss = net(_x(3, 4)).sum()
    loss.backward(retain_graph=True)
    first = _grads(model)
    loss.backward()
    return first + _grads(model)


def _second_backward() -> dict:
    r = _both(_retain)
    r["same"] = not isinstance(r["dplab"], str) and _same(r["dplab"], r["torch"])
    return r


def test_a_second_backward_with_retain_graph_accumulates_locally_as_torch(cluster2):
    # Before: dplab all-reduced the second backward too (its .grad differed from torch's).
    results = cluster2.run(_second_backward)
    _assert_same_as_torch(results)
    # what torch does: the second gradient is this rank's own, so the ranks' .grad now differ
    # (the first layer's weight: the last layer's bias gets the same gradient on every rank)
    after_first, after_second = results[0]["dplab"][0], results[0]["dplab"][4]
    assert torch.equal(after_first, results[1]["dplab"][0])
    assert not torch.equal(after_second, results[1]["dplab"][4])


# -- copy.deepcopy, pickle, torch.save -----------------------------------------------------------


def _copies(wrapper) -> list:
    net = wrapper(_mlp())
    saved = io.BytesIO()
    torch.save(net, saved)
    saved.seek(0)
    copies = [
        copy.deepcopy(net),
        pickle.loads(pickle.dumps(net)),
        torch.load(saved, weights_only=False),
    ]
    assert all(type(c) is type(net) and c.module is not net.module for c in copies)
    grads = []
    for c in [*copies, net]:  # every copy trains, and so does the original
        c(_x(3, 4)).sum().backward()
        grads += _grads(c.module)
    return grads


def _copied_wrappers() -> dict:
    r = _both(_copies)
    r["same"] = not isinstance(r["dplab"], str) and _same(r["dplab"], r["torch"])
    return r


def test_deepcopy_pickle_and_torch_save_of_a_wrapper_work_as_torchs(cluster2):
    # Before: "cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object".
    _assert_same_as_torch(cluster2.run(_copied_wrappers))


# -- two wrapped modules sharing a parameter -----------------------------------------------------


def _shared(wrapper) -> list:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4).double()
    a = nn.Sequential(shared, nn.Linear(4, 1).double())
    b = nn.Sequential(shared, nn.Linear(4, 1).double())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "already wrapped" warning
        da, db = wrapper(a), wrapper(b)
    x = _x(3, 4)
    (da(x).sum() + db(x).sum()).backward()
    return _grads(a) + _grads(b)


def _shared_parameter() -> dict:
    r = _both(_shared)
    r["same"] = not isinstance(r["dplab"], str) and _same(r["dplab"], r["torch"])
    return r


def test_two_wrapped_modules_sharing_a_parameter_both_reduce_as_torch(cluster2):
    # Before: the first wrapper was detached as "wrapped again".
    _assert_same_as_torch(cluster2.run(_shared_parameter))


# -- refused by name: lazy modules, a dtype changed after wrapping ------------------------------


def _refusals() -> dict:
    def lazy(wrapper):
        wrapper(nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 1)))
        return "wrapped"

    def double_after(wrapper):
        model = nn.Linear(4, 2)
        net = wrapper(model)
        net.double()
        net(_x(3, 4)).sum().backward()
        grads = [None] * dist.get_world_size()
        dist.all_gather_object(grads, model.weight.grad)
        return "reduced" if torch.equal(grads[0], grads[1]) else "left unreduced"

    return {f.__name__: _both(f) for f in (lazy, double_after)}


def test_lazy_modules_and_dtype_changes_after_wrapping_are_refused_by_name(cluster2):
    # Before: a shape error about uninitialized parameters (lazy), float64 gradients reduced in
    # float32 (double).
    for r in cluster2.run(_refusals):
        torchs = "Modules with uninitialized parameters can't be used with"
        assert r["lazy"]["torch"].startswith(f"RuntimeError: {torchs}")
        assert r["lazy"]["dplab"].startswith(f"RuntimeError: {torchs}")
        assert "'0.weight'" in r["lazy"]["dplab"]

        assert r["double_after"]["torch"] == "left unreduced"  # torch: silently not averaged
        message = r["double_after"]["dplab"]
        assert message.startswith("RuntimeError: parameter ") and "has a torch.float64" in message
        assert "holds torch.float32" in message and "Convert the module first" in message
