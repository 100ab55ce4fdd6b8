"""§10 DDP under ``torch.compile``: one backward graph means no overlap, unless it is split.

DDP overlaps by launching a bucket's all-reduce while backward still computes earlier layers.
Compiled, the model's backward is *one* graph: every gradient comes out when the whole graph is
done, so every bucket launches after all the compute. torch's DDPOptimizer
(``torch._dynamo.config.optimize_ddp``, on by default) splits the forward graph at bucket
boundaries, so each piece's backward is its own autograd node and its bucket can launch as
soon as that piece is done. The counts here are graphs compiled, and bucket launches that
happened before backward reached the model's input (its last computation): overlap possible.

dplab.DDP hooks each parameter (``register_post_accumulate_grad_hook``) as torch's DDP does, but
DDPOptimizer splits only for torch's DDP (it asks ``DistributedDataParallel`` which module is
active), so a compiled model under dplab.DDP gets one graph: no overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dplab.failures._common import short_group

WIDTH = 512  # 1 MiB per layer: a layer per bucket at bucket_cap_mb=1


def compiled_backward_nodes(root: Any) -> list[Any]:
    """The autograd nodes that run a compiled graph's backward, reachable from ``root``."""
    found, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


@dataclass(frozen=True)
class CompiledRun:
    """One rank's compiled DDP step (the second, after torch rebuilt its buckets): graphs
    compiled, bucket all-reduces launched, and how many were launched before backward had
    finished computing (the ones that can overlap)."""

    optimize_ddp: bool
    graphs: int
    launches: int
    launched_during_backward: int


def compiled_ddp(
    *, optimize_ddp: bool, layers: int = 4, group_timeout_s: float = 10.0
) -> CompiledRun:
    """Rank function: ``DDP(torch.compile(model, backend="aot_eager"))``, one backward.

    ``aot_eager`` traces forward and backward graphs as inductor would but runs them eagerly:
    the same graphs and splits, without a C++ compiler.
    """
    import torch._dynamo  # binds torch too: compile machinery only when this runs
    from torch._dynamo.backends.debugging import aot_eager

    graphs: list[int] = []

    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    before = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = optimize_ddp
    try:
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
        with short_group(group_timeout_s) as group:
            model = TorchDDP(
                torch.compile(net, backend=backend), process_group=group, bucket_cap_mb=1
            )
            pieces_done = [0, 0]  # compiled backward graphs finished, and in all
            launches: list[bool] = []  # per launch: had every compiled backward finished?

            def hook(state, bucket):  # no annotations (see no_sync)
                launches.append(pieces_done[0] == pieces_done[1])
                return allreduce_hook(group, bucket)

            model.register_comm_hook(None, hook)
            # Step 0 runs torch's one initial bucket; from step 1 on, the rebuilt buckets.
            for _ in range(2):
                launches.clear()
                out = model(torch.randn(8, WIDTH)).sum()
                pieces = compiled_backward_nodes(out.grad_fn)
                pieces_done[:] = [0, len(pieces)]
                for node in pieces:
                    node.register_hook(lambda *_: pieces_done.__setitem__(0, pieces_done[0] + 1))
                out.backward()
            del model, out  # a DDP must not outlive its group (see short_group)
    finally:
        torch._dynamo.config.optimize_ddp = before
        torch._dynamo.reset()
    return CompiledRun(optimize_ddp, len(graphs), len(launches), launches.count(False))


def graphs_under_dplab_ddp(*, layers: int = 4) -> int:
    """Rank function: graphs compiled for ``dplab.DDP(torch.compile(model))``, DDPOptimizer on.

    DDPOptimizer splits only when torch's ``DistributedDataParallel`` reports an active module,
    so under dplab.DDP the model stays one graph (and its backward, one node: no overlap).
    """
    import torch._dynamo  # binds torch too
    from torch._dynamo.backends.debugging import aot_eager

    from dplab.ddp import DDP

    graphs: list[int] = []

    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    before = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = True
    try:
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
        model = DDP(torch.compile(net, backend=backend), bucket_cap_mb=1)
        for _ in range(2):
            model(torch.randn(8, WIDTH)).sum().backward()
    finally:
        torch._dynamo.config.optimize_ddp = before
        torch._dynamo.reset()
    return len(graphs)
