"""The neuron-level expansion of a Graph: one networkx node per neuron, one edge per weight.

This is the DAG G = (N, E) of docs/math.md §1 itself, for small graphs only (exact
path enumeration, the incidence matrix A, the sympy backend). Above
``max_neurons`` or ``max_edges`` :func:`expand` raises :class:`pathir.GraphTooLarge`.

Neurons are ``(node name, flat index in C order)``, with attributes

    kind       NodeKind of the node
    k          the k of a k-max-pool (1 for the other kinds)
    bias       (param name, channel, value), or None when the node has no bias
    is_input, is_output
    multiplicity  how many times the graph's outputs list the neuron's node (0 for a hidden one; 2 where a
               model returns (y, y): a path ending there is two paths of the output vector, and counts twice
               in path counts and path-norms, as in pathir's walks)
    order      (position of the node in graph.nodes, flat index): the
               lexicographic order of "first antecedent" (docs/math.md §2)

The result is a ``networkx.MultiDiGraph`` (a DiGraph subclass): two IR edges
between the same nodes, e.g. ``relu(W x + x)``, give two parallel neuron edges,
which are two different paths. The edge key is the index of the IR edge in its
target node's ``edges``. Edge attributes:

    weight     the value (a free weight's entry, or the constant of a fixed map)
    param      (param name, flat index) of the weight entry read, None for a fixed weight
    map        the MapKind of the IR edge

Edges come from the numpy backend's rules, the same way for every MapKind, with
M = apply(map, basis vectors):

- structure: S = M computed with every weight (free or fixed, nonzero) set to 1;
  S[j, t] counts the weight entries edge j -> t reads, so S in {0, 1} and the
  edges are its ones (a free weight that happens to be 0 keeps its edge, as it
  keeps its paths);
- for a parameterized map, the entry read: M computed with weight entry i set
  to i + 1 (exact integers in float64);
- the value: the param entry, or M itself for a fixed map.

Insertion order is deterministic: neurons in ``order``; for each target neuron
its in-edges sorted by (source order, key), so ``net.in_edges(v)`` lists the
antecedents of a max-pool neuron in lexicographic order (see :func:`antecedents`).
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np

from pathir.backends.numpy import NumpyBackend
from pathir.errors import GraphTooLarge, PathirError
from pathir.ir import PARAMETERIZED, Graph, Map, NodeKind

__all__ = ["expand", "antecedents", "count_edges", "Neuron", "DEFAULT_MAX_NEURONS", "DEFAULT_MAX_EDGES"]

Neuron = tuple[str, int]

DEFAULT_MAX_NEURONS = 20_000
DEFAULT_MAX_EDGES = 500_000
_BLOCK = 1 << 20  # entries of basis-times-output per apply, to bound memory


def _backend():
    return NumpyBackend()


def _ones(m: Map) -> Map:
    return m.with_weights(np.ones_like)


def _entry_ids(m: Map) -> Map:
    return m.with_weights(lambda w: np.arange(1, w.size + 1, dtype=np.float64).reshape(w.shape))


def count_edges(m: Map, in_shape) -> int:
    """Number of neuron edges of one IR edge: 1^T S 1 (one apply on the all-ones input)."""
    be = _backend()
    return int(round(float(be.apply(_ones(m), np.ones((1, *in_shape)), in_shape).sum())))


def _map_edges(m: Map, in_shape) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(source index, target index, weight, param entry or -1) of every neuron edge of ``m``."""
    be = _backend()
    in_shape = tuple(in_shape)
    n_in = math.prod(in_shape)
    n_out = math.prod(m.out_shape(in_shape))
    free = m.kind in PARAMETERIZED
    ones, ids = _ones(m), (_entry_ids(m) if free else None)
    step = max(1, _BLOCK // max(1, n_out))
    parts = []
    for start in range(0, n_in, step):
        rows = np.arange(start, min(n_in, start + step))
        basis = np.zeros((rows.size, n_in))
        basis[np.arange(rows.size), rows] = 1.0
        basis = basis.reshape(rows.size, *in_shape)
        S = be.apply(ones, basis, in_shape).reshape(rows.size, n_out)
        if np.any(S > 1):
            raise PathirError(f"{m.describe()}: a (source, target) neuron pair reads several weight entries")
        r, t = np.nonzero(S)
        if free:
            entry = be.apply(ids, basis, in_shape).reshape(rows.size, n_out)[r, t].astype(np.int64) - 1
            weight = m.weight.value.reshape(-1)[entry]
        else:
            entry = np.full(r.size, -1, dtype=np.int64)
            weight = be.apply(m, basis, in_shape).reshape(rows.size, n_out)[r, t]
        parts.append((rows[r], t, weight, entry))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0), empty
    return tuple(np.concatenate(p) for p in zip(*parts))


