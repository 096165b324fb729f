"""GraphBuilder: the small helper frontends and tests use to wire a Graph."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from pathir.errors import ArgumentError

from .graph import Graph
from .maps import Map
from .node import Edge, Node, NodeKind
from .param import Param, SourceRef
from .verify import _map_problem, verify

__all__ = ["GraphBuilder"]


def _dims(shape: Sequence, what: str) -> tuple[int, ...]:
    """``shape`` as whole numbers; a fraction (2.7) is refused, never truncated."""
    dims = tuple(shape)
    if not all(isinstance(d, (int, np.integer)) or (isinstance(d, (float, np.floating)) and float(d).is_integer())
               for d in dims):
        raise ArgumentError(f"{what}: shape {list(dims)} must hold whole numbers")
    return tuple(int(d) for d in dims)


class GraphBuilder:
    """Append nodes in topological order, then ``build()`` a verified Graph.

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("w1", np.ones((3, 2)))))], bias=b.param("b1", np.zeros(3)))
    >>> y = b.identity("y", [(h, Dense(b.param("w2", np.ones((1, 3)))))])
    >>> print(b.build(outputs=[y]))
    graph(inputs=[x], outputs=[y])
      0  x: input[2]
      1  h: relu[3] = dense(w1)(x) + bias(b1)
      2  y: identity[1] = dense(w2)(h)
    """

    def __init__(self, name: str = "graph"):
        self.name = name
        self._nodes: dict[str, Node] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return self._nodes[name].shape

    def kind(self, name: str) -> NodeKind:
        """The kind of the node ``name`` already built."""
        return self._nodes[name].kind

    def __contains__(self, name: str) -> bool:
        return name in self._nodes

    def unique(self, name: str) -> str:
        """``name``, or ``name_1``, ``name_2``... if taken."""
        return unique_name(name, self._nodes)

    @staticmethod
    def param(name: str, value, source: str | None = None, how: str = "") -> Param:
        refs = (SourceRef(source if source is not None else name),)
        return Param(name, np.asarray(value, dtype=np.float64), refs, how)

    def input(self, name: str, shape: Sequence[int], origin: str = "") -> str:
        return self.add(Node(self.unique(name), NodeKind.INPUT, _dims(shape, f"input '{name}'"), origin=origin))

    def node(
        self,
        name: str,
        kind: NodeKind,
        edges: Iterable[tuple[str, Map]],
        bias: Param | None = None,
        k: int = 1,
        origin: str = "",
        shape: Sequence[int] | None = None,
    ) -> str:
        """Add a node; its shape is inferred from the first edge unless given."""
        edges = tuple(Edge(src, m) for src, m in edges)
        if shape is None:
            if not edges:
                raise ArgumentError(f"node '{name}': give a shape or at least one edge")
            source = edges[0].source
            if source not in self._nodes:
                raise ArgumentError(f"node '{name}': its first edge reads '{source}', which is not defined before it")
            bad = _map_problem(edges[0].map)
            if bad:
                raise ArgumentError(f"node '{name}': its first edge ({edges[0].map.describe()}): {bad}")
            try:
                shape = edges[0].map.out_shape(self._nodes[source].shape)
            except (ValueError, TypeError, ZeroDivisionError, IndexError) as err:
                raise ArgumentError(f"node '{name}': its first edge ({edges[0].map.describe()}) does not fit "
                                    f"'{source}' {list(self._nodes[source].shape)}: {err}") from None
        node = Node(self.unique(name), kind, _dims(shape, f"node '{name}'"), edges, bias, k, origin)
        return self.add(node)

    def identity(self, name, edges, bias=None, **kw) -> str:
        return self.node(name, NodeKind.IDENTITY, edges, bias, **kw)

    def relu(self, name, edges, bias=None, **kw) -> str:
        return self.node(name, NodeKind.RELU, edges, bias, **kw)

    def maxpool(self, name, source: str, window: Map, k: int = 1, bias=None, **kw) -> str:
        return self.node(name, NodeKind.MAXPOOL, [(source, window)], bias, k=k, **kw)

    def add(self, node: Node) -> str:
        if node.name in self._nodes:
            raise ArgumentError(f"node '{node.name}' defined twice")
        self._nodes[node.name] = node
        return node.name

    def build(self, outputs: Sequence[str], check: bool = True, prune_dead: bool = False) -> Graph:
        """The Graph; with ``prune_dead`` the nodes that reach no output are dropped."""
        nodes = tuple(self._nodes.values())
        if prune_dead:
            live = set(outputs)
            for n in reversed(nodes):
                if n.name in live:
                    live.update(e.source for e in n.edges)
            nodes = tuple(n for n in nodes if n.name in live or n.kind.value == "input")
        graph = Graph(nodes, tuple(outputs), self.name)
        return verify(graph) if check else graph


def unique_name(name: str, taken) -> str:
    """``name``, or ``name_1``, ``name_2``... whichever is first not in ``taken``."""
    if name not in taken:
        return name
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"
