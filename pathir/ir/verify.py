"""The IR verifier."""

from __future__ import annotations

import numpy as np

from ..errors import GraphVerificationError
from .graph import Graph
from .maps import Map, MapKind, pool_output_size
from .node import Edge, NodeKind
from .param import Param

__all__ = ["verify", "smallest_window"]


def verify(graph: Graph) -> Graph:
    """Check every invariant of the IR; return the graph unchanged or raise.

    Checks:
      1. node names are unique and non-empty;
      2. every edge reads a node defined earlier (topological order, hence acyclic);
      3. input nodes have no edges and no bias; every other node has at least one edge;
      4. every edge's map fits its endpoints: map.out_shape(source.shape) == target.shape;
      5. a bias has shape (channels,);
      6. a maxpool node has exactly one edge, a Pool without multiplier, and 1 <= k <= the
         number of in-input entries of its smallest window (padding positions are not neurons);
      7. distinct Param objects have distinct names (a shared weight is one object);
      8. a Resample's per-axis coefficients, a FixedConv's kernel, a Pool's multipliers and a
         SpatialMatrix are finite (0 is allowed: no edge);
      9. outputs name existing, non-input nodes (one named twice is two outputs: a model that returns
         (y, y)); every non-output node feeds some node
         and every node reaches an output;
     10. shapes are positive integers; a window map's kernel, stride and dilation are >= 1 and its
         padding >= 0; a Dense weight is a matrix; selection indices are >= -1 (-1: zero);
     11. every field holds its IR type: a NodeKind, a shape tuple, Edge objects over Maps, a bias and
         map weights that are Params, an integer k (a pass that writes "relu" or an array there is named
         here, not met later as another function or a raw error).
    The error message names the broken rule and prints the graph.
    """
    problems = _problems(graph)
    if problems:
        raise GraphVerificationError("graph failed verification:\n  - " + "\n  - ".join(problems) + "\n" + _shown(graph))
    return graph


def _shown(graph: Graph) -> str:
    """The graph printed, or a line saying why it cannot be (a field not of its IR type, rule 11)."""
    try:
        return str(graph)
    except Exception as err:  # the printer reads every field as its type: the problems above say which is not
        return f"(the graph cannot be printed: {type(err).__name__}: {err})"