def _check_size(graph: Graph, max_neurons: int, max_edges: int) -> None:
    neurons = sum(n.numel for n in graph.nodes)
    if neurons > max_neurons:
        raise GraphTooLarge(
            f"graph '{graph.name}' has {neurons:,} neurons, above the limit max_neurons={max_neurons:,} "
            "of the neuron-level expansion (meant for small graphs; use the tensor-level passes)"
        )
    edges = sum(count_edges(e.map, graph.node(e.source).shape) for n in graph.nodes for e in n.edges)
    if edges > max_edges:
        raise GraphTooLarge(
            f"graph '{graph.name}' has {edges:,} neuron edges, above the limit max_edges={max_edges:,} "
            "of the neuron-level expansion (meant for small graphs; use the tensor-level passes)"
        )


def expand(graph: Graph, max_neurons: int = DEFAULT_MAX_NEURONS, max_edges: int = DEFAULT_MAX_EDGES) -> nx.MultiDiGraph:
    """The neuron-level DAG of ``graph`` (see the module docstring for its attributes).

    Parameters
    ----------
    graph : Graph
    max_neurons, max_edges : size limits; above them GraphTooLarge is raised
        before any work.

    Returns
    -------
    networkx.MultiDiGraph
        Nodes ``(node name, flat index)``, edges keyed by the IR edge index.

    Examples
    --------
    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense, Identity
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("w", [[1.0, 2.0], [3.0, 4.0]]))), (x, Identity())])
    >>> net = expand(b.build(outputs=[h]))
    >>> net.number_of_nodes(), net.number_of_edges()
    (4, 6)
    >>> for u, v, key, data in net.in_edges(("h", 1), keys=True, data=True):
    ...     print(u, "->", v, key, data["weight"], data["param"])
    ('x', 0) -> ('h', 1) 0 3.0 ('w', 2)
    ('x', 1) -> ('h', 1) 0 4.0 ('w', 3)
    ('x', 1) -> ('h', 1) 1 1.0 None
    """
    _check_size(graph, max_neurons, max_edges)
    net = nx.MultiDiGraph(name=graph.name)
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    outputs = set(graph.outputs)
    listed = {name: graph.outputs.count(name) for name in outputs}  # a model that returns (y, y) lists y twice
    for i, node in enumerate(graph.nodes):
        per_channel = math.prod(node.shape[1:])
        for j in range(node.numel):
            c = j // per_channel
            bias = None if node.bias is None else (node.bias.name, c, float(node.bias.value[c]))
            net.add_node(
                (node.name, j), kind=node.kind, k=node.k, bias=bias,
                is_input=node.kind is NodeKind.INPUT, is_output=node.name in outputs, order=(i, j),
                multiplicity=listed.get(node.name, 0),
            )
    for node in graph.nodes:
        rows = []  # (target, source position, source index, key, weight, entry)
        for key, e in enumerate(node.edges):
            s, t, w, entry = _map_edges(e.map, graph.node(e.source).shape)
            rows.extend(zip(t.tolist(), [position[e.source]] * len(t), s.tolist(), [key] * len(t), w.tolist(), entry.tolist()))
        rows.sort(key=lambda r: r[:4])
        for t, _, s, key, w, entry in rows:
            e = node.edges[key]
            param = None if entry < 0 else (e.map.weight.name, entry)
            net.add_edge((e.source, s), (node.name, t), key=key, weight=w, param=param, map=e.map.kind)
    return net


def antecedents(net: nx.MultiDiGraph, v: Neuron) -> list[tuple[Neuron, int, dict]]:
    """In-edges of neuron ``v`` as (source, key, attributes), sorted by (source order, key).

    For a k-max-pool neuron, "the lexicographically first antecedent attaining
    the k-th max" (docs/math.md §2) is first in this list."""
    edges = [(u, key, data) for u, _, key, data in net.in_edges(v, keys=True, data=True)]
    return sorted(edges, key=lambda e: (net.nodes[e[0]]["order"], e[1]))
