"""remove_dead: drop the dead channels of hidden nodes.

A channel c of a hidden ReLU or identity node v is *dead* when

- it is always 0: every weight entering c and its bias (if any) are 0, so its
  pre-activation is 0 for every input, and so is its output (ReLU(0) = 0); or
- nothing reads it: every weight leaving c is 0.

Either way c adds nothing to any output, and every path through it has
Φ_p = 0 (it crosses a zero weight, or starts at a zero bias). Removing c means
removing its rows of the incoming weights, its bias entry and its columns of
the outgoing weights. Removing a channel can make another one dead (a neuron
fed only by dead ones), so the pass repeats until nothing changes.

Only channels whose removal stays local are touched: v is neither an input
nor an output, every edge into and out of v is a dense map or a convolution
with groups = 1, and each of those weights is read by that edge alone (no
weight sharing across edges). A node keeps at least one channel.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pathir.ir import Conv, Dense, Edge, Graph, NodeKind, Param

__all__ = ["remove_dead"]


def _local(m) -> bool:
    return isinstance(m, Dense) or (isinstance(m, Conv) and m.groups == 1)


def _source_axis_groups(m, src_shape) -> list[np.ndarray]:
    """For each source channel, the weight indices along axis 1 that read it."""
    if isinstance(m, Conv):
        return [np.array([c]) for c in range(src_shape[0])]
    per = int(np.prod(src_shape[1:], dtype=np.int64))
    return [np.arange(c * per, (c + 1) * per) for c in range(src_shape[0])]


def _dead_channels(graph: Graph, uses: dict[int, int]) -> dict[str, np.ndarray]:
    """{node name: kept channel indices} for every node that has a dead channel to drop."""
    keep: dict[str, np.ndarray] = {}
    for v in graph.nodes:
        if v.kind not in (NodeKind.RELU, NodeKind.IDENTITY) or v.name in graph.outputs:
            continue
        out_edges = [(w, w.edges[i]) for w, i in graph.consumers[v.name]]
        edges = list(v.edges) + [e for _, e in out_edges]
        if not all(_local(e.map) and uses[id(e.map.weight)] == 1 for e in edges):
            continue
        if v.bias is not None and uses[id(v.bias)] != 1:
            continue
        zero_in = np.ones(v.channels, dtype=bool)
        for e in v.edges:
            W = e.map.weight.value
            zero_in &= ~W.reshape(W.shape[0], -1).any(axis=1)
        if v.bias is not None:
            zero_in &= v.bias.value == 0
        zero_out = np.ones(v.channels, dtype=bool)
        for _, e in out_edges:
            W = e.map.weight.value
            for c, cols in enumerate(_source_axis_groups(e.map, v.shape)):
                zero_out[c] &= not W[:, cols].any()
        dead = zero_in | zero_out
        if dead.all():
            dead[0] = False  # a node keeps one channel
        if dead.any():
            keep[v.name] = np.flatnonzero(~dead)
    return keep


def _sliced(p: Param, value: np.ndarray) -> Param:
    if value.shape == p.shape:
        return p
    # the value no longer has the source tensor's shape: no write-back binding
    return Param(p.name, value, (), f"{p.name} without its dead channels")


def _rebuild(graph: Graph, keep: dict[str, np.ndarray]) -> Graph:
    nodes = []
    for v in graph.nodes:
        rows = keep.get(v.name)
        edges = []
        for e in v.edges:
            cols = keep.get(e.source)
            if rows is None and cols is None:
                edges.append(e)
                continue
            W = e.map.weight.value
            if rows is not None:
                W = W[rows]
            if cols is not None:
                groups = _source_axis_groups(e.map, graph.node(e.source).shape)
                W = W[:, np.concatenate([groups[c] for c in cols])]
            edges.append(Edge(e.source, replace(e.map, W=_sliced(e.map.weight, W))))
        if rows is None:
            nodes.append(replace(v, edges=tuple(edges)))
            continue
        bias = None if v.bias is None else _sliced(v.bias, v.bias.value[rows])
        nodes.append(replace(v, shape=(rows.size, *v.shape[1:]), edges=tuple(edges), bias=bias))
    return graph.replace_nodes(nodes)


def remove_dead(graph: Graph) -> Graph:
    """Remove dead channels (module docstring) until none is left.

    Requires: a verified graph. Ensures: no removable dead channel remains; the
    graph verifies. Preserves: the function R_θ(x), exactly, and every path-norm
    (only paths with Φ_p = 0 go); the number of paths drops. Params whose shape
    changed lose their write-back binding (``sources``).

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder("mlp")
    >>> x = b.input("x", (2,))
    >>> w1 = [[1.0, 2.0], [0.0, 0.0], [3.0, -1.0]]          # neuron h[1] gets nothing...
    >>> h = b.relu("h", [(x, Dense(b.param("fc1.weight", w1)))], bias=b.param("fc1.bias", [0.5, 0.0, 0.0]))
    >>> y = b.identity("y", [(h, Dense(b.param("fc2.weight", [[1.0, 5.0, 0.0]])))])   # ...h[2] feeds nothing
    >>> print(remove_dead(b.build(outputs=[y])))
    mlp(inputs=[x], outputs=[y])
      0  x: input[2]
      1  h: relu[1] = dense(fc1.weight)(x) + bias(fc1.bias)
      2  y: identity[1] = dense(fc2.weight)(h)
    """
    while True:
        uses: dict[int, int] = {}
        for v in graph.nodes:
            for p in [e.map.weight for e in v.edges if e.map.weight is not None] + ([v.bias] if v.bias is not None else []):
                uses[id(p)] = uses.get(id(p), 0) + 1
        keep = _dead_channels(graph, uses)
        if not keep:
            return graph
        graph = _rebuild(graph, keep)
