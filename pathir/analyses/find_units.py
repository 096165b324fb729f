"""find_units: the rescaling units of a graph (docs/math.md §5), by union-find.

Every (node, channel) pair gets one log-scale s (all spatial positions of a
channel share it: weight sharing of convolutions). Edge u->v is multiplied by
e^{s_v - s_u}, the bias of v by e^{s_v}. Three relations tie pairs together
(they must share one s):

- a fixed map (skip, pooling window, concat slice, flatten, permutation) ties
  each (source channel, target channel) of its ``channel_ties``;
- a Param read by several edges must get one factor per entry: entry by entry,
  the target channels of all its edges are tied together, and so are the source
  channels (a bias shared by several nodes ties their channels). This is the
  largest group of *independent* per-channel scales that keeps every entry's
  factor well defined;
- input and output channels are pinned (s = 0): their classes are no units; so
  are the channels of a node whose bias no rescaling may move (a source marked
  ``fixed``: a clipped ReLU's threshold held as one number in the code).

A unit is a class with no pinned member that some free parameter enters or
leaves (a class that only a neuron with no free parameter around it forms is
no direction of the group: rescaling it moves nothing). Unit h acts through z_h: its channels
get s = z_h / 2, so the parameters entering it (weights from outside the unit,
biases of its neurons) are multiplied by e^{z_h/2} and those leaving it by
e^{-z_h/2}; a weight with both ends in the unit is unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, Mapping, Sequence

import numpy as np

from pathir.errors import ArgumentKeyError, PathirError
from pathir.ir import Graph, NodeKind, Param

__all__ = ["find_units", "Units", "Unit", "UnitNames"]


@dataclass(frozen=True, eq=False)
class Unit:
    """One rescaling unit, for reading.

    ``incoming``: (param, flat C-order indices) of the weights entering the unit
    from outside and of the biases of its neurons; ``outgoing``: of the weights
    leaving it. Weights inside the unit are in neither.
    """

    index: int
    name: str
    members: tuple[tuple[str, int], ...]
    incoming: tuple[tuple[Param, np.ndarray], ...]
    outgoing: tuple[tuple[Param, np.ndarray], ...]

    def __str__(self) -> str:
        def side(items):
            return ", ".join(f"{p.name}[{idx.size}]" for p, idx in items) or "-"

        nodes = sorted({n for n, _ in self.members}, key=[n for n, _ in self.members].index)
        return (
            f"unit {self.index} '{self.name}': {len(self.members)} channels in {', '.join(nodes)}; "
            f"in: {side(self.incoming)}; out: {side(self.outgoing)}"
        )


class UnitNames(Sequence):
    """The names of some units, made on first read: naming every unit of a large model is a pass over
    all its classes (0.25 s on densenet169), and most reports that list units are never printed.
    Equal to the tuple of its names; holds names and node lists, never a parameter value."""

    def __init__(self, every_name, indices):
        self._every_name, self._indices = every_name, tuple(int(h) for h in indices)
        self._names: tuple[str, ...] | None = None

    def _all(self) -> tuple[str, ...]:
        if self._names is None:
            every = self._every_name()
            self._names, self._every_name = tuple(every[h] for h in self._indices), None
        return self._names

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i):
        return self._all()[i]

    def __iter__(self):
        return iter(self._all())

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, list, UnitNames)):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())

    def __reduce__(self):
        return tuple, (self._all(),)  # pickled (and deep-copied) as the tuple of its names


@dataclass(frozen=True, eq=False)
class Units:
    """The rescaling units of one graph (a by-product of :func:`find_units`).

    Compact form, from which B and the per-unit views are built:

    - ``names[h]``: readable name of unit h (``conv1:c3``, ``stream:layer1/c5``), made on first use
      from ``graph``;
    - ``members[h]``: its (node name, channel) pairs, in node order (made on first use from
      ``channel_units``: a PathCond or equalize solve never reads them);
    - ``channel_units[node]``: (channels,) int array, the unit of each channel
      (``no_unit`` = H where it has none: pinned to an input or output, or reached
      by no free parameter);
    - ``params``: the graph's ``params()`` (the flat θ order);
    - ``ends[k]``: (enter, leave) unit arrays of param k, each broadcastable to the
      param's shape: per entry, the unit it enters (the unit of its target channel)
      and the one it leaves (of its source channel), ``no_unit`` for none;
      ``leave`` is None for a bias.

    One encoding of "no unit" throughout pathir: the index H, so that z padded
    with one 0 (``np.append(z, 0)``) reads s = 0 there, and B's row keys
    e(i) (H + 1) + l(i) (``pathir.analyses.unit_rows``) use the same H.
    """

    count: int  # H
    channel_units: Mapping[str, np.ndarray]  # in node order
    params: tuple[Param, ...]
    ends: tuple[tuple[np.ndarray, np.ndarray | None], ...]
    graph: Graph = field(repr=False, default=None)

    @cached_property
    def members(self) -> tuple[tuple[tuple[str, int], ...], ...]:
        """Per unit, its (node name, channel) pairs in node order."""
        return _members(self.channel_units, self.count)

    def first_nodes(self) -> np.ndarray:
        """(H,) per unit, the position in node order of the first node holding one of its channels."""
        first = np.full(self.count, -1, dtype=np.int64)
        for i, cu in enumerate(self.channel_units.values()):
            hs = cu[cu < self.count]
            hs = hs[first[hs] < 0]
            first[hs] = i
        return first

    @cached_property
    def names(self) -> tuple[str, ...]:
        """The units' names, made when first asked (a solve that names no unit never pays for them)."""
        return tuple(_names(self.graph, self.members))

    def names_of(self, indices) -> "UnitNames":
        """The names of units ``indices``, made when first read, holding none of the graph's values."""
        if "names" in self.__dict__:
            names = self.names
            return UnitNames(lambda: names, indices)
        table, channel_units, H = _name_table(self.graph), self.channel_units, self.count
        members = self.__dict__.get("members")
        return UnitNames(lambda: tuple(_names_from(table, members or _members(channel_units, H))), indices)

    def __len__(self) -> int:
        return self.count

    @property
    def no_unit(self) -> int:
        """The index that stands for "no unit": H."""
        return self.count

    def __iter__(self) -> Iterator[Unit]:
        return (self[h] for h in range(len(self)))

    @cached_property
    def _by_name(self) -> dict[str, int]:
        return {n: h for h, n in enumerate(self.names)}

    def index(self, name: str) -> int:
        """The column of the unit called ``name``."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ArgumentKeyError(f"no unit named '{name}'") from None

    def __getitem__(self, key: int | str) -> Unit:
        h = self.index(key) if isinstance(key, str) else int(key)
        if not 0 <= h < len(self):
            raise IndexError(f"unit {h} out of range (0..{len(self) - 1})")
        incoming, outgoing = [], []
        for p, (enter, leave) in zip(self.params, self.ends):
            # test the compact arrays first: most params do not touch unit h
            hit_t, hit_s = bool(np.any(enter == h)), leave is not None and bool(np.any(leave == h))
            if not (hit_t or hit_s):
                continue
            t = np.broadcast_to(enter, p.shape).ravel()
            s = None if leave is None else np.broadcast_to(leave, p.shape).ravel()
            if hit_t:
                sel = (t == h) if s is None else (t == h) & (s != h)
                if sel.any():
                    incoming.append((p, np.flatnonzero(sel)))
            if hit_s:
                sel = (s == h) & (t != h)
                if sel.any():
                    outgoing.append((p, np.flatnonzero(sel)))
        return Unit(h, self.names[h], self.members[h], tuple(incoming), tuple(outgoing))

    @cached_property
    def sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """(|in_h|, |out_h|) for every unit: entries of the incoming and outgoing sides."""
        H = len(self)
        n_in, n_out = np.zeros(H, dtype=np.int64), np.zeros(H, dtype=np.int64)
        for p, (enter, leave) in zip(self.params, self.ends):
            t = np.broadcast_to(enter, p.shape).ravel()
            s = None if leave is None else np.broadcast_to(leave, p.shape).ravel()
            inside = np.zeros(t.shape, bool) if s is None else t == s
            n_in += np.bincount(t[~inside], minlength=H + 1)[:H]
            if s is not None:
                n_out += np.bincount(s[~inside], minlength=H + 1)[:H]
        return n_in, n_out

    def __str__(self) -> str:
        H = len(self)
        lines = [f"{H} rescaling units over {sum(len(m) for m in self.members)} channels"]
        n_in, n_out = self.sizes
        width = len(str(max(H - 1, 0)))
        shown = H if H <= 24 else 20
        for h in range(shown):
            nodes = len({n for n, _ in self.members[h]})
            lines.append(
                f"  {h:>{width}}  {self.names[h]}: {len(self.members[h])} channels in {nodes} nodes, "
                f"in {n_in[h]}, out {n_out[h]}"
            )
        if shown < H:
            lines.append(f"  ... ({H - shown} more)")
        return "\n".join(lines)

    __repr__ = __str__


# ------------------------------------------------------------------ the pass


def mark_crossing(touched: np.ndarray, tc: np.ndarray, sc: np.ndarray) -> None:
    """Mark the classes at either end of an entry whose target class ``tc`` and source class ``sc``
    (compact arrays, broadcast against each other entry by entry) differ."""
    if tc.size == 0 or sc.size == 0:
        return
    ndim = max(tc.ndim, sc.ndim)
    tc, sc = (a.reshape((1,) * (ndim - a.ndim) + a.shape) for a in (tc, sc))
    apart = all(a == 1 or b == 1 for a, b in zip(tc.shape, sc.shape))
    if not apart:  # shared axes: the pairs are those of the compact broadcast
        tc, sc = np.broadcast_arrays(tc, sc)
        crossing = tc != sc
        touched[tc[crossing]] = True
        touched[sc[crossing]] = True
        return
    # no shared axis (a dense or convolution weight): every target meets every source
    targets, sources = np.unique(tc), np.unique(sc)
    touched[targets if sources.size > 1 else targets[targets != sources[0]]] = True
    touched[sources if targets.size > 1 else sources[sources != targets[0]]] = True


def find_units(graph: Graph) -> tuple[Graph, Units]:
    """The rescaling units of ``graph`` (docs/math.md §5).

    Requires: a verified graph. Ensures: the graph is returned unchanged, with
    the units beside it. Preserves: everything (an analysis).

    Raises PathirError if one Param is both an edge weight and a bias.

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("fc1.weight", np.ones((3, 2)))))], bias=b.param("fc1.bias", np.zeros(3)))
    >>> y = b.identity("y", [(h, Dense(b.param("fc2.weight", np.ones((1, 3)))))])
    >>> _, units = find_units(b.build(outputs=[y]))
    >>> len(units), units.names
    (3, ('fc1:c0', 'fc1:c1', 'fc1:c2'))
    >>> print(units[0])
    unit 0 'fc1:c0': 1 channels in h; in: fc1.weight[2], fc1.bias[1]; out: fc2.weight[1]
    """
    offsets, pinned = _channel_offsets(graph)
    ties_a, ties_b, uses, reached = _fixed_ties_and_uses(graph, offsets)
    _tie_shared_params(uses, offsets, ties_a, ties_b)
    labels = _components(pinned.size, ties_a, ties_b)
    unit_of, H = _number_units(labels, pinned, reached, uses, offsets)

    channel_units = {n.name: unit_of[offsets[n.name] : offsets[n.name] + n.channels] for n in graph.nodes}
    for arr in channel_units.values():
        arr.setflags(write=False)

    params = tuple(graph.params())
    ends = tuple(_entry_channels(*uses[id(p)][0], offsets, unit_of) for p in params)
    return graph, Units(H, channel_units, params, ends, graph)


def _members(channel_units: Mapping[str, np.ndarray], H: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per unit, its (node name, channel) pairs, in the order of ``channel_units`` (node order)."""
    members: list[list[tuple[str, int]]] = [[] for _ in range(H)]
    for name, cu in channel_units.items():
        for c in np.flatnonzero(cu < H).tolist():
            members[cu[c]].append((name, c))
    return tuple(tuple(m) for m in members)


