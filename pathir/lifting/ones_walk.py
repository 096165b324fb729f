"""The path walk on the all-ones input with feature maps kept compressed along their constant runs.

On the all-ones input every spatial map of the path-norm network is translation invariant
away from its borders: a convolution, a pool (one multiplier everywhere), a scale or a
channel map sends a map whose slices along an axis are equal on a *run* of positions to one
whose slices are equal on a run again (the outputs whose windows lie inside the input's run).
So each spatial axis of a node's tensor is kept as its full length N with one run
``(start, count)``: full positions ``start .. start + count - 1`` are one stored slice, at
index ``start``; the stored axis has ``N - count + 1`` entries (count 1: the axis as it is).

A map of windows (conv, fixed conv, pool) is applied to the tensor *materialised* with only
``t`` copies of the run's slice, ``t ≡ count (mod stride)``, ``t ≥ 2·(span − 1)`` and
``t ≥ span + stride − 1`` (span: a window's extent, dilation included). Cutting ``stride · r`` equal slices out of the
middle of a run cuts exactly ``r`` outputs, each equal to the outputs whose windows lie inside
the run, and leaves every other output as it is (its window lies left of the cut, or right of
it and r outputs on). So the output's run is those inside outputs and the r cut ones, and the
stored values are the very sums of the full walk (same windows, same weights, same rounding
bound). Every other map (dense, reshape, gather, spatial matrices, resampling, a pool whose
multiplier varies) reads its input expanded to full size; terms summed into one node are
first re-stored on the intersection of their runs.

It is :func:`pathir.lifting.walk.path_forward` on the all-ones input, certified the same way
(a stored tensor holds every distinct value of the full one; where an entry is 0 the support
check reads the full tensor); on the early, large maps of a convolutional network it computes
a few border bands and one interior slice instead of the whole map.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from pathir.ir import Graph, MapKind, NodeKind, pool_output_size
from pathir.lifting.scaled import Certifier
from pathir.lifting.walk import combine_scaled, log_total, node_errors, require_path_graph

__all__ = ["Runs", "ones_forward", "ones_forwards", "ones_log_total", "expand", "Expanded", "RECOMPUTE"]

_POINTWISE = (MapKind.IDENTITY, MapKind.SCALE, MapKind.CHANNEL_MAP)
_WINDOWED = (MapKind.CONV, MapKind.FIXED_CONV, MapKind.POOL)


class Runs:
    """Per spatial axis of a node (full spatial shape ``full``) its run ``(start, count)``."""

    __slots__ = ("full", "runs")

    def __init__(self, full, runs):
        self.full, self.runs = tuple(full), tuple(runs)

    @classmethod
    def none(cls, full) -> "Runs":
        """Every axis as it is."""
        return cls(full, [(0, 1)] * len(full))

    @classmethod
    def constant(cls, full) -> "Runs":
        """Every axis one run (a map equal everywhere, the all-ones input)."""
        return cls(full, [(0, n) for n in full])

    @property
    def stored(self) -> tuple:
        """The stored spatial shape."""
        return tuple(n - c + 1 for n, (_, c) in zip(self.full, self.runs))

    @property
    def compressed(self) -> bool:
        return any(c > 1 for _, c in self.runs)

    def index(self, axis: int, positions: np.ndarray) -> np.ndarray:
        """The stored index of each full position along ``axis``."""
        s, c = self.runs[axis]
        return np.where(positions < s, positions, np.where(positions < s + c, s, positions - c + 1))

    def meet(self, other: "Runs") -> "Runs":
        """The runs on which both are constant (count 1 where theirs do not overlap)."""
        out = []
        for (s0, c0), (s1, c1) in zip(self.runs, other.runs):
            lo, hi = max(s0, s1), min(s0 + c0, s1 + c1)
            out.append((lo, hi - lo) if hi - lo > 1 else (0, 1))
        return Runs(self.full, out)


def _pieces(a: int, b: int, run: tuple) -> list:
    """Full positions ``a .. b - 1`` of an axis stored with ``run`` as stored pieces ``(start, length, repeated)``:
    positions before the run read their own slice, the run's positions its one slice, the rest theirs."""
    s, c = run
    out = []
    if a < min(b, s):
        out.append((a, min(b, s) - a, False))
    inside = min(b, s + c) - max(a, s)
    if inside > 0:
        out.append((s, inside, True))
    if max(a, s + c) < b:
        out.append((max(a, s + c) - c + 1, b - max(a, s + c), False))
    return out


