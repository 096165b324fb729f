"""Exhaustive path enumeration: the definition every fast path is tested against.

On the neuron-level DAG of :func:`pathir.neurons.expand.expand` (small graphs only),
following docs/math.md §2:

- a path p = (v_0 -> ... -> v_d) ends at an output neuron (and may go on
  through it when the output feeds other neurons); parallel neuron edges are
  different paths;
- it starts at an input neuron (beta = 1), or at a non-input neuron that has a
  bias (beta = b_{v_0}; d = 0 allowed). A neuron without a bias has b = 0 and
  starts no path: its paths would have Phi_p = 0, and path counts (docs/math.md §3)
  set only the *existing* biases to 1;
- Phi_p(theta) = beta(v_0) * prod of the weights along p;
- a_p(theta, x) = 1 iff every ReLU neuron of p (v_0 included) has pre-activation
  > 0 and every edge of p into a k-max-pool neuron is its selected antecedent:
  the first, in :func:`pathir.neurons.expand.antecedents` order, whose weighted input
  equals the k-th largest;
- A[p, i] = 1 if p starts at input neuron i, A[p, "1"] = 1 for a bias path;
- lifting identity: R(x)_o = sum over p ending at o of Phi_p a_p (A [x; 1])_p.

Everything here is plain Python over explicit paths: slow, obvious, exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Union

import networkx as nx
import numpy as np

from pathir.errors import ArgumentError, GraphTooLarge, InputShapeError, PathirError
from pathir.ir import Graph, NodeKind
from pathir.neurons.expand import Neuron, antecedents, expand

__all__ = [
    "Path", "NeuronValues", "DEFAULT_MAX_PATHS",
    "starts", "count_paths", "enumerate_paths", "phi", "neuron_forward", "activations", "input_incidence",
    "enumerate_path_norm", "enumerate_num_paths", "lifted_output", "multiplicities",
]

DEFAULT_MAX_PATHS = 200_000

GraphLike = Union[Graph, nx.MultiDiGraph]


@dataclass(frozen=True)
class Path:
    """Neurons v_0..v_d and the key of each edge v_{l-1} -> v_l (parallel edges differ by key)."""

    neurons: tuple[Neuron, ...]
    keys: tuple[int, ...]

    @property
    def start(self) -> Neuron:
        return self.neurons[0]

    @property
    def end(self) -> Neuron:
        return self.neurons[-1]

    def edges(self) -> Iterator[tuple[Neuron, Neuron, int]]:
        return zip(self.neurons[:-1], self.neurons[1:], self.keys)


def _net(graph: GraphLike) -> nx.MultiDiGraph:
    return graph if isinstance(graph, nx.DiGraph) else expand(graph)


def starts(net: nx.MultiDiGraph) -> list[Neuron]:
    """Neurons where paths start: every input neuron and every neuron with a bias, in order."""
    return [v for v, d in net.nodes(data=True) if d["is_input"] or d["bias"] is not None]


def count_paths(net: nx.MultiDiGraph) -> int:
    """Exact number of paths (a Python int), by dynamic programming over suffixes."""
    suffixes: dict[Neuron, int] = {}
    for v in reversed(list(net.nodes)):  # nodes are in topological order
        suffixes[v] = int(net.nodes[v]["is_output"]) + sum(suffixes[w] for _, w in net.out_edges(v))
    return sum(suffixes[v] for v in starts(net))


def enumerate_paths(net: nx.MultiDiGraph, max_paths: int = DEFAULT_MAX_PATHS) -> list[Path]:
    """Every path, depth first from each start in order, out-edges in insertion order.

    Raises GraphTooLarge when there are more than ``max_paths`` paths."""
    total = count_paths(net)
    if total > max_paths:
        raise GraphTooLarge(f"graph '{net.name}' has {total:,} paths, above the limit max_paths={max_paths:,} of path enumeration")
    out: list[Path] = []
    for v0 in starts(net):
        stack = [((v0,), ())]
        while stack:
            neurons, keys = stack.pop()
            v = neurons[-1]
            if net.nodes[v]["is_output"]:
                out.append(Path(neurons, keys))
            for _, w, key in reversed(list(net.out_edges(v, keys=True))):
                stack.append((neurons + (w,), keys + (key,)))
    return out


def phi(net: nx.MultiDiGraph, paths: list[Path]) -> np.ndarray:
    """Phi(theta): beta(v_0) times the product of the weights along each path."""
    out = np.empty(len(paths))
    for i, p in enumerate(paths):
        start = net.nodes[p.start]
        value = 1.0 if start["is_input"] else start["bias"][2]
        for u, v, key in p.edges():
            value *= net.edges[u, v, key]["weight"]
        out[i] = value
    return out


@dataclass
class NeuronValues:
    """One sample through the neuron DAG: pre-activation and output of every
    neuron, and for each k-max-pool neuron its selected in-edge (source, key)."""

    pre: dict[Neuron, float]
    out: dict[Neuron, float]
    selected: dict[Neuron, tuple[Neuron, int]]


def neuron_forward(net: nx.MultiDiGraph, x: dict[str, np.ndarray]) -> NeuronValues:
    """The network of docs/math.md §1 neuron by neuron; ``x``: {input name: one sample of its shape}."""
    flat = {name: np.asarray(value, dtype=np.float64).reshape(-1).tolist() for name, value in x.items()}
    return walk_neurons(net, flat, weight=lambda data: data["weight"],
                           bias=lambda d: 0.0 if d["bias"] is None else d["bias"][2],
                           total=sum, relu=lambda a: max(0.0, a))


def walk_neurons(net: nx.MultiDiGraph, flat, weight, bias, total, relu) -> NeuronValues:
    """`neuron_forward` in any arithmetic: ``flat`` {input name: its entries, flat}, ``weight(edge data)``,
    ``bias(node data)``, ``total(values)`` their sum, ``relu(value)`` (the sympy backend reads exact numbers).
    A k-max-pool selects the first antecedent, in `antecedents` order, at the k-th largest input."""
    pre, out, selected = {}, {}, {}
    for v, d in net.nodes(data=True):
        if d["is_input"]:
            pre[v] = out[v] = flat[v[0]][v[1]]
            continue
        b = bias(d)
        terms = [(u, key, weight(data) * out[u]) for u, key, data in antecedents(net, v)]
        if d["kind"] is NodeKind.MAXPOOL:
            if len(terms) < d["k"]:
                raise PathirError(f"neuron {v}: a {d['k']}-max-pool over {len(terms)} antecedents")
            kth = sorted((t[2] for t in terms), reverse=True)[d["k"] - 1]
            u, key, _ = next(t for t in terms if t[2] == kth)
            selected[v] = (u, key)
            pre[v] = b + kth
        else:
            pre[v] = b + total(t[2] for t in terms)
        out[v] = relu(pre[v]) if d["kind"] is NodeKind.RELU else pre[v]
    return NeuronValues(pre, out, selected)


def activations(net: nx.MultiDiGraph, paths: list[Path], values: NeuronValues) -> np.ndarray:
    """a(theta, x) in {0, 1} per path, for the sample that produced ``values``."""
    a = np.ones(len(paths))
    for i, p in enumerate(paths):
        relu_off = any(net.nodes[v]["kind"] is NodeKind.RELU and not values.pre[v] > 0 for v in p.neurons)
        not_selected = any(
            net.nodes[v]["kind"] is NodeKind.MAXPOOL and values.selected[v] != (u, key) for u, v, key in p.edges()
        )
        if relu_off or not_selected:
            a[i] = 0.0
    return a


def input_incidence(net: nx.MultiDiGraph, paths: list[Path]) -> tuple[np.ndarray, list]:
    """A (paths x (inputs + 1)) and its column labels: the input neurons in order, then "1"."""
    columns = [v for v, d in net.nodes(data=True) if d["is_input"]]
    col = {v: i for i, v in enumerate(columns)}
    A = np.zeros((len(paths), len(columns) + 1), dtype=np.int64)
    for i, p in enumerate(paths):
        A[i, col.get(p.start, len(columns))] = 1
    return A, columns + ["1"]


def enumerate_path_norm(graph: GraphLike, q: float, max_paths: int = DEFAULT_MAX_PATHS) -> float:
    """(sum_p |Phi_p|^q)^(1/q) over the enumerated paths (q > 0; q = inf: max_p |Phi_p|).

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> y = b.identity("y", [(x, Dense(b.param("w", [[3.0, -4.0]])))], bias=b.param("b", [12.0]))
    >>> enumerate_path_norm(b.build(outputs=[y]), 2)   # sqrt(3^2 + 4^2 + 12^2)
    13.0
    """
    if not q > 0:
        raise ArgumentError(f"q must be > 0 (math.inf for max_p |Phi_p|), got {q!r}")
    net = _net(graph)
    paths = enumerate_paths(net, max_paths)
    values = phi(net, paths)
    if q == math.inf:
        return float(np.abs(values).max(initial=0.0))
    return math.fsum(np.abs(values) ** q * multiplicities(net, paths)) ** (1.0 / q)


def multiplicities(net: nx.MultiDiGraph, paths: list[Path]) -> np.ndarray:
    """How many times each path's end is listed among the graph's outputs (2 for y in ``return y, y``): the
    paths of the output vector a neuron path stands for, each counted in path counts and path-norms."""
    return np.array([net.nodes[p.end].get("multiplicity", 1) for p in paths], dtype=np.int64)


def enumerate_num_paths(graph: GraphLike, max_paths: int = DEFAULT_MAX_PATHS) -> int:
    """Number of enumerated paths (input paths and paths of existing biases), each counted once per listing of
    its end among the outputs."""
    net = _net(graph)
    return int(multiplicities(net, enumerate_paths(net, max_paths)).sum())


def lifted_output(graph: Graph, x, max_paths: int = DEFAULT_MAX_PATHS) -> dict[str, np.ndarray]:
    """R(x) through the lifting identity, sum_p Phi_p a_p(x) (A [x; 1])_p per output neuron.

    ``x`` as for :func:`pathir.lifting.walk.forward`: one array (B, *input shape) or
    {input name: array}. Returns {output name: array (B, *output shape)}."""
    if not isinstance(x, dict):
        if len(graph.inputs) != 1:
            raise InputShapeError(f"x: the graph has inputs {list(graph.inputs)}: pass a dict {{input name: array}}")
        x = {graph.inputs[0]: x}
    x = {name: np.asarray(value, dtype=np.float64) for name, value in x.items()}
    net = expand(graph)
    paths = enumerate_paths(net, max_paths)
    Phi = phi(net, paths)
    A, columns = input_incidence(net, paths)
    batch = next(iter(x.values())).shape[0]
    out = {o: np.zeros((batch, graph.node(o).numel)) for o in graph.outputs}
    for b in range(batch):
        sample = {name: value[b] for name, value in x.items()}
        x1 = np.array([sample[v[0]].reshape(-1)[v[1]] for v in columns[:-1]] + [1.0])
        terms = Phi * activations(net, paths, neuron_forward(net, sample)) * (A @ x1)
        for p, t in zip(paths, terms):
            name, j = p.end
            out[name][b, j] += t
    return {o: out[o].reshape(batch, *graph.node(o).shape) for o in graph.outputs}