def _channel_offsets(graph: Graph) -> tuple[dict[str, int], np.ndarray]:
    """The global id of each node's first channel, and which global channels are pinned
    (channels of an input or an output, or whose bias has a ``fixed`` source: s = 0)."""
    offsets, total = {}, 0
    for n in graph.nodes:
        offsets[n.name] = total
        total += n.channels
    pinned = np.zeros(total, dtype=bool)
    for n in graph.nodes:
        fixed_bias = n.bias is not None and any(r.fixed for r in n.bias.sources)
        if n.kind is NodeKind.INPUT or n.name in graph.outputs or fixed_bias:
            pinned[offsets[n.name] : offsets[n.name] + n.channels] = True
    return offsets, pinned


def _fixed_ties_and_uses(graph: Graph, offsets):
    """The channel ties of every fixed-weight edge (two lists of global channel ids, tied pairwise),
    every use of every param: {id(param): [(param, source node or None, target node, map)]}, and which
    global channels some edge or bias reaches."""
    ties_a, ties_b = [], []
    uses: dict[int, list] = {}
    total = sum(n.channels for n in graph.nodes)
    reached = np.zeros(total, dtype=bool)  # a channel some edge or bias reaches (else: constant 0, dead)
    for v in graph.nodes:
        for e in v.edges:
            u = graph.node(e.source)
            if e.map.weight is None:
                pairs = np.asarray(e.map.channel_ties(u.shape), dtype=np.int64).reshape(-1, 2)
                ties_a.append(offsets[u.name] + pairs[:, 0])
                ties_b.append(offsets[v.name] + pairs[:, 1])
                reached[offsets[v.name] + pairs[:, 1]] = True
            else:
                uses.setdefault(id(e.map.weight), []).append((e.map.weight, u, v, e.map))
                reached[offsets[v.name] : offsets[v.name] + v.channels] = True
        if v.bias is not None:
            uses.setdefault(id(v.bias), []).append((v.bias, None, v, None))
            reached[offsets[v.name] : offsets[v.name] + v.channels] = True
    return ties_a, ties_b, uses, reached


