"""``python -m dplab cluster --nodes K --ranks-per-node M --link-mbit R -- VERB …``: any verb on a
real multi-node cluster made of network namespaces on this machine.

    python -m dplab cluster --nodes 2 --ranks-per-node 2 --link-mbit 400 -- \\
        trace --model gpt-7m --steps 3 --out runs/slow-fabric/

runs ``python -m dplab trace …`` under torchrun on every node (the verb sees torchrun's
``RANK``/``WORLD_SIZE`` and traces its own rank; rank 0 writes the files), then adds
``cluster.json`` to the ``--out`` folder (the nodes, the link, which node each rank ran on, and
which hops of the ring cross a node link) and, for a trace, ``timeline_nodes.html``: the last
step of every rank, one panel per node. Needs root and iproute2 (see ``dplab.nodes``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from dplab.cli._args import CliError, check_ranks, fail, positive_float, positive_int

MAX_NODES = 250  # the switch's /24 subnet (dplab.nodes.Network)
LINK_MBIT_RANGE = (0.1, 100_000.0)  # what tc's tbf shapes faithfully (dplab.nodes.netns)


def ring_crossings(placement: list[int]) -> list[tuple[int, int]]:
    """The hops (r, r+1 mod N) of the rank ring whose two ends sit on different nodes.

    gloo's ring all-reduce sends from each rank to the next by rank number, so these are the
    hops every all-reduce (every bucket) pushes its bytes through a shaped node link.
    """
    n = len(placement)
    if n < 2:
        return []
    return [(r, (r + 1) % n) for r in range(n) if placement[r] != placement[(r + 1) % n]]


def _out_folder(rest: list[str]) -> str | None:
    for i, arg in enumerate(rest):
        if arg == "--out" and i + 1 < len(rest):
            return rest[i + 1]
        if arg.startswith("--out="):
            return arg.split("=", 1)[1]
    return None


def check_cluster_args(args: argparse.Namespace) -> int:
    """Every number, and the machine's room for the ranks, before a namespace is made: a bad
    one used to end in a traceback from deep inside ``Nodes``, and 2 nodes of 20 ranks started
    40 torch processes on 2 cores. Returns the world size."""
    nodes = positive_int("--nodes", args.nodes)
    if nodes > MAX_NODES:
        raise CliError(f"--nodes {nodes}: at most {MAX_NODES} nodes (one /24 subnet)")
    per_node = positive_int("--ranks-per-node", args.ranks_per_node)
    if args.link_mbit is not None:
        low, high = LINK_MBIT_RANGE
        rate = positive_float("--link-mbit", args.link_mbit)
        if not low <= rate <= high:
            raise CliError(
                f"--link-mbit {args.link_mbit!r}: a link is shaped between {low:g} and "
                f"{high:g} Mbit/s (omit --link-mbit for an unshaped link)"
            )
    positive_float("--timeout-s", args.timeout_s)
    return check_ranks(nodes * per_node, flag=f"--nodes {nodes} × --ranks-per-node {per_node}")


def cmd_cluster(args: argparse.Namespace) -> int:
    from dplab.nodes import Nodes, NodesUnavailable

    try:
        check_cluster_args(args)
    except CliError as e:
        return fail(str(e))
    rest = list(args.command)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        print("give the verb to run after --, e.g. `-- trace --out runs/x`", file=sys.stderr)
        return 2
    if rest[0] == "cluster":
        print("`cluster` cannot run inside a cluster", file=sys.stderr)
        return 2
    try:
        cluster = Nodes(
            args.nodes,
            args.ranks_per_node,
            link_mbit=args.link_mbit,
            timeout_s=args.timeout_s,
        )
    except NodesUnavailable as e:
        print(f"cannot build the nodes: {e}", file=sys.stderr)
        return 1
    with cluster:
        started = time.time()
        try:
            cluster.run_module("dplab", rest)
        except Exception as e:  # RankError, RendezvousError, RankTimeout: all say what failed
            print(f"FAILED on {cluster}: {e}", file=sys.stderr)
            return 1
        placement = list(cluster.placement)
    crossings = ring_crossings(placement)
    summary = _summary(args, rest, placement, crossings, time.time() - started)
    rate = "unshaped" if args.link_mbit is None else f"{args.link_mbit:g} Mbit/s"
    print(
        f"{len(placement)} ranks on {args.nodes} nodes ({args.ranks_per_node} per node), links "
        f"{rate}; ranks by node: {_by_node(placement)}"
    )
    if crossings:
        hops = ", ".join(f"{a}→{b}" for a, b in crossings)
        print(f"ring hops across a node link: {hops}: every all-reduce crosses the {rate} links")
    else:
        print("every ring hop stays inside a node: no all-reduce crosses a node link")
    out = _out_folder(rest)
    if out is not None and Path(out).is_dir():
        path = Path(out) / "cluster.json"
        path.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"  cluster: {path}")
        if list(Path(out).glob("rank*.json")):
            html = _node_timeline(Path(out), placement, crossings, rate)
            print(f"  timeline by node: {html}")
    return 0


def _node_timeline(
    out: Path, placement: list[int], crossings: list[tuple[int, int]], rate: str
) -> Path:
    """The last traced step of every rank, one panel per node, titled with the slow hops."""
    from dplab.trace import last_steps, load_run
    from dplab.trace.files import write_atomic
    from dplab.viz.timeline import timeline_figure

    steps = last_steps(load_run(out))
    nodes = sorted(set(placement))
    panels = [[s for s in steps if placement[s.rank] == k] for k in nodes]
    hops = ", ".join(f"{a}→{b}" for a, b in crossings) or "none"
    fig = timeline_figure(
        panels,
        panel_titles=[
            f"node {k}: ranks {', '.join(str(s.rank) for s in panel)}"
            for k, panel in zip(nodes, panels, strict=True)
        ],
        title=f"{len(steps)} ranks on {len(nodes)} nodes, links {rate}: every all-reduce "
        f"crosses them (ring hops {hops})",
    )
    return write_atomic(
        out / "timeline_nodes.html", fig.to_html(include_plotlyjs=True, full_html=True)
    )


def _by_node(placement: list[int]) -> str:
    nodes = sorted(set(placement))
    return "; ".join(
        f"node {k}: " + ",".join(str(r) for r, p in enumerate(placement) if p == k) for k in nodes
    )


def _summary(
    args: argparse.Namespace,
    rest: list[str],
    placement: list[int],
    crossings: list[tuple[int, int]],
    wall_s: float,
) -> dict[str, Any]:
    return {
        "format": "dplab.cluster/1",
        "command": "python -m dplab cluster " + " ".join(getattr(args, "argv", [])),
        "inner_command": "python -m dplab " + " ".join(rest),
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "link_mbit": args.link_mbit,
        "placement": placement,
        "ring_crossings": [list(c) for c in crossings],
        "wall_s": round(wall_s, 2),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster",
        help="run a verb on K network-namespace nodes with shaped links (root)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument(
        "--link-mbit", type=float, default=None, help="each node's link, Mbit/s each way"
    )
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- VERB ARGS… (e.g. -- trace …)")
    p.set_defaults(func=cmd_cluster)


add_parser = add_cli  # the name the brief asked for; dplab.cli's verbs use add_cli
