"""The sharded step, simulated: DDP, ZeRO-1, ZeRO-2 and ZeRO-3/FSDP from a unit profile and a link.

A sharded step is a program that one rank's CPU walks in order, with two things that take time:
**compute** (one unit's forward or backward, measured) and **collectives** (priced by a link).
A collective is issued at a point of the program and runs on the rank's one communication
channel, first come first served; compute that needs its result waits for it. That is all the
simulator knows, and it is enough to lay out each method:

* **DDP**: forward; backward unit by unit, each bucket's all-reduce issued when its last unit's
  gradients are ready (buckets cut by ``bucket_cap_mb`` at unit granularity); wait; optimizer.
* **ZeRO-1** (torch's ``ZeroRedundancyOptimizer``): DDP's step, the optimizer on this rank's
  share of the state, then every parameter broadcast from the rank that owns it (on gloo, where
  the profile measured that burst at this N, its measured time: gloo does not pipeline the
  broadcasts into one transfer, and their burst is no sum of broadcasts timed alone).
* **ZeRO-3 / FSDP** (``fully_shard`` per block): before each unit's forward an all-gather of its
  weights; in backward every unit is gathered again (forward freed them: the root too, as torch
  2.13's FSDP2 does when ``reshard_after_forward=True`` is passed for it, as §9b does; 09b's
  counter and timeline count the root's second gather), and each unit's gradient is
  reduce-scattered when its backward ends. With ``prefetch=True`` the next unit's all-gather is
  issued before this unit computes, so it runs beside the compute (FSDP2's backward prefetch,
  and what a GPU's separate stream gives forward); with ``prefetch=False`` every collective is
  waited for where it is issued. **ZeRO-2** (``reshard_after_forward=False``) is ZeRO-3
  without backward's gathers.

Prices, from a :class:`~dplab.sim.link.Link` or :class:`~dplab.sim.fabric.Fabric` (anything with
``allreduce_s(nbytes, world_size)``): an all-gather or a reduce-scatter of S bytes on a ring is
half an all-reduce of S, (N−1)·α + (N−1)/N·S·β; ZeRO-1's broadcasts are priced as one
all-gather of every weight. On gloo, where the profile measured them at that N, ZeRO-1's burst of
broadcasts and each FSDP unit's all-gather (as FSDP2 runs it: copies in and out included) take
their measured times instead: on this machine both cost more than an α-β fit of the bare
collective gives (docs/benchmarks.md, "Sharded step"). Gloo has no reduce-scatter: it runs a
full all-reduce (``backend="gloo"`` prices it so).

The compute comes from :class:`UnitProfile`: measured on real ranks by
:func:`dplab.sharding.unit_profile.unit_profile` and read with :func:`unit_profile_from_ranks`,
or built by :meth:`UnitProfile.uniform` for a model nobody here can run (the at-scale figures:
the model's prediction, no measurement behind it).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dplab._checks import check_choice, check_nonneg, check_positive, check_world_size
from dplab._units import MIB
from dplab.collectives.cost import fit_alpha_beta
from dplab.sim.link import Link
from dplab.sim.profile import BackwardProfile

# A parameter's block, from its name: "blocks.3.fc.weight", "h.3.attn.c_attn.weight", ...
BLOCK_NAME = re.compile(r"(?:^|\.)(?:blocks|h|layers)\.(\d+)\.")

METHODS = ("ddp", "zero1", "zero2", "zero3")
BACKENDS = ("nccl", "gloo")


class Priced(Protocol):
    """A Link or a Fabric: what one all-reduce of ``nbytes`` over ``world_size`` ranks costs."""

    def allreduce_s(self, nbytes: float, world_size: int) -> float: ...


@dataclass(frozen=True)
class UnitProfile:
    """One rank's compute, unit by unit, as FSDP cuts the model with one unit per block.

    The root unit holds what is not in a block (embeddings, final norm, head) and computes
    twice per pass: before the blocks (``root_forward_ms[0]``: embeddings) and after them
    (``[1]``: head and loss). In backward the head's part runs first
    (``root_backward_ms[1]``), the embeddings' last (``[0]``). ``block_*`` are in forward order.
    ``optimizer_ms`` maps a method to its optimizer step (``"ddp"`` the whole state; missing
    methods step 1/N of it in ``optimizer_ms["ddp"] / N``). ``tensor_bytes`` are the parameters'
    sizes. ``overhead_ms`` maps a method to its wrapper's own work per step (hooks, copies into
    and out of flat buffers, DTensor dispatch), a compute span at the end of backward; measured
    as the method's step on a group of one rank minus the plain step (0 where absent).
    ``broadcast_ms`` maps a world size to ZeRO-1's burst of broadcasts measured there on gloo
    (every parameter from its owner, issued at once); elsewhere they are priced as one
    all-gather of every weight. ``gather_ms`` maps a world size to each unit's all-gather as
    FSDP2 runs it there on gloo (root first, then the blocks); elsewhere an all-gather is
    priced from its bytes.
    """

    root_bytes: int
    block_bytes: tuple[int, ...]
    root_forward_ms: tuple[float, float]
    block_forward_ms: tuple[float, ...]
    root_backward_ms: tuple[float, float]
    block_backward_ms: tuple[float, ...]
    optimizer_ms: dict[str, float]
    tensor_bytes: tuple[int, ...] = ()
    overhead_ms: dict[str, float] = field(default_factory=dict)
    broadcast_ms: dict[int, float] = field(default_factory=dict)
    gather_ms: dict[int, tuple[float, ...]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        n = len(self.block_bytes)
        if n < 1 or len(self.block_forward_ms) != n or len(self.block_backward_ms) != n:
            raise ValueError(
                f"a profile needs >= 1 block and one forward and backward time per block; got "
                f"{n} blocks, {len(self.block_forward_ms)} forward, "
                f"{len(self.block_backward_ms)} backward"
            )
        check_nonneg("root_bytes", self.root_bytes)
        for name in (
            "root_forward_ms",
            "block_forward_ms",
            "root_backward_ms",
            "block_backward_ms",
            "block_bytes",
        ):
            for v in getattr(self, name):
                check_nonneg(name, v)
        for name in ("broadcast_ms", "gather_ms"):
            for world in getattr(self, name):
                if isinstance(world, bool) or not isinstance(world, int) or world < 2:
                    raise ValueError(
                        f"{name} is keyed by world sizes of 2 ranks or more (one rank sends "
                        f"nothing), got key {world!r}"
                    )
        for v in self.broadcast_ms.values():
            check_nonneg("broadcast_ms", v)
        for world, units in self.gather_ms.items():
            if len(units) != n + 1:
                raise ValueError(
                    f"gather_ms[{world}] needs the root's and each of the {n} blocks' all-gather, "
                    f"got {len(units)} times"
                )
            for v in units:
                check_nonneg("gather_ms", v)
        if "ddp" not in self.optimizer_ms:
            raise ValueError(f"optimizer_ms needs a 'ddp' entry, got {sorted(self.optimizer_ms)}")

    @property
    def param_bytes(self) -> int:
        return self.root_bytes + sum(self.block_bytes)

    @property
    def compute_ms(self) -> float:
        """Forward and backward of every unit: the step with nothing to wait for."""
        return (
            sum(self.root_forward_ms)
            + sum(self.block_forward_ms)
            + sum(self.root_backward_ms)
            + sum(self.block_backward_ms)
        )

    def optimizer(self, method: str, world_size: int) -> float:
        if method in self.optimizer_ms:
            return self.optimizer_ms[method]
        full = self.optimizer_ms["ddp"]
        return full if method == "ddp" else full / world_size

    @classmethod
    def uniform(
        cls,
        n_blocks: int,
        block_bytes: float,
        block_forward_ms: float,
        *,
        root_bytes: float = 0.0,
        backward_factor: float = 2.0,
        optimizer_ms: float = 0.0,
    ) -> UnitProfile:
        """``n_blocks`` equal blocks (backward ``backward_factor`` × forward, the 2× of the 6Ψ
        FLOP rule) and a root with no compute: a model described, not measured."""
        f = check_nonneg("block_forward_ms", block_forward_ms)
        b = f * check_positive("backward_factor", backward_factor)
        return cls(
            root_bytes=int(root_bytes),
            block_bytes=(int(block_bytes),) * n_blocks,
            root_forward_ms=(0.0, 0.0),
            block_forward_ms=(f,) * n_blocks,
            root_backward_ms=(0.0, 0.0),
            block_backward_ms=(b,) * n_blocks,
            optimizer_ms={"ddp": check_nonneg("optimizer_ms", optimizer_ms)},
            meta={"source": "described (UnitProfile.uniform), not measured"},
        )

    @classmethod
    def from_backward(cls, profile: BackwardProfile) -> UnitProfile:
        """A unit profile (one FSDP unit per block, the rest the root) from a DDP profile.

        Backward per unit is measured: the time from the previous unit's last gradient to this
        unit's last one (the head's part of the root first, the blocks in reverse, then the
        embeddings, which take what is left of backward). Forward is not measured per unit by a
        DDP profile: its total is split in the same proportions as backward. Blocks are found by
        name (``blocks.3.``, ``h.3.``, ``layers.3.``); a model without them is refused.
        """
        blocks: dict[int, list[Any]] = {}
        root = []
        for p in profile.params:
            m = BLOCK_NAME.search(p.name)
            (blocks.setdefault(int(m.group(1)), []) if m else root).append(p)
        if not blocks:
            raise ValueError(
                f"{profile.model}: no parameter is in a block (blocks.N., h.N. or layers.N.): "
                "there is nothing to cut into FSDP units"
            )
        order = sorted(blocks)
        first_block = min(p.ready_ms for ps in blocks.values() for p in ps)
        head = [p for p in root if p.ready_ms <= first_block]
        embeddings = [p for p in root if p.ready_ms > first_block]
        cursor = max((p.ready_ms for p in head), default=0.0)
        head_ms, block_ms = cursor, {}
        for i in reversed(order):
            done = max(cursor, max(p.ready_ms for p in blocks[i]))
            block_ms[i], cursor = done - cursor, done
        embed_ms = max(profile.backward_ms - cursor, 0.0)
        scale = profile.forward_ms / profile.backward_ms if profile.backward_ms > 0 else 0.0
        return cls(
            root_bytes=sum(p.nbytes for p in root),
            block_bytes=tuple(sum(p.nbytes for p in blocks[i]) for i in order),
            root_forward_ms=(embed_ms * scale, head_ms * scale),
            block_forward_ms=tuple(block_ms[i] * scale for i in order),
            root_backward_ms=(embed_ms, head_ms),
            block_backward_ms=tuple(block_ms[i] for i in order),
            optimizer_ms={"ddp": profile.optimizer_ms},
            tensor_bytes=tuple(p.nbytes for p in profile.params),
            meta={
                "source": f"{profile.model}'s DDP profile; forward split as backward is",
                "embedding_params": [p.name for p in embeddings],
            },
        )


def unit_profile_from_ranks(results: Sequence[dict[str, Any] | None]) -> UnitProfile:
    """A :class:`UnitProfile` from :func:`dplab.sharding.unit_profile.unit_profile`'s returns.

    Each step counts as its slowest rank (a collective waits for the last one); every number is
    the median over the timed steps.
    """
    ranks = [r for r in results if r]
    if not ranks:
        raise ValueError("no rank returned a unit profile")
    n_steps = min(len(r["steps"]) for r in ranks)
    n_blocks = len(ranks[0]["unit_bytes"]) - 1

    def med(key_fn: Any) -> float:
        return statistics.median(max(key_fn(r["steps"][s]) for r in ranks) for s in range(n_steps))

    last = n_blocks - 1
    block_f = tuple(med(lambda s, i=i: s[f"f{i}>"] - s[f"f{i}<"]) for i in range(n_blocks))
    block_b = tuple(med(lambda s, i=i: s[f"b{i}>"] - s[f"b{i}<"]) for i in range(n_blocks))
    root_f = (med(lambda s: s["f0<"]), med(lambda s: s["forward"] - s[f"f{last}>"]))
    root_b = (med(lambda s: s["backward"] - s["b0>"]), med(lambda s: s[f"b{last}<"] - s["forward"]))
    optimizer = {  # each rank's own median; the slowest rank's
        k: max(r["optimizer_ms"][k] for r in ranks) for k in ranks[0].get("optimizer_ms", {})
    }
    optimizer["ddp"] = med(lambda s: s["optimizer"])
    plain = med(lambda s: s["backward"] + s["optimizer"])
    alone = {k: max(r["alone_ms"][k] for r in ranks) for k in ranks[0].get("alone_ms", {})}
    overhead = {m: max(0.0, t - plain) for m, t in alone.items()}
    if "ddp" in overhead:
        overhead["zero1"] = overhead["ddp"]  # ZeRO-1's step is DDP's; its optimizer is timed
    broadcast, gather = {}, {}
    if ranks[0].get("zero1_broadcast_ms") is not None:
        broadcast[ranks[0]["world_size"]] = max(r["zero1_broadcast_ms"] for r in ranks)
    if ranks[0].get("gather_ms") is not None:  # each unit's slowest rank
        per_rank = [r["gather_ms"] for r in ranks]
        gather[ranks[0]["world_size"]] = tuple(map(max, zip(*per_rank, strict=True)))
    for m in ("zero2", "zero3"):  # the alone step includes FSDP's optimizer; not twice
        if m in overhead:
            optimizer[m] = optimizer["ddp"]
    return UnitProfile(
        root_bytes=ranks[0]["unit_bytes"][0],
        block_bytes=tuple(ranks[0]["unit_bytes"][1:]),
        root_forward_ms=root_f,
        block_forward_ms=block_f,
        root_backward_ms=root_b,
        block_backward_ms=block_b,
        optimizer_ms=optimizer,
        tensor_bytes=tuple(ranks[0]["tensor_bytes"]),
        overhead_ms=overhead,
        broadcast_ms=broadcast,
        gather_ms=gather,
        meta={"world_size": ranks[0]["world_size"], "ranks": len(ranks), "steps": n_steps},
    )


def links_from_ranks(results: Sequence[dict[str, Any] | None]) -> tuple[Link, Link]:
    """This machine's all-reduce and all-gather at the profile's world size, as two Links.

    α and β are fitted (:func:`~dplab.collectives.fit_alpha_beta`) to the collectives the ranks
    timed (the slowest rank's time at each size). An all-gather is half a ring all-reduce, so
    its times are doubled before the fit: ``gather.allreduce_s(S, N) / 2`` is the all-gather.
    """
    ranks = [r for r in results if r]
    if not ranks or not ranks[0].get("collectives"):
        raise ValueError("no rank timed any collective (a world size of 1 has none)")
    n = ranks[0]["world_size"]
    fits = []
    for op, factor in (("all_reduce", 1.0), ("all_gather", 2.0)):
        rows = [i for i, c in enumerate(ranks[0]["collectives"]) if c[0] == op]
        sizes = [ranks[0]["collectives"][i][1] for i in rows]
        times = [factor * 1e-3 * max(r["collectives"][i][2] for r in ranks) for i in rows]
        fit = fit_alpha_beta(sizes, times, n)
        # at these sizes a noisy fit can put all the time in α; a Link needs a bandwidth
        beta = max(fit.beta_s_per_byte, 1e-15)
        fits.append(
            Link.from_beta(
                f"gloo {op}, {n} ranks",
                fit.alpha_s,
                beta,
                f"measured: {op} timed on {n} ranks (unit_profile)",
            )
        )
    return fits[0], fits[1]


@dataclass(frozen=True)
class Span:
    """One thing on the rank's timeline: ``compute`` or ``comm`` lane, ms from the step start."""

    lane: str
    name: str
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class ShardedPrediction:
    """A simulated step: its length, the compute in it, and every span."""

    method: str
    world_size: int
    step_ms: float
    compute_ms: float
    comm_ms: float  # the collectives' total time, overlapped or not
    spans: tuple[Span, ...]

    @property
    def exposed_comm_ms(self) -> float:
        """Step time not spent computing: communication nothing hid (and waits for it)."""
        return self.step_ms - self.compute_ms


class _Program:
    """One rank's CPU walking the step: compute in order, collectives on one FIFO channel."""

    def __init__(self, prefetch: bool):
        self.prefetch = prefetch
        self.cpu = 0.0
        self.channel = 0.0
        self.done: dict[str, float] = {}
        self.spans: list[Span] = []

    def issue(self, name: str, seconds: float) -> None:
        start = max(self.cpu, self.channel)
        self.channel = start + 1e3 * seconds
        self.done[name] = self.channel
        self.spans.append(Span("comm", name, start, self.channel))
        if not self.prefetch:  # waited for where it is issued
            self.cpu = self.channel

    def compute(self, name: str, ms: float, needs: Sequence[str] = ()) -> None:
        start = max([self.cpu, *(self.done[n] for n in needs)])
        self.cpu = start + ms
        self.spans.append(Span("compute", name, start, self.cpu))

    def wait_all(self) -> None:
        self.cpu = max(self.cpu, self.channel)


def _prices(link: Priced, n: int, backend: str, gather_link: Priced | None) -> dict[str, Any]:
    gather = gather_link or link

    def all_gather(s: float) -> float:
        return gather.allreduce_s(s, n) / 2

    return {
        "all_reduce": lambda s: link.allreduce_s(s, n),
        "all_gather": all_gather,
        "reduce_scatter": (lambda s: link.allreduce_s(s, n)) if backend == "gloo" else all_gather,
    }


def _ddp_backward(prog: _Program, p: UnitProfile, price: dict[str, Any], cap: float) -> None:
    """Backward unit by unit (head, blocks reversed, embeddings), a bucket's all-reduce issued
    when its last unit is done; DDP's reducer never blocks backward, whatever the backend."""
    order = [("root-head", p.root_backward_ms[1], 0)]
    order += [
        (f"block{i}", p.block_backward_ms[i], p.block_bytes[i])
        for i in reversed(range(len(p.block_bytes)))
    ]
    order += [("root-embed", p.root_backward_ms[0], p.root_bytes)]
    prefetch, prog.prefetch = prog.prefetch, True
    filled, k = 0.0, 0
    for i, (name, ms, nbytes) in enumerate(order):
        prog.compute(f"backward {name}", ms)
        filled += nbytes
        if filled and (filled >= cap or i == len(order) - 1):
            prog.issue(f"all_reduce bucket{k}", price["all_reduce"](filled))
            filled, k = 0.0, k + 1
    prog.prefetch = prefetch
    prog.wait_all()


def _fsdp_forward(prog: _Program, p: UnitProfile, price: dict[str, Any]) -> None:
    n = len(p.block_bytes)
    prog.issue("all_gather root", price["unit_gather"](0))
    if prog.prefetch:
        prog.issue("all_gather block0", price["unit_gather"](1))
    prog.compute("forward root-embed", p.root_forward_ms[0], ["all_gather root"])
    for i in range(n):
        nxt = i + 1 if prog.prefetch else i
        if nxt < n and (nxt > 0 or not prog.prefetch):
            prog.issue(f"all_gather block{nxt}", price["unit_gather"](nxt + 1))
        prog.compute(f"forward block{i}", p.block_forward_ms[i], [f"all_gather block{i}"])
    prog.compute("forward root-head", p.root_forward_ms[1])


def _fsdp_backward(prog: _Program, p: UnitProfile, price: dict[str, Any], regather: bool) -> None:
    n = len(p.block_bytes)
    blocks = list(reversed(range(n)))

    def gather(i: int) -> None:
        if regather:
            prog.issue(f"all_gather block{i} (backward)", price["unit_gather"](i + 1))

    def needs(i: int) -> list[str]:
        return [f"all_gather block{i} (backward)"] if regather else []

    if regather:  # the root was resharded too: backward's first unit needs it back
        prog.issue("all_gather root (backward)", price["unit_gather"](0))
    if prog.prefetch:
        gather(blocks[0])
    prog.compute(
        "backward root-head",
        p.root_backward_ms[1],
        ["all_gather root (backward)"] if regather else [],
    )
    for k, i in enumerate(blocks):
        if prog.prefetch and k + 1 < n:
            gather(blocks[k + 1])
        elif not prog.prefetch:
            gather(i)
        prog.compute(f"backward block{i}", p.block_backward_ms[i], needs(i))
        prog.issue(f"reduce_scatter block{i}", price["reduce_scatter"](p.block_bytes[i]))
    prog.compute("backward root-embed", p.root_backward_ms[0])
    prog.issue("reduce_scatter root", price["reduce_scatter"](p.root_bytes))
    prog.wait_all()


def simulate_sharded(
    profile: UnitProfile,
    method: str,
    link: Priced,
    world_size: int,
    *,
    backend: str = "nccl",
    prefetch: bool = True,
    bucket_cap_mb: float = 25.0,
    gather_link: Priced | None = None,
) -> ShardedPrediction:
    """Predict one step of ``method`` at ``world_size`` ranks (see the module docstring).

    ``gather_link`` prices all-gathers and ZeRO-1's broadcasts when they cost differently from
    the all-reduce on this machine (gloo's are separate algorithms); by default ``link`` prices
    all. On gloo, what ``profile.gather_ms`` and ``profile.broadcast_ms`` measured at this N
    takes their place.
    """
    method = check_choice("method", method, METHODS)
    backend = check_choice("backend", backend, BACKENDS)
    n = check_world_size(world_size)
    cap = check_positive("bucket_cap_mb", bucket_cap_mb) * MIB
    price = _prices(link, n, backend, gather_link)
    measured = profile.gather_ms.get(n) if backend == "gloo" else None
    units = (profile.root_bytes, *profile.block_bytes)
    price["unit_gather"] = (  # unit 0 the root, 1 + i block i
        (lambda u: measured[u] / 1e3) if measured else (lambda u: price["all_gather"](units[u]))
    )
    if n == 1:  # one rank: nothing to talk to
        price = dict.fromkeys(price, lambda s: 0.0)
    prog = _Program(prefetch)
    if method in ("ddp", "zero1"):
        prog.compute("forward", sum(profile.root_forward_ms) + sum(profile.block_forward_ms))
        _ddp_backward(prog, profile, price, cap)
    else:
        _fsdp_forward(prog, profile, price)
        _fsdp_backward(prog, profile, price, regather=method == "zero3")
    if profile.overhead_ms.get(method):
        prog.compute(f"{method} wrapper", profile.overhead_ms[method])
    prog.compute("optimizer", profile.optimizer(method, n))
    if method == "zero1":  # every owner's broadcasts, issued at once, waited for together
        if backend == "gloo" and n in profile.broadcast_ms:  # measured: no sum of single ones
            prog.issue("broadcast weights", profile.broadcast_ms[n] / 1e3)
        else:  # on one channel they pipeline, priced as one all-gather of every weight
            prog.issue("broadcast weights", price["all_gather"](profile.param_bytes))
        prog.wait_all()
    comm = sum(s.end_ms - s.start_ms for s in prog.spans if s.lane == "comm")
    compute = sum(s.end_ms - s.start_ms for s in prog.spans if s.lane == "compute")
    return ShardedPrediction(method, n, prog.cpu, compute, comm, tuple(prog.spans))


@dataclass(frozen=True)
class Zero3Cost:
    """ZeRO-3 against DDP on one fabric at one world size: the time it adds, the memory it saves.

    ``saved_bytes``: model state per rank DDP holds and ZeRO-3 does not, fp32 AdamW (16 bytes
    per parameter: weight, gradient and two moments, the recipe 09 measures; parameters counted
    from the bytes the profile gathers).
    """

    fabric: str
    world_size: int
    ddp_ms: float
    zero3_ms: float
    saved_bytes: float

    @property
    def extra_ms(self) -> float:
        return self.zero3_ms - self.ddp_ms

    @property
    def extra_fraction(self) -> float:
        return self.extra_ms / self.ddp_ms


def zero3_costs(
    profile: UnitProfile, fabrics: Sequence[Priced], *, bytes_per_param: float = 4.0
) -> list[Zero3Cost]:
    """ZeRO-3's extra step time and saved memory on each fabric (NCCL prices, prefetch on).

    Each fabric is a :class:`~dplab.sim.fabric.Fabric` (its world size is its own) or anything
    with ``allreduce_s`` and a ``world_size``. ``bytes_per_param`` is what the profile's weight
    bytes are per parameter (4: fp32; 2: bf16 gathers), to count the state saved at 16 bytes a
    parameter.
    """
    rows = []
    params = profile.param_bytes / check_positive("bytes_per_param", bytes_per_param)
    for fab in fabrics:
        n = fab.world_size  # type: ignore[attr-defined]
        ddp = simulate_sharded(profile, "ddp", fab, n).step_ms
        zero3 = simulate_sharded(profile, "zero3", fab, n).step_ms
        saved = 16 * params * (1 - 1 / n)
        rows.append(Zero3Cost(getattr(fab, "name", str(fab)), n, ddp, zero3, saved))
    return rows


def zero3_costs_more_at(rows: Sequence[Zero3Cost], max_extra: float = 0.10) -> int | None:
    """The smallest world size at which ZeRO-3 slows the step by more than ``max_extra``
    (0.10: 10 %), or ``None`` if it never does in ``rows`` (one fabric's rows)."""
    check_nonneg("max_extra", max_extra)
    over = [r.world_size for r in rows if r.extra_fraction > max_extra]
    return min(over) if over else None