def _tie_shared_params(uses, offsets, ties_a, ties_b) -> None:
    """Weight sharing: a param read by several edges ties, entry by entry, the target channels
    of its uses together and their source channels together (appended to the tie lists)."""
    for group in uses.values():
        if len(group) < 2:
            continue
        kinds = {u is None for _, u, _, _ in group}
        if len(kinds) > 1:
            raise PathirError(
                f"param '{group[0][0].name}' is both an edge weight and a bias: "
                "no per-channel rescaling keeps it one tensor"
            )
        ref_t, ref_s = _entry_channels(*group[0], offsets)
        for use in group[1:]:
            t, s = _entry_channels(*use, offsets)
            for a, b in ((ref_t, t), (ref_s, s)) if s is not None else ((ref_t, t),):
                # entry by entry; equal compact shapes pair up without the param's full shape
                if a.shape != b.shape:
                    a, b = np.broadcast_to(a, group[0][0].shape), np.broadcast_to(b, group[0][0].shape)
                ties_a.append(a.ravel()), ties_b.append(b.ravel())


def _number_units(labels: np.ndarray, pinned: np.ndarray, reached: np.ndarray, uses, offsets) -> tuple[np.ndarray, int]:
    """(the unit of every global channel, H), H where it has none, from its tie class: a class is a unit
    when no member is pinned and some free parameter enters or leaves it; units are numbered
    by their first channel in node order."""
    total = labels.size
    n_classes = int(labels.max()) + 1 if total else 0
    class_pinned = np.zeros(n_classes, dtype=bool)
    np.logical_or.at(class_pinned, labels, pinned)
    first = np.full(n_classes, total, dtype=np.int64)
    np.minimum.at(first, labels, np.arange(total))
    # a class that no free parameter enters or leaves is no unit: rescaling it moves nothing
    touched = np.zeros(n_classes, dtype=bool)
    for group in uses.values():
        t, src = _entry_channels(*group[0], offsets)
        if src is None:
            touched[labels[t]] = True
            continue
        mark_crossing(touched, labels[t], labels[src])
    # a class no edge or bias reaches (a zero channel of a ChannelMap / Gather, and what only it feeds)
    # starts and carries no path: rescaling it moves only parameters on no path, so it is no unit
    class_reached = np.zeros(n_classes, dtype=bool)
    np.logical_or.at(class_reached, labels, reached)
    free = np.flatnonzero(~class_pinned & touched & class_reached)
    order = free[np.argsort(first[free], kind="stable")]
    H = int(order.size)
    unit_of_class = np.full(n_classes, H, dtype=np.int64)
    unit_of_class[order] = np.arange(H)
    return (unit_of_class[labels] if total else np.zeros(0, dtype=np.int64)), H


