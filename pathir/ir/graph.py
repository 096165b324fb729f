"""The Graph: nodes in topological order, and its text form.

Printer grammar (one numbered line per node, deterministic)::

    graph(inputs=[x], outputs=[fc])
       0  x: input[3,32,32]
       1  conv1: relu[16,32,32] = conv(conv1.weight, p=[[1,1],[1,1]])(x) + bias(conv1.bias)
       2  pool: maxpool[16,16,16] = window[2,2]/s[2,2](conv1)
       3  fc: identity[10] = dense(fc.weight)(pool) + bias(fc.bias)

A node line is ``index  name: kind[shape] = term + term ...``; a term is
``map(source)`` or ``bias(param)``; a k-max-pool with k > 1 prints ``maxpool2``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from types import MappingProxyType
from typing import Iterable, Iterator, Mapping

from pathir.errors import ArgumentKeyError

from .node import Node, NodeKind
from .param import Param

__all__ = ["Graph"]


@dataclass(frozen=True, eq=False)
class Graph:
    """An immutable ReLU DAG at tensor granularity. Passes return new Graphs."""

    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    name: str = "graph"

    def __post_init__(self):
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "outputs", tuple(self.outputs))

    # ------------------------------------------------------------- lookup
    @cached_property
    def _by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        try:
            return self._by_name[name]
        except KeyError:
            raise ArgumentKeyError(f"no node named '{name}' in the graph") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes if n.kind is NodeKind.INPUT)

    @cached_property
    def consumers(self) -> Mapping[str, tuple[tuple[Node, int], ...]]:
        """node name -> ((consumer node, index of the edge in consumer.edges), ...): read-only, as the graph is
        (a pass that popped these lists as a worklist emptied them for every later pass on the graph)."""
        out: dict[str, list[tuple[Node, int]]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i, e in enumerate(n.edges):
                out.setdefault(e.source, []).append((n, i))
        return MappingProxyType({k: tuple(v) for k, v in out.items()})

    def is_hidden(self, name: str) -> bool:
        return name not in self.outputs and self.node(name).kind is not NodeKind.INPUT

    # ------------------------------------------------------------- params
    def params(self) -> list[Param]:
        """Every distinct free param once, in flat order (node order; edges, then bias).

        This order defines the flat parameter vector theta of docs/math.md."""
        seen: set[int] = set()
        out = []
        for n in self.nodes:
            for p in n.params():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def num_params(self) -> int:
        return sum(p.size for p in self.params())

    # ------------------------------------------------------------- rebuild
    def replace_nodes(self, nodes: Iterable[Node], outputs: Iterable[str] | None = None) -> "Graph":
        return Graph(tuple(nodes), tuple(self.outputs if outputs is None else outputs), self.name)

    def map_params(self, fn) -> "Graph":
        """A new graph with every free Param p replaced by fn(p) (called once per param)."""
        memo: dict[int, Param] = {}

        def sub(p: Param | None) -> Param | None:
            if p is None:
                return None
            if id(p) not in memo:
                memo[id(p)] = fn(p)
            return memo[id(p)]

        nodes = []
        for n in self.nodes:
            edges = tuple(
                replace(e, map=replace(e.map, W=sub(e.map.weight))) if e.map.weight is not None else e
                for e in n.edges
            )
            nodes.append(replace(n, edges=edges, bias=sub(n.bias)))
        return self.replace_nodes(nodes)

    # ------------------------------------------------------------- text
    def __str__(self) -> str:
        lines = [f"{self.name}(inputs=[{', '.join(self.inputs)}], outputs=[{', '.join(self.outputs)}])"]
        width = len(str(len(self.nodes)))
        for i, n in enumerate(self.nodes):
            kind = n.kind.value + (str(n.k) if n.kind is NodeKind.MAXPOOL and n.k != 1 else "")
            head = f"  {i:>{width}}  {n.name}: {kind}[{','.join(map(str, n.shape))}]"
            terms = [f"{e.map.describe()}({e.source})" for e in n.edges]
            if n.bias is not None:
                terms.append(f"bias({n.bias.name})")
            lines.append(head + (" = " + " + ".join(terms) if terms else ""))
        return "\n".join(lines)

    __repr__ = __str__
