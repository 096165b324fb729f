"""normalize: the canonical representative of a rescaling orbit (docs/math.md §8).

Each unit is rescaled so that its incoming parameter vector (weights entering
it from outside, biases of its neurons) has unit ℓ_p norm. With w = |θ|^p and
y = p·z/2, a rescaling multiplies w_i by e^{-(By)_i}, so unit h's incoming mass
is I_h = e^{y_h} Σ_{i ∈ in_h} w_i e^{-y_src(i)} (y_src = 0 for a bias or a weight
from a pinned neuron). I_h = 1 for every h reads, with u = e^{-y},

    u = M u + b,      M[h, k] = Σ_{i: k -> h} w_i,      b[h] = Σ_{i ∈ in_h, no source unit} w_i.

On an acyclic unit graph this is forward substitution in topological order:
the units are visited in order and each is normalised (docs/math.md §8). Fixed
edges can close cycles between units (a residual stream feeds a block's inner
channels, which feed the stream back); the strongly connected components are
then visited in topological order and each one's system is solved exactly. By
Perron–Frobenius a component has a positive solution iff the spectral radius
of its block of M is < 1, and then only one: the result depends on the orbit
alone, normalize(θ) = normalize(Dθ). When the radius is ≥ 1 no rescaling gives
every unit unit-norm incoming weights, and PathirError says so.

Units with no nonzero incoming entry (dead) keep z = 0 (they are listed).
Forward substitution runs in log-space, so the scales may span any range. On a
feed-forward graph of dense and convolution params it runs param by param
instead, one mat-vec per block of rows (`pathir.enorm.normalize_forward`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pathir.analyses.find_units import find_units
from pathir.analyses.incidence import check_units_match, compact_rows
from pathir.enorm.normalize_forward import feedforward_log_u
from pathir.errors import ArgumentError, PathirError
from pathir.ir import Graph
from pathir.pairs.param_pairs import pair_sums, row_blocks, separable_blocks
from pathir.rescaling.apply import rescale_graph
from pathir.support.sorted_unique import sorted_unique

__all__ = ["normalize", "normalize_log_scales", "Normalization", "check_p"]


@dataclass(frozen=True, eq=False)
class Normalization:
    """The log-scales z (θ ← θ ⊙ e^{-Bz/2}) of the canonical representative, the
    degenerate units (kept at 0) and the number of unit cycles solved jointly."""

    z: np.ndarray
    degenerate: np.ndarray
    cycles: int
    p: float



def _summed_pairs(value: np.ndarray, enter: np.ndarray, leave: np.ndarray, p: float, H: int):
    """(keys, positive finite sums of |θ|^p) of a param by `separable_blocks`, or None where it does not
    apply or a sum is not finite (the entry-by-entry loop then counts only w > 0, as always)."""

    blocks = separable_blocks(value, enter, leave, p, None, H)
    if blocks is None:
        return None
    parts = list(blocks)
    key = np.concatenate([k for k, _ in parts])
    mass = np.concatenate([m for _, m in parts])
    return (key, mass) if np.all(np.isfinite(mass)) else None


def _sorted_segment_logsumexp(vals: np.ndarray, seg: np.ndarray, count: int) -> np.ndarray:
    """log Σ e^{vals} per segment id in [0, count) (-inf for an empty one), ``seg`` non-decreasing:
    reductions over the runs of equal ids, no scattered updates."""
    out = np.full(count, -np.inf)
    if seg.size == 0:
        return out
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    top = np.maximum.reduceat(vals, starts)
    safe = np.where(np.isfinite(top), top, 0.0)
    total = np.add.reduceat(np.exp(vals - np.repeat(safe, np.diff(np.append(starts, seg.size)))), starts)
    with np.errstate(divide="ignore"):
        out[seg[starts]] = np.where(np.isfinite(top), safe + np.log(total), -np.inf)
    return out


def _levels(n_comp: int, c_src: np.ndarray, c_tgt: np.ndarray) -> list[np.ndarray]:
    """Components grouped by level of a topological order (Kahn) of the condensation."""
    if c_src.size > 1 and not np.all(c_src[1:] >= c_src[:-1]):  # (the caller's edges come sorted)
        order = np.argsort(c_src, kind="stable")
        c_src, c_tgt = c_src[order], c_tgt[order]
    start = np.searchsorted(c_src, np.arange(n_comp + 1))
    indeg = np.bincount(c_tgt, minlength=n_comp)
    frontier = np.flatnonzero(indeg == 0)
    levels = []
    while frontier.size:
        levels.append(frontier)
        lengths = start[frontier + 1] - start[frontier]
        hit = c_tgt[np.arange(lengths.sum()) + np.repeat(start[frontier] - (np.cumsum(lengths) - lengths), lengths)]
        dropped = np.bincount(hit, minlength=n_comp)
        indeg -= dropped
        frontier = np.flatnonzero((dropped > 0) & (indeg == 0))  # sorted, each once
    return levels


def unit_masses(graph: Graph, units, p: float):
    """(b, M) of the module docstring with w = |θ|^p, read param by param from the units' compact
    row ends (no B, no flat θ): b[h] = Σ w over the rows entering h from no unit, M (CSR, H × H)
    sums w over the rows entering h and leaving k; only w > 0 counts."""
    import scipy.sparse as sp


    H = len(units)
    params = graph.params()
    check_units_match(params, units)
    b = np.zeros(H + 1)
    keys, masses = [], []
    for prm, (enter, leave) in zip(params, compact_rows(units)):
        summed = _summed_pairs(prm.value, enter, leave, p, H)
        if summed is not None:  # a dense or convolution weight, a bias: its pairs summed by reductions
            key, mass = summed
            e, l = np.divmod(key, H + 1)
            free = (e < H) & (l == H)
            b += np.bincount(e[free], weights=mass[free], minlength=H + 1)
            pair = (e < H) & (l < H)
            keys.append(key[pair])
            masses.append(mass[pair])
            continue
        for _, value, e, l in row_blocks(prm.value, enter, leave):
            w = np.abs(value) ** p
            enters = (e < H) & (w > 0)
            free = enters & (l == H)
            b += np.bincount(e[free], weights=w[free], minlength=H + 1)
            pair = enters & (l < H)
            if pair.any():
                key, mass = pair_sums(e[pair], l[pair], w[pair], H)
                keys.append(key)
                masses.append(mass)
    key = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    mass = np.concatenate(masses) if masses else np.zeros(0)
    M = sp.csr_array((mass, np.divmod(key, H + 1)), shape=(H, H))  # duplicates summed
    M.sum_duplicates()
    M.eliminate_zeros()
    return b[:H], M


def _check_range(graph: Graph, units, result: "Normalization") -> "Normalization":
    """PathirError where |θ|^p left float64's range: a z that is not finite (an overflow), or a unit taken for
    degenerate (no nonzero incoming entry) that has one (its masses underflowed to 0); else ``result``."""
    z, degenerate, p = result.z, result.degenerate, result.p
    if not np.all(np.isfinite(z)):
        raise PathirError(f"normalize: |θ|^{p:g} overflows float64 for some weights (huge |θ|), which leaves "
                          f"{int(np.sum(~np.isfinite(z)))} units without a finite log-scale; use a smaller p, or rescale "
                          "the model into range first. Nothing was changed")
    if not len(degenerate):
        return result
    b, M = unit_masses(graph, units, 1.0)  # |θ| itself: nonzero wherever an entry is (subnormals are refused)
    live = np.asarray(degenerate)[(b[degenerate] > 0) | (np.diff(M.indptr)[degenerate] > 0)]
    if live.size:
        raise PathirError(f"normalize: |θ|^{p:g} underflows float64 for the weights entering {live.size} units (the first: "
                          f"{units.names_of(live[:1])[0]}), which would be taken for dead units and left alone; use a "
                          "smaller p (p=1 keeps |θ| itself), or rescale the model into range first. Nothing was changed")
    return result


def check_p(p) -> None:
    """ArgumentError unless p (the exponent of ENorm's cost Σ c |θ|^p) is a finite number > 0: p = inf is no sum."""
    if not (p > 0 and math.isfinite(p)):
        raise ArgumentError(f"p must be a finite number > 0, got {p}")


def normalize_log_scales(graph: Graph, units, p: float = 2.0) -> Normalization:
    """The log-scales of the canonical representative of ``graph``'s orbit (module docstring).

    Raises PathirError when a cycle of units admits no normalisation. Memory: a few
    blocks of θ at a time beside M (no B, no flat θ; see :func:`unit_masses`).
    """
    from scipy.sparse.csgraph import connected_components


    check_p(p)
    params = graph.params()
    check_units_match(params, units)
    forward = feedforward_log_u(params, units, p)
    if forward is not None:  # a feed-forward unit graph of dense and convolution params: one pass
        return _check_range(graph, units, _normalization(*forward, 0, p))
    H = len(units)
    b, M = unit_masses(graph, units, p)
    with np.errstate(divide="ignore"):
        log_b, log_m = np.log(b), np.log(M.data)
    degenerate = np.flatnonzero((b == 0) & (np.diff(M.indptr) == 0))

    n_comp, label = connected_components(M, directed=True, connection="strong")
    m_rows = np.repeat(np.arange(H), np.diff(M.indptr))  # M[h, k] > 0: edge k -> h
    cross = label[m_rows] != label[M.indices]
    # the condensation's edges (source, target), distinct, sorted, as one int64 key each
    edge_key = sorted_unique(label[M.indices[cross]].astype(np.int64) * n_comp + label[m_rows[cross]])
    edges = np.divmod(edge_key, n_comp)
    members = np.split(np.argsort(label, kind="stable"), np.cumsum(np.bincount(label, minlength=n_comp))[:-1])
    log_u = np.zeros(H)
    live = np.ones(H, dtype=bool)
    live[degenerate] = False
    cycles = 0
    for level in _levels(n_comp, edges[0], edges[1]):
        rows = np.concatenate([members[c] for c in level])
        rows = rows[live[rows]]
        size = np.bincount(label[rows], minlength=n_comp)[label[rows]]
        # every entering mass from outside the unit's own component: log b'_h
        lo, lengths = M.indptr[rows], M.indptr[rows + 1] - M.indptr[rows]
        seg = np.repeat(np.arange(rows.size), lengths)
        # the entries of M's rows ``rows``, row after row: lo[r] + (position within the row)
        idx = np.arange(seg.size) + np.repeat(lo - (np.cumsum(lengths) - lengths), lengths)
        outside = label[M.indices[idx]] != label[rows[seg]]
        ext = np.logaddexp(_sorted_segment_logsumexp(log_m[idx[outside]] + log_u[M.indices[idx[outside]]],
                                                     seg[outside], rows.size), log_b[rows])
        single = size == 1
        log_u[rows[single]] = ext[single]
        for c in np.unique(label[rows[~single]]):
            cycles += 1
            sel = label[rows] == c
            log_u[rows[sel]] = _solve_cycle(M, rows[sel], ext[sel], units, p)
    return _check_range(graph, units, _normalization(log_u, degenerate, cycles, p))


def _normalization(log_u: np.ndarray, degenerate: np.ndarray, cycles: int, p: float) -> Normalization:
    """The result from log u (u = e^{-pz/2}): degenerate units keep z = 0."""
    z = -2.0 * log_u / p
    z[degenerate] = 0.0
    return Normalization(z=z, degenerate=degenerate, cycles=cycles, p=float(p))


def _solve_cycle(M, comp: np.ndarray, log_ext: np.ndarray, units, p: float) -> np.ndarray:
    """log u on one strongly connected component: (I - M_CC) u = b' (b' = e^{log_ext})."""
    import scipy.sparse as sp
    import scipy.sparse.linalg as spla

    shift = float(log_ext.max())
    if not math.isfinite(shift):
        raise PathirError(f"units {_names(units, comp)} only receive mass from each other: cannot normalise them")
    rhs = np.exp(log_ext - shift)
    block = M[comp][:, comp]
    system = sp.identity(comp.size, format="csc") - block.tocsc()
    with np.errstate(all="ignore"):
        x = np.linalg.solve(system.toarray(), rhs) if comp.size <= 2000 else spla.spsolve(system, rhs)
    residual = np.abs(system @ x - rhs).max() if np.all(np.isfinite(x)) else math.inf
    if not (np.all(x > 0) and residual <= 1e-9 * max(1.0, float(np.abs(x).max()))):
        raise PathirError(
            f"no rescaling gives every unit unit l{p:g}-norm incoming weights: the units {_names(units, comp)} "
            f"form a cycle (through fixed edges such as residual skips) whose incoming l{p:g} mass has spectral "
            "radius >= 1; the canonical representative (docs/math.md §8) exists only below 1"
        )
    return np.log(x) + shift


def _names(units, comp) -> str:
    shown = ", ".join(f"'{units.names[h]}'" for h in comp[:3])
    return shown + (f", ... ({comp.size} in all)" if comp.size > 3 else "")


def normalize(graph: Graph, p: float = 2.0, units=None) -> Graph:
    """The canonical representative of ``graph``'s rescaling orbit (docs/math.md §8).

    Requires: a verified graph; ``units`` from ``find_units(graph)`` (found if
    None). Ensures: every non-degenerate unit's incoming weights and bias have
    unit ℓ_p norm; normalize(θ) = normalize(Dθ) for every rescaling D.
    Preserves: Φ, the activations and the function (only rescales). Raises
    PathirError when a cycle of units admits no normalisation (module docstring).

    >>> import numpy as np
    >>> from pathir.ir import GraphBuilder, Dense
    >>> b = GraphBuilder()
    >>> x = b.input("x", (2,))
    >>> h = b.relu("h", [(x, Dense(b.param("w1", [[3.0, 4.0]])))])
    >>> y = b.identity("y", [(h, Dense(b.param("w2", [[2.0]])))])
    >>> [np.round(p.value, 12).ravel().tolist() for p in normalize(b.build(outputs=[y]), p=2).params()]
    [[0.6, 0.8], [10.0]]
    """

    if units is None:
        units = find_units(graph)[1]
    return rescale_graph(graph, units, normalize_log_scales(graph, units, p).z)