def _gather(backend, x, axis: int, pieces: list):
    """``x`` along ``axis`` laid out as ``pieces`` ``(start, length, repeated)``: a run of ``length`` stored
    slices from ``start``, or (repeated) the slice ``start`` ``length`` times. One concatenation of views
    where the backend has ``pieces``; else a gather by index."""
    pieces = [p for p in pieces if p[1] > 0]
    if len(pieces) == 1 and not pieces[0][2] and pieces[0][0] == 0 and pieces[0][1] == x.shape[axis]:
        return x
    if hasattr(backend, "pieces"):
        return backend.pieces(x, axis, pieces)
    index = np.concatenate([np.full(n, s) if rep else np.arange(s, s + n) for s, n, rep in pieces])
    return backend.take(x, axis, index)


def restore(backend, x, old: Runs, new: Runs):
    """``x`` stored with runs ``old`` re-stored with runs ``new`` (each new run inside the old one,
    or of count 1): a gather along every axis whose run changes."""
    for d, (a, b) in enumerate(zip(old.runs, new.runs)):
        if a != b:
            (s, c), n = b, old.full[d]
            # a full position per stored index: 0 .. s, then s + c .. n - 1
            x = _gather(backend, x, 2 + d, _pieces(0, s + 1, a) + _pieces(s + c, n, a))
    return x


def expand(backend, x, runs: Runs):
    """The full tensor of ``x`` stored with ``runs``."""
    return restore(backend, x, runs, Runs.none(runs.full)) if runs.compressed else x


#: in :func:`ones_forward`'s result, a node whose map is not kept: made again from its sources' when read
RECOMPUTE = "recompute"


class Expanded(Mapping):
    """:func:`ones_forward`'s result read as :func:`pathir.lifting.walk.path_forward`'s, {node: (m, L)}:
    each node's tensor expanded to full size when it is read, never held (a backward walk reads a
    node once per edge leaving it, so only the stored maps outlive a read); a node not kept
    (``RECOMPUTE``) summed again from its sources' maps, the very sum of the forward. Owns ``stored``:
    :meth:`release` drops a node's map for good."""

    def __init__(self, backend, stored: dict, graph: Graph | None = None):
        self.backend, self.stored, self.graph = backend, stored, graph

    def __getitem__(self, name):
        m, L, runs = _read(self.graph, self.backend, self.stored, name)
        return (None if m is None else expand(self.backend, m, runs)), L

    def release(self, name) -> None:
        """Drop ``name``'s stored map (its readers are done with it)."""
        self.stored.pop(name, None)

    def __iter__(self):
        return iter(self.stored)

    def __len__(self):
        return len(self.stored)


def _geometry(m):
    """(kernel, stride, padding, dilation, ceil_mode) of a map of windows."""
    if m.kind is MapKind.POOL:
        return m.kernel, m.stride, m.padding, m.dilation, m.ceil_mode
    kernel = (m.W.shape if m.kind is MapKind.CONV else m.kernel.shape)[2:]
    return kernel, m.stride, m.padding, m.dilation, False


def _one_multiplier(m) -> float | None:
    """A pool's single multiplier (1.0 for none), or None where it varies or is per channel."""
    if m.mult is None:
        return 1.0
    if m.mult.ndim != len(m.kernel) or m.mult.size == 0:
        return None
    first = float(m.mult.reshape(-1)[0])
    return first if bool(np.all(m.mult == first)) else None


