"""Rescalings (docs/math.md §5): z ∈ R^H on the units, as θ ⊙ exp(-Bz/2) or as
per-channel log-scales.

Two equivalent descriptions of one group element:

- flat: θ_i ← θ_i · exp(-(Bz)_i / 2)                      (:func:`rescale_graph`);
- per channel: unit h's channels get s = z_h / 2 (pinned ones s = 0); edge
  entry u[i] → v[o] is multiplied by e^{s_v[o] - s_u[i]}, the bias of v[c] by
  e^{s_v[c]}                                            (:func:`apply_log_scales`).

The per-channel form is what write-back into a source model uses. Φ, the
activations a(θ, x) and the function R_θ are unchanged (exactly, up to rounding).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from pathir.analyses.incidence import check_units_match, compact_rows
from pathir.errors import ArgumentError, ArgumentKeyError, PathirError
from pathir.ir import Graph, NodeKind

__all__ = ["rescale_graph", "check_rescaling", "log_scales", "apply_log_scales", "check_log_scales", "checked_param_factors", "param_factors"]


def _z(units, z) -> np.ndarray:
    try:
        z = np.asarray(z)
    except (TypeError, ValueError, RuntimeError) as err:  # (a torch tensor that requires grad: detach it)
        raise ArgumentError(f"z must be an array of log-scales, one per unit ({len(units)}); got "
                            f"{type(z).__name__} ({err})") from None
    if z.dtype.kind not in "iuf":
        raise ArgumentError(f"z must be real numbers (log-scales, one per unit); got an array of dtype {z.dtype}")
    z = z.astype(np.float64)
    if z.shape != (len(units),):
        raise ArgumentError(f"z must have one entry per unit, shape ({len(units)},); got {z.shape}")
    if not np.all(np.isfinite(z)):
        raise ArgumentError("z has non-finite entries")
    return z


#: entries of a param rescaled at a time (a few MB: both factors are applied while the block is in cache)
_BLOCK = 1 << 18


def rescale_graph(graph: Graph, units, z, kept=None) -> Graph:
    """The graph with θ ← θ ⊙ exp(-Bz/2) (B from :func:`pathir.analyses.incidence.incidence`).

    Computed param by param from the units' compact row ends, (Bz)_i = z_l(i) - z_e(i), without B,
    a block of rows at a time; ``kept(old block, new block) -> bool``, when given, is asked of each
    block while it is in cache, and a False raises PathirError naming the param (the range check
    of a write-back, in the same pass).

    Parameters
    ----------
    graph : Graph
    units : Units of ``graph`` (from ``find_units``), or of a graph with the same structure
    z : (H,) array of log-scales, one per unit
    kept : optional predicate on (old, new) blocks of one param

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> from pathir.analyses.find_units import find_units
    >>> b = GraphBuilder()
    >>> x = b.input("x", (1,))
    >>> h = b.relu("h", [(x, Dense(b.param("w1", [[2.0]])))], bias=b.param("b1", [1.0]))
    >>> y = b.identity("y", [(h, Dense(b.param("w2", [[3.0]])))])
    >>> g = b.build(outputs=[y])
    >>> r = rescale_graph(g, find_units(g)[1], [2 * np.log(2)])   # unit h: in x2, out /2
    >>> [p.value.ravel().tolist() for p in r.params()]
    [[4.0], [2.0], [1.5]]
    """

    factors = _entry_factors(graph, units, z)

    def scaled(p):
        value = np.empty(p.shape)
        for at, block in _scaled_blocks(p, factors[id(p)], value):
            _check(p, at, block, kept)
        return p.with_value(value, owned=True)

    return graph.map_params(scaled)


def check_rescaling(graph: Graph, units, z, kept) -> None:
    """Raise PathirError naming the first param of ``graph`` with a block of its rescaling by z for which
    ``kept(old block, new block)`` is False (the range check of `rescale_graph`, ``kept=``): the same
    products, a block of rows at a time into one reused buffer, nothing kept."""
    factors = _entry_factors(graph, units, z)
    for p in graph.params():
        for at, block in _scaled_blocks(p, factors[id(p)], None):
            _check(p, at, block, kept)


def _check(p, at, block, kept) -> None:
    if kept is not None and not kept(p.value[at], block):
        raise PathirError(f"the rescaled param '{p.name}' overflows or underflows float64: the rescaling "
                          "is too large; nothing was changed")


def _entry_factors(graph: Graph, units, z) -> dict:
    """{id(param): (e^{z_e/2}, e^{-z_l/2})} on the units' compact row ends (one of them 1 where |z| is
    so large that apart they would overflow): no exponential over every entry."""
    z = _z(units, z)
    params = graph.params()
    check_units_match(params, units)
    half = np.append(z / 2, 0.0)  # index H ("no unit") reads 0
    return {id(p): ((np.exp(half[enter]), np.exp(-half[leave])) if np.abs(half).max() < 300
                    else (np.exp(half[enter] - half[leave]), 1.0))
            for p, (enter, leave) in zip(params, compact_rows(units))}


def _scaled_blocks(p, factors, out: np.ndarray | None):
    """(rows, θ[rows] · f_in · f_out) of param ``p``, a block of leading rows at a time (in cache), written
    into ``out[rows]``, or into one scratch block reused block after block when ``out`` is None."""
    f_in, f_out = (np.broadcast_to(f, p.shape) for f in factors)
    rows = max(1, _BLOCK // max(1, p.size // max(1, p.shape[0]))) if p.shape else 1
    scratch = np.empty(min(p.size, rows * (p.size // max(1, p.shape[0])))) if out is None and p.shape else None
    for at in (slice(i, i + rows) for i in range(0, p.shape[0], rows)) if p.shape else [...]:
        part = p.value[at]
        target = out[at] if out is not None else part.copy() if scratch is None else \
            scratch[:part.size].reshape(part.shape)
        block = np.multiply(part, f_in[at], out=target)
        block *= f_out[at]
        yield at, block


def log_scales(graph: Graph, units, z) -> dict[str, np.ndarray]:
    """{node name: (channels,) log-scale s}: s = z_h / 2 on the channels of unit h, 0 on pinned ones."""
    z = _z(units, z)
    half = np.append(z / 2, 0.0)  # index H ("no unit") reads 0
    return {n.name: half[np.asarray(units.channel_units[n.name])] for n in graph.nodes}


def _scales(graph: Graph, log_scales: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for n in graph.nodes:
        s = log_scales.get(n.name)
        s = np.zeros(n.channels) if s is None else np.asarray(s, dtype=np.float64)
        if s.shape != (n.channels,):
            raise ArgumentError(f"log-scale of node '{n.name}' has shape {s.shape}, expected ({n.channels},)")
        out[n.name] = s
    unknown = set(log_scales) - set(out)
    if unknown:
        raise ArgumentKeyError(f"log-scales name nodes not in the graph: {sorted(unknown)}")
    return out


def check_log_scales(graph: Graph, log_scales: Mapping[str, np.ndarray], atol: float = 1e-9) -> dict[str, np.ndarray]:
    """Check that ``log_scales`` is a rescaling of ``graph``: every node given,
    zero on inputs and outputs, equal across every fixed edge's tied channels,
    and one factor per entry of a shared param. Returns them as float64 arrays."""
    return checked_param_factors(graph, log_scales, atol)[0]


def checked_param_factors(graph: Graph, log_scales: Mapping[str, np.ndarray], atol: float = 1e-9):
    """(:func:`check_log_scales`'s float64 log-scales, their :func:`param_factors`), the factors formed once."""
    s = _scales(graph, log_scales)
    for n in graph.nodes:
        if (n.kind is NodeKind.INPUT or n.name in graph.outputs) and np.any(np.abs(s[n.name]) > atol):
            raise PathirError(f"log-scales move the input/output node '{n.name}', which is pinned")
        for e in n.edges:
            if e.map.weight is not None:
                continue
            pairs = np.asarray(e.map.channel_ties(graph.node(e.source).shape), dtype=np.int64).reshape(-1, 2)
            gap = np.abs(s[e.source][pairs[:, 0]] - s[n.name][pairs[:, 1]])
            if gap.size and gap.max() > atol:
                raise PathirError(
                    f"log-scales differ by {gap.max():.3g} across the fixed edge "
                    f"{e.source} -> {n.name} ({e.map.describe()}), which ties them"
                )
    return s, param_factors(graph, s, atol)


def param_factors(graph: Graph, s: Mapping[str, np.ndarray], atol: float = 1e-9):
    """{id(param): (param, out log-factor, in log-factor, target node, source node or None)}.

    For a weight on u -> v: out = s_v[target channel], in = -s_u[source channel],
    both broadcast to the param's shape; for a bias of v: out = s_v, in = 0.
    A param read by several edges must get the same factors from each."""
    out = {}
    for v in graph.nodes:
        uses = [(e.map.weight, graph.node(e.source), e.map) for e in v.edges if e.map.weight is not None]
        if v.bias is not None:
            uses.append((v.bias, None, None))
        for p, u, m in uses:
            if u is None:
                fo, fi = s[v.name], np.zeros(p.shape)
            else:
                o, i = m.weight_channels(u.shape)
                fo = np.broadcast_to(s[v.name][np.asarray(o)], p.shape)
                fi = np.broadcast_to(-s[u.name][np.asarray(i)], p.shape)
            if id(p) in out:
                _, po, pi, *_ = out[id(p)]
                if not (np.allclose(po, fo, rtol=0, atol=atol) and np.allclose(pi, fi, rtol=0, atol=atol)):
                    raise PathirError(f"param '{p.name}' is shared by edges that the log-scales rescale differently")
                continue
            out[id(p)] = (p, fo, fi, v, u)
    return out


def apply_log_scales(graph: Graph, log_scales: Mapping[str, np.ndarray]) -> Graph:
    """The graph with every edge entry u[i] → v[o] multiplied by e^{s_v[o] - s_u[i]}
    and every bias of v[c] by e^{s_v[c]} (after :func:`check_log_scales`)."""
    s = check_log_scales(graph, log_scales)
    factors = param_factors(graph, s)
    return graph.map_params(lambda p: p.with_value(p.value * np.exp(factors[id(p)][1] + factors[id(p)][2])))