def _problems(graph: Graph) -> list[str]:
    out: list[str] = []
    seen: dict[str, object] = {}
    params: dict[str, int] = {}
    mistyped = False  # a node's field not of its IR type: the whole-graph checks below cannot read it
    for node in graph.nodes:
        where = f"node '{node.name}'"
        if not node.name:
            out.append("a node has an empty name")
        if node.name in seen:
            out.append(f"{where}: name defined twice")
        typed = _type_problem(node)
        if typed:  # the checks below read these fields as their types
            out.append(f"{where}: {typed}")
            seen[node.name] = node
            mistyped = True
            continue
        if not all(_is_int(d) and d >= 1 for d in node.shape):
            out.append(f"{where}: shape {list(node.shape)} is not positive integers")
        if node.kind is NodeKind.INPUT:
            if node.edges or node.bias is not None:
                out.append(f"{where}: an input node has no edges and no bias")
        elif not node.edges:
            out.append(f"{where}: a {node.kind.value} node needs at least one incoming edge")
        for i, e in enumerate(node.edges):
            if e.source not in seen:
                out.append(f"{where}: edge {i} reads '{e.source}', which is not defined before it")
                continue
            src = seen[e.source]
            bad = _map_problem(e.map)
            if bad:
                out.append(f"{where}: edge {i} ({e.map.describe()}): {bad}")
                continue
            try:
                got = tuple(e.map.out_shape(src.shape))
            except (ValueError, TypeError, ZeroDivisionError, IndexError) as err:
                out.append(f"{where}: edge {i} ({e.map.describe()}) does not fit source '{e.source}': {err}")
                continue
            if got != tuple(node.shape):
                out.append(
                    f"{where}: edge {i} ({e.map.describe()}) maps '{e.source}' {list(src.shape)} to {list(got)}, "
                    f"node has shape {list(node.shape)}"
                )
        if node.bias is not None and not node.shape:
            out.append(f"{where}: a scalar node (shape []) has no channel axis to hold bias '{node.bias.name}' (give the "
                       "node shape [1], or put the bias on the node it reads)")
        elif node.bias is not None and node.bias.shape != (node.shape[0],):
            out.append(f"{where}: bias '{node.bias.name}' has shape {list(node.bias.shape)}, expected [{node.shape[0]}]")
        if node.kind is NodeKind.MAXPOOL:
            if len(node.edges) != 1 or node.edges[0].map.kind is not MapKind.POOL or node.edges[0].map.mult is not None:
                out.append(f"{where}: a maxpool node has exactly one edge, a pool window without multiplier")
            elif node.edges[0].source in seen:
                window = smallest_window(node.edges[0].map, seen[node.edges[0].source].shape)
                if not 1 <= node.k <= window:
                    out.append(f"{where}: k = {node.k} outside 1..{window} (entries of its smallest window)")
        for i, e in enumerate(node.edges):
            if e.map.kind is MapKind.RESAMPLE and not all(np.isfinite(a).all() for a in e.map.matrices):
                out.append(f"{where}: edge {i} ({e.map.describe()}) has a non-finite coefficient")
            if e.map.kind is MapKind.FIXED_CONV and not np.isfinite(e.map.kernel).all():
                out.append(f"{where}: edge {i} ({e.map.describe()}) has a non-finite kernel entry")
            fixed = e.map.mult if e.map.kind is MapKind.POOL else \
                e.map.matrix if e.map.kind is MapKind.SPATIAL_MATRIX else None
            if fixed is not None and not np.isfinite(fixed).all():
                out.append(f"{where}: edge {i} ({e.map.describe()}) has a non-finite fixed coefficient")
        for p in node.params():
            if params.setdefault(p.name, id(p)) != id(p):
                out.append(f"{where}: two different params are named '{p.name}'")
        seen[node.name] = node
    if mistyped:
        return out
    for name in graph.outputs:
        if name not in seen:
            out.append(f"output '{name}' is not a node")
        elif seen[name].kind is NodeKind.INPUT:
            out.append(f"output '{name}' is an input node")
    if not graph.outputs:
        out.append("the graph has no outputs")
    out.extend(_unreached(graph, seen))
    return out


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _type_problem(node) -> str:
    """What field of ``node`` is not of its IR type ("" if none)."""
    if not isinstance(node.kind, NodeKind):
        return f"kind {node.kind!r} is not a NodeKind (pathir.ir.NodeKind.RELU, ...)"
    if not isinstance(node.shape, tuple):
        return f"shape {node.shape!r} is a {type(node.shape).__name__}, not a tuple of integers"
    if node.bias is not None and not isinstance(node.bias, Param):
        return f"its bias is a {type(node.bias).__name__}, not a pathir.ir.Param (bias.with_value(...) makes one)"
    if not _is_int(node.k):
        return f"k = {node.k!r} is not an integer"
    if not isinstance(node.edges, tuple):
        return f"edges is a {type(node.edges).__name__}, not a tuple of pathir.ir.Edge"
    for i, e in enumerate(node.edges):
        if not isinstance(e, Edge):
            return f"edge {i} is a {type(e).__name__}, not a pathir.ir.Edge(source, map)"
        if not isinstance(e.map, Map):
            return f"edge {i}'s map is a {type(e.map).__name__}, not a pathir.ir map"
        weight = e.map.weight
        if weight is not None and not isinstance(weight, Param):
            return (f"edge {i} ({e.map.kind.value}) holds a {type(weight).__name__} as its weight, not a pathir.ir.Param "
                    "(weight.with_value(...) makes one)")
    return ""


def _map_problem(m) -> str:
    """What makes a map's own fields invalid whatever its input ("" if nothing)."""
    for field in ("kernel", "stride", "dilation"):
        values = getattr(m, field, None)
        if isinstance(values, tuple) and not all(isinstance(v, (int, np.integer)) and v >= 1 for v in values):
            return f"{field} {list(values)} must be integers >= 1"
    padding = getattr(m, "padding", None)
    if isinstance(padding, tuple) and any(v < 0 for pair in padding for v in (pair if isinstance(pair, tuple) else (pair,))):
        return f"padding {list(padding)} must be >= 0 (a crop is a selection map)"
    if m.kind is MapKind.DENSE and m.W.value.ndim != 2:
        return f"a dense weight is a matrix, got shape {list(m.W.shape)}"
    if m.kind is MapKind.RESHAPE and not all(isinstance(d, (int, np.integer)) and d >= 1 for d in m.shape):
        return f"reshape to {list(m.shape)}: dimensions must be integers >= 1"
    index = getattr(m, "index_array", None) if m.kind is MapKind.CHANNEL_MAP else getattr(m, "index", None)
    if m.kind in (MapKind.CHANNEL_MAP, MapKind.GATHER) and index is not None and np.size(index) and np.min(index) < -1:
        return f"index {int(np.min(index))} below -1 (-1 is the only index meaning 'zero')"
    return ""


def smallest_window(pool, in_shape) -> int:
    """Fewest in-input entries over the windows of ``pool`` (per axis, then multiplied)."""

    total = 1
    for L, k, s, (a, b), d in zip(in_shape[1:], pool.kernel, pool.stride, pool.padding, pool.dilation):
        n_out = pool_output_size(L, k, s, (a, b), d, pool.ceil_mode)
        counts = [sum(0 <= o * s - a + j * d < L for j in range(k)) for o in range(n_out)]
        total *= min(counts) if counts else 0
    return total


def _unreached(graph: Graph, seen) -> list[str]:
    live = set(n for n in graph.outputs if n in seen)
    for node in reversed(graph.nodes):
        if node.name in live:
            live.update(e.source for e in node.edges)
    return [f"node '{n.name}' does not reach any output" for n in graph.nodes if n.name not in live]