def _windowed(backend, m, x, runs: Runs, channels: int, mult: float):
    """Map of windows ``m`` on ``x`` stored with ``runs``: (its output stored, the output's runs)."""
    kernel, stride, padding, dilation, ceil = _geometry(m)
    lengths, out_full, out_runs, keeps = [], [], [], []
    for d, (n, (s0, c0)) in enumerate(zip(runs.full, runs.runs)):
        k, st, pad, dil = kernel[d], stride[d], padding[d], dilation[d]
        span = dil * (k - 1) + 1
        least = max(2 * span - 2, span + st - 1, 1)  # a cut inside the run; an inside output beside it
        cut = (c0 - least) // st if c0 > least else 0
        t = c0 - st * cut  # copies of the run's slice materialised
        if t != 1:
            x = _gather(backend, x, 2 + d, [(0, s0, False), (s0, t, True), (s0 + 1, n - c0 - s0, False)])
        lengths.append(n - st * cut)
        n_out = pool_output_size(n, k, st, pad, dil, ceil)
        first = -(-(s0 + pad[0]) // st)  # the outputs whose windows lie inside the run
        inner = max(0, (s0 + t - span + pad[0]) // st - first + 1)
        out_full.append(n_out)
        if inner + cut <= 1:
            out_runs.append((0, 1))
            keeps.append(None)
        else:
            out_runs.append((first, inner + cut))
            keeps.append([(0, first + 1, False), (first + inner, n_out - cut - first - inner, False)])
    shape = (channels, *lengths)
    if m.kind is MapKind.POOL and m.mult is not None:  # its one multiplier over the materialised outputs
        m = replace(m, mult=np.full(replace(m, mult=None).out_shape(shape)[1:], mult))
    y = backend.apply(m, x, shape)
    for d, keep in enumerate(keeps):
        if keep is not None:
            y = _gather(backend, y, 2 + d, keep)
    return y, Runs(out_full, out_runs)


def _apply(backend, m, x, runs: Runs, src_shape, out_spatial):
    """Map ``m`` on ``x`` stored with ``runs`` (source of full shape ``src_shape``): (output, its runs)."""
    if m.kind in _POINTWISE and runs.compressed:
        return backend.apply(m, x, (*src_shape[:1], *runs.stored)), Runs(out_spatial, runs.runs)
    if m.kind in _WINDOWED and runs.compressed:
        mult = _one_multiplier(m) if m.kind is MapKind.POOL else 1.0
        if mult is not None:
            return _windowed(backend, m, x, runs, src_shape[0], mult)
    return backend.apply(m, expand(backend, x, runs), src_shape), Runs.none(out_spatial)


def _spatial(shape) -> tuple:
    return tuple(shape[1:])


def _stored_shape(shape, runs: Runs) -> tuple:
    return (1, *shape[:1], *runs.stored)


def _node_sum(graph: Graph, node, backend, cert: Certifier, acts: dict, given: dict) -> tuple:
    """(m, L, runs) of ``node`` from its sources' in ``acts``; ``given``: {edge index: (its term, runs)}
    computed already (a dense map shared by several q)."""
    spatial = _spatial(node.shape)
    place = getattr(backend, "placed", None)
    parts = []  # (is placed, value, L, runs)
    for k, e in enumerate(node.edges):
        m, L, runs = acts[e.source]
        if m is None:
            continue
        if k in given:
            parts.append((False, *given[k][:1], L, given[k][1]))
            continue
        src = graph.node(e.source).shape
        part = None if place is None else place(e.map, m, (*src[:1], *runs.stored))  # (a scalar node: no channel axis)
        if part is not None:  # a concat operand: its channels of the node's sum
            parts.append((True, part, L, Runs(spatial, runs.runs)))
            continue
        y, out_runs = _apply(backend, e.map, m, runs, src, spatial)
        parts.append((False, y, L, out_runs))
    common = Runs.constant(spatial)
    for *_, runs in parts:
        common = common.meet(runs)
    terms, placed = [], []
    for is_placed, value, L, runs in parts:
        if is_placed:
            vals, pos, channels = value
            placed.append(((restore(backend, vals, runs, common), pos, channels), L))
        else:
            terms.append((restore(backend, value, runs, common), L))
    if node.bias is not None:
        terms.append((backend.bias(node, len(node.shape) + 1), 0.0))
    check = None if cert is None else lambda acc: cert.node(node.name, acc, full=lambda a: expand(backend, a, common))
    m, L = combine_scaled(backend, terms, _stored_shape(node.shape, common), placed, check=check)
    return m, L, common


def _read(graph, backend, stored: dict, name: str) -> tuple:
    """``stored[name]`` as (m, L, runs); a node not kept summed again from its sources (uncertified: the
    forward certified this very sum)."""
    got = stored[name]
    if got is not RECOMPUTE:
        return got
    return _node_sum(graph, graph.node(name), backend, None, _Reading(graph, backend, stored), {})


class _Reading(Mapping):
    """``stored`` read through :func:`_read`: the sources of a node summed again."""

    def __init__(self, graph, backend, stored):
        self.graph, self.backend, self.stored = graph, backend, stored

    def __getitem__(self, name):
        return _read(self.graph, self.backend, self.stored, name)

    def __iter__(self):
        return iter(self.stored)

    def __len__(self):
        return len(self.stored)


def _dropped_after(graph: Graph, keep: str) -> tuple[dict, set]:
    """({node: index of its last reader in ``graph.nodes``}, the nodes whose maps are not kept past it):
    ``keep="outputs"``: every node but the outputs; ``keep="all"``: the nodes every edge into which is
    pointwise (a concatenation, a channel split or shuffle, a per-channel scale), within two such sums of
    kept maps. Those are as large as their sources together but cost a pass over memory to make again,
    where a densenet block's concatenations held most of its walk's maps."""
    last = {e.source: i for i, node in enumerate(graph.nodes) for e in node.edges}
    outputs = set(graph.outputs)
    if keep == "outputs":
        return last, {n.name for n in graph.nodes if n.name not in outputs}
    depth: dict[str, int] = {}
    for node in graph.nodes:
        if node.edges and node.name not in outputs and all(e.map.kind in _POINTWISE for e in node.edges):
            d = 1 + max(depth.get(e.source, 0) for e in node.edges)
            if d <= 2:
                depth[node.name] = d
    return last, set(depth)


def _input(node, backend) -> tuple:
    runs = Runs.constant(_spatial(node.shape))
    return backend.ones(_stored_shape(node.shape, runs)), 0.0, runs


def ones_forward(graph: Graph, backend, linearize: bool = False, certify: Certifier | None = None,
                 forget: bool = True, keep: str = "all"):
    """:func:`pathir.lifting.walk.path_forward` on the all-ones input, each node's tensor stored
    compressed: {node name: (m, L, runs)}, node value = expand(m) · exp(L). Needs the backend's
    ``take``; raises :class:`~pathir.lifting.scaled.Uncertified` as path_forward does. ``forget``: each
    weight's converted tensor (|w|^q on a power view) is dropped from the backend's cache once its node
    is summed, so the walk holds one layer's, not the model's (a weight read again is converted again).
    ``keep``: "all" (for a backward walk: every node, those made by pointwise sums alone as ``RECOMPUTE``,
    read through :class:`Expanded` with the graph) or "outputs" (the rest dropped once read)."""
    return ones_forwards(graph, [backend], linearize, None if certify is None else [certify], forget, keep)[0]


def ones_forwards(graph: Graph, views: list, linearize: bool = False, certs: list | None = None,
                  forget: bool = True, keep: str = "all") -> list:
    """:func:`ones_forward` of each power view in ``views`` (one per q), node by node in step, so
    that a large dense weight is read once for every q (the views' ``dense_powers``)."""
    require_path_graph(graph, linearize)
    if certs is None:
        certs = [Certifier(graph, getattr(v, "q", None) == 0, v) for v in views]
    with views[0].flush_denormals():
        return _in_step(graph, views, certs, forget, keep)


def _in_step(graph: Graph, views: list, certs: list, forget: bool, keep: str) -> list:
    shared = len(views) > 1 and hasattr(views[0], "dense_powers")
    walks = [{} for _ in views]
    last, dropped = _dropped_after(graph, keep)
    for i, node in enumerate(graph.nodes):
        if node.kind is NodeKind.INPUT:
            for v, acts in zip(views, walks):
                acts[node.name] = _input(node, v)
            continue
        with node_errors(node):
            given = [{} for _ in views]
            for k, e in enumerate(node.edges):
                if not shared or e.map.kind is not MapKind.DENSE or any(a[e.source][0] is None for a in walks):
                    continue
                xs = [expand(v, *a[e.source][::2]) for v, a in zip(views, walks)]
                ys = views[0].dense_powers(e.map, xs, views)
                for g, y in zip(given, ys or ()):
                    g[k] = (y, Runs.none(_spatial(node.shape)))
            for v, cert, acts, g in zip(views, certs, walks, given):
                acts[node.name] = _node_sum(graph, node, v, cert, acts, g)
                for e in node.edges if forget and hasattr(v, "forget") else ():
                    if e.map.weight is not None:
                        v.forget(e.map.weight)
        for source in {e.source for e in node.edges if last[e.source] == i and e.source in dropped}:
            for acts in walks:  # read for the last time in the forward
                if keep == "outputs":
                    del acts[source]
                else:
                    acts[source] = RECOMPUTE
    return walks


def ones_log_total(backend, acts, names) -> float:
    """log of the sum of every entry of the named nodes of :func:`ones_forward`, at full size."""
    return log_total(backend, {n: (None if acts[n][0] is None else expand(backend, acts[n][0], acts[n][2]),
                                   acts[n][1]) for n in names}, names)
