"""maxpool_to_sum: k-max-pool nodes become identity nodes summing their window.

A path through a k-max-pool neuron may enter through any antecedent (docs/math.md §2),
so in every path sum the window is summed: v = b_v + sum_{u in window} u.
"""

from __future__ import annotations

from dataclasses import replace

from pathir.ir import Graph, NodeKind

__all__ = ["maxpool_to_sum"]


def maxpool_to_sum(graph: Graph) -> Graph:
    """Requires: a verified graph. Ensures: no MAXPOOL node remains.
    Preserves: the set of paths and Phi (not the function R)."""
    nodes = [replace(n, kind=NodeKind.IDENTITY, k=1) if n.kind is NodeKind.MAXPOOL else n for n in graph.nodes]
    return graph.replace_nodes(nodes)
