"""path_view(q): the path-norm network of docs/math.md §3.

Every free weight and bias w becomes |w|^q, every fixed weight c becomes |c|^q,
every ReLU becomes identity. Fed the all-ones input, the sum of its outputs is
sum_p |Phi_p(theta)|^q. With q = 0 every weight and existing bias becomes 1
(0^0 = 1): the sum of outputs is the number of paths.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pathir.errors import ArgumentError, PathirError
from pathir.ir import Graph, NodeKind

__all__ = ["path_view", "abs_pow"]


def abs_pow(q: float):
    """w -> |w|^q elementwise (|w|^0 = 1, also where w = 0: every edge counts as a path)."""
    if q == 1:
        return np.abs
    if q == 0:
        return np.ones_like
    return lambda w: np.abs(w) ** q


def path_view(graph: Graph, q: float = 1.0) -> Graph:
    """Requires: no MAXPOOL node (run maxpool_to_sum). Ensures: identity nodes only,
    every weight and bias non-negative. Preserves: the set of paths; Phi_p becomes |Phi_p|^q."""
    if q < 0:
        raise ArgumentError(f"path_view: q must be >= 0, got {q!r}")
    for n in graph.nodes:
        if n.kind is NodeKind.MAXPOOL:
            raise PathirError(f"path_view: node '{n.name}' is a maxpool; run maxpool_to_sum first")
    fn = abs_pow(q)
    nodes = []
    for n in graph.nodes:
        kind = NodeKind.INPUT if n.kind is NodeKind.INPUT else NodeKind.IDENTITY
        edges = tuple(replace(e, map=e.map.with_weights(fn)) for e in n.edges)
        bias = None if n.bias is None else n.bias.with_value(fn(n.bias.value))
        nodes.append(replace(n, kind=kind, edges=edges, bias=bias))
    return graph.replace_nodes(nodes)
