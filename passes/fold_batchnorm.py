"""fold_batchnorm: an inference batch-norm folded into the affine layer before it.

Pattern: node v reads node u only through a per-channel ``Scale`` edge
(s = gamma / sqrt(var + eps), v's bias holding c = beta - mean * s), u is an
identity node read by nothing else, not an output, whose incoming edges are all
parameterized (dense, conv, scale) and made from one layer's weight. A sum of
layers (``bn(a(x) + b(x))``) keeps its batch-norm, whether one or both of them
have a bias (with two biases the sum is two nodes; with one, one node). Then, for every edge W of u and u's bias b,

    W' = W * s[out channel],    b' = s * b + c     (c: v's own bias)

and v reads u's sources directly (the onnxscript fusion rule
W' = W * gamma / sigma, b' = (b - mu) * gamma / sigma + beta). The batch-norm's
gamma and beta become OUT_SCALE sources of W' and b', so a rescaling of the
unit is written back onto the batch-norm affine (exact in train and eval mode).
Only a batch-norm's scale folds (one with OUT_SCALE sources, γ and β, that the folded weight takes
over): a layer-scale g (x * g, a parameter of its own) stays a Scale edge, so that g stays a param
of the graph (its diag G, its scores, its gradient) and the weight before it stays that weight.
Where the pattern does not hold the Scale edge stays (an identity-neuron layer);
in particular a weight or bias read by another edge too (one conv module called
twice, each call followed by its own batch-norm) is never folded: scaling it
for one reader would change the other.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pathir.ir import PARAMETERIZED, Edge, Graph, MapKind, NodeKind, Param, Role, SourceRef
from pathir.ir.param import unlocked
from pathir.support.array_pool import ArrayPool

__all__ = ["fold_batchnorm", "pooled_folds"]


def _out_scale_refs(scale: Param) -> tuple[SourceRef, ...]:
    return tuple(r for r in scale.sources if r.role is Role.OUT_SCALE)


def _scaled_weight(w: Param, s: np.ndarray, refs, arrays, in_place: bool, scale_how: str = "") -> Param:
    """W * s[out channel] as a new Param (``scale_how``: how s is made, for its ``how``): into W's own memory
    where ``in_place`` (the caller owns it alone), else into a fresh or pooled array."""
    if in_place:
        try:
            unlocked(w.value)  # the value dies with this graph; its memory becomes the new one's
        except ValueError:  # over memory that is read-only at its root: scaled into a new array
            in_place = False
    rows = w.value.reshape(w.shape[0], -1)  # one long inner loop per output channel, not one per kernel row
    out = rows if in_place else None if arrays is None else arrays.empty(rows.shape)
    value = np.multiply(rows, s.reshape(-1, 1), out=out).reshape(w.shape)
    sources = tuple(r for r in w.sources if r.role is not Role.OUT_SCALE) + refs
    how = (w.how or w.name) + f" * ({scale_how or (refs[0].name if refs else 'scale') + '/sigma'})"
    return Param.adopt(w.name, value, sources, how)  # value is a fresh array: no copy


def fold_batchnorm(graph: Graph, arrays=None, in_place: bool = False) -> Graph:
    """Requires: a verified graph. Ensures: no foldable Scale edge remains.
    Preserves: the function R_theta (exactly, up to rounding) and the units
    (each folded channel stays one unit). ``arrays``: an ``ArrayPool`` the folded
    weights are written into (a live model's re-reads: memory of the values two
    re-reads ago instead of fresh pages), else new arrays. ``in_place``: the caller hands over
    ``graph``, which nobody reads afterwards (a fresh lowering's): a folded weight whose memory no
    other param shares is scaled where it is, with no new array (one copy of the model less)."""
    nodes = {n.name: n for n in graph.nodes}
    shared = _shared_params(graph)
    sole = _sole_memory(graph) if in_place else set()
    removed: set[str] = set()
    for v in graph.nodes:
        if len(v.edges) == 0:
            continue
        new_edges, bias, changed = [], v.bias, False
        for e in v.edges:
            u = nodes.get(e.source)
            if not (e.map.kind is MapKind.SCALE and _out_scale_refs(e.map.W) and _foldable(graph, u, shared)):
                new_edges.append(e)
                continue
            s, refs = e.map.W.value, _out_scale_refs(e.map.W)
            for ue in u.edges:
                W = _scaled_weight(ue.map.W, s, refs, arrays, ue.map.W.name in sole, e.map.W.how)
                new_edges.append(Edge(ue.source, replace(ue.map, W=W)))
            if u.bias is not None:
                folded = s * u.bias.value
                if bias is None:
                    bias = Param(f"{u.bias.name}", folded, u.bias.sources + refs, f"{u.bias.name} * scale")
                else:  # a new value: under a new name where the batch-norm's own bias is read elsewhere too
                    name = f"{bias.name}@{v.name}" if bias.name in shared else bias.name
                    bias = Param(name, bias.value + folded, bias.sources, (bias.how or bias.name) + f" + scale * {u.bias.name}")
            removed.add(u.name)
            changed = True
        if changed:
            nodes[v.name] = replace(v, edges=tuple(new_edges), bias=bias)
    return graph.replace_nodes(nodes[n.name] for n in graph.nodes if n.name not in removed)


def _shared_params(graph: Graph) -> set[str]:
    """Names of the params read by more than one edge or bias (weight sharing across calls)."""
    seen, shared = set(), set()
    for n in graph.nodes:
        params = [e.map.W.name for e in n.edges if e.map.kind in PARAMETERIZED]
        params += [n.bias.name] if n.bias is not None else []
        for name in params:
            (shared if name in seen else seen).add(name)
    return shared


def _sole_memory(graph: Graph) -> set[str]:
    """Names of the params whose value is a C-contiguous array over memory no other param's value
    reaches (followed through ``base`` to the first array that is not a view of another array)."""
    roots: dict[int, list[Param]] = {}
    for p in graph.params():
        a = p.value
        while isinstance(a.base, np.ndarray):
            a = a.base
        roots.setdefault(id(a), []).append(p)
    return {ps[0].name for ps in roots.values() if len(ps) == 1 and ps[0].value.flags.c_contiguous}


def _foldable(graph: Graph, u, shared: set[str]) -> bool:
    return (
        u is not None
        and u.kind is NodeKind.IDENTITY
        and u.name not in graph.outputs
        and len(graph.consumers[u.name]) == 1
        and all(e.map.kind in PARAMETERIZED for e in u.edges)
        and all(e.map.W.name not in shared for e in u.edges)
        and (u.bias is None or u.bias.name not in shared)
        and len({_layer(e.map.W) for e in u.edges}) == 1
    )


def _layer(w: Param) -> frozenset[str]:
    """The tensors a weight is made from: edges of one layer (a convolution over a concatenation's parts) share
    them; a sum of two layers (``bn(a(x) + b(x))``, one node where at most one of them has a bias) does not."""
    return frozenset(r.name for r in w.sources if r.role is Role.VALUE)


def pooled_folds(passes, in_place: bool = False) -> tuple:
    """``passes`` with ``fold_batchnorm`` (given as itself or by name) writing into one ArrayPool that the
    returned pipeline keeps: a live model's re-reads then reuse the memory of the folded weights two
    re-reads ago. ``in_place``: every graph the pipeline is run on is handed over (a fresh lowering's,
    read by nothing after): weights are folded in their own memory (``fold_batchnorm(in_place=True)``)."""
    arrays = ArrayPool()

    def pooled(graph: Graph) -> Graph:
        return fold_batchnorm(graph, arrays, in_place)

    pooled.__name__ = "fold_batchnorm"
    return tuple(pooled if p is fold_batchnorm or p == "fold_batchnorm" else p for p in passes)