def _entry_channels(param, u, v, m, offsets, lookup=None):
    """Global channel ids (or, with ``lookup``, units) of the target and source
    end of every entry of ``param`` read by this use, broadcastable to its shape."""
    if u is None:
        t, s = offsets[v.name] + np.arange(v.channels), None
    else:
        o, i = m.weight_channels(u.shape)
        t = offsets[v.name] + np.asarray(o, dtype=np.int64)
        s = offsets[u.name] + np.asarray(i, dtype=np.int64)
    if lookup is None:
        return t, s
    return lookup[t], None if s is None else lookup[s]


def _components(total: int, a: list, b: list) -> np.ndarray:
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    if total == 0:
        return np.zeros(0, dtype=np.int64)
    rows = np.concatenate(a) if a else np.zeros(0, dtype=np.int64)
    cols = np.concatenate(b) if b else np.zeros(0, dtype=np.int64)
    adj = coo_matrix((np.ones(rows.size, dtype=np.int8), (rows, cols)), shape=(total, total))
    _, labels = connected_components(adj, directed=False)
    return labels.astype(np.int64)


def _strip(name: str) -> str:
    for suffix in (".weight", ".bias"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def _names(graph: Graph, members) -> list[str]:
    """``<layer>:c<k>`` for a unit whose computing nodes (those with a
    parameterized edge) are all fed by one param first (one layer, or copies of
    it), ``<node>:c<k>`` for a one-node unit fed by none, ``stream:<prefix>/c<k>``
    for a class computed by several layers (a residual stream, a concat)."""
    return _names_from(_name_table(graph), members)


def _name_table(graph: Graph) -> dict[str, tuple[int, str] | None]:
    """Node -> (identity, name) of the first param it reads, None for none: all that naming reads of a graph."""
    first = {n.name: next((e.map.weight for e in n.edges if e.map.weight is not None), None) for n in graph.nodes}
    return {name: None if p is None else (id(p), p.name) for name, p in first.items()}


def _names_from(first_param: dict, members) -> list[str]:
    """:func:`_names` from the graph's :func:`_name_table`."""
    out, seen = [], {}
    pattern: dict[tuple[str, ...], tuple[str, str]] = {}  # node list -> (name prefix, node read for the channel)

    def name_pattern(node_names: tuple[str, ...]) -> tuple[str, str]:
        fed = [n for n in node_names if first_param[n] is not None]
        if len({first_param[n][0] for n in fed}) == 1:
            return f"{_strip(first_param[fed[0]][1])}:c", fed[0]
        if len(node_names) == 1:
            return f"{node_names[0]}:c", node_names[0]
        named = fed or list(node_names)  # the nodes that compute the class, not the pools after it
        label = os.path.commonprefix([n.split(".") for n in named])
        last = named[-1]
        return f"stream:{'.'.join(label) if label else last.split('.')[0]}/c", last

    for mem in members:
        node_names = tuple(dict.fromkeys(n for n, _ in mem))
        if node_names not in pattern:  # the units of one layer share their nodes: one pattern each
            pattern[node_names] = name_pattern(node_names)
        prefix, node = pattern[node_names]
        name = f"{prefix}{next(c for n, c in mem if n == node)}"
        if name in seen:
            seen[name] += 1
            name = f"{name}~{seen[name]}"
        else:
            seen[name] = 1
        out.append(name)
    return out
