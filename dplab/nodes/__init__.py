"""Real multi-node runs on one machine: nodes in network namespaces, links shaped with ``tc``.

    ok, why = dplab.nodes.nodes_available()        # root and iproute2 needed
    with dplab.nodes.Nodes(2, ranks_per_node=2, link_mbit=400) as cluster:
        results = cluster.run(fn, *args)            # fn on 4 torchrun ranks, results by rank

Ranks of one node talk over its loopback, nodes over their shaped link: the two-level fabric of
a real cluster, measured rather than simulated. See :mod:`dplab.nodes.netns` for the layout.
"""

from dplab.nodes.netns import (
    Network,
    Node,
    NodesUnavailable,
    nodes_available,
    ours,
    remove_leftovers,
    tbf_burst_bytes,
)
from dplab.nodes.run import Nodes, RendezvousError

__all__ = [
    "Network",
    "Node",
    "Nodes",
    "NodesUnavailable",
    "RendezvousError",
    "nodes_available",
    "ours",
    "remove_leftovers",
    "tbf_burst_bytes",
]
