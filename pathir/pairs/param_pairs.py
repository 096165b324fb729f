"""Unit pairs summed param by param, without the flat θ or B's row keys (docs/math.md §8).

A param's rows of B have compact ends (``pathir.analyses.incidence.compact_rows``):
an (entered unit, left unit) array pair broadcastable to its shape. Summing
m_i = c_i |θ_i|^p per (entered, left) pair a block of rows at a time gives the
`Pairs` that `pathir.pairs.unit_pairs.group_pairs` builds from the flat
masses and row keys, with no array of all n rows (a convolution's kernel
entries of one (out, in) channel pair collapse inside their block).
"""

from __future__ import annotations

import math

import numpy as np

from pathir.analyses.incidence import compact_rows
from pathir.pairs.unit_pairs import _LINEAR_RANGE, Pairs, _merge_sorted, _sum_by_key, ends_of_keys
from pathir.support.sorted_unique import sorted_unique

__all__ = ["row_blocks", "pair_sums", "separable_layout", "masses", "unit_column_blocks", "separable_blocks", "pairs_from_params"]

#: entries per block when the unit masses are summed: temporaries of a few MB, not of the largest param
BLOCK = 1 << 20


def row_blocks(value: np.ndarray, enter: np.ndarray, leave: np.ndarray):
    """(leading-axis slice, entries, entered unit, left unit) of a param, flat, a block of its leading axis
    at a time (``enter`` and ``leave``: the compact ends of ``compact_rows``, broadcastable to its shape)."""
    shape = value.shape
    if len(shape) == 0:
        yield slice(None), value.reshape(1), enter.reshape(1), leave.reshape(1)
        return
    ends = [e.reshape((1,) * (len(shape) - e.ndim) + e.shape) for e in (enter, leave)]
    per_row = max(1, int(np.prod(shape[1:])))
    step = max(1, BLOCK // per_row)
    for r in range(0, shape[0], step):
        block = (min(step, shape[0] - r), *shape[1:])
        parts = [np.broadcast_to(e if e.shape[0] == 1 else e[r:r + step], block).reshape(-1) for e in ends]
        yield slice(r, r + step), value[r:r + step].reshape(-1), parts[0], parts[1]


def pair_sums(e: np.ndarray, l: np.ndarray, w: np.ndarray, H: int, max_span: int | None = None):
    """(distinct keys e (H + 1) + l in increasing order, the sum of w ≥ 0 over each), pairs whose sum is 0
    left out: a bincount over the block's own range of (e, l) when it has at most ``max_span`` cells
    (default 4 per entry + 1024: a block of rows meets few units), else a sort."""

    e0, l0 = int(e.min()), int(l.min())
    span_l = int(l.max()) - l0 + 1
    span = (int(e.max()) - e0 + 1) * span_l
    if span <= (4 * e.size + 1024 if max_span is None else max_span):
        sums = np.bincount((e - e0) * span_l + (l - l0), weights=w, minlength=span)
        hit = np.flatnonzero(sums)
        return (hit // span_l + e0) * (H + 1) + (hit % span_l + l0), sums[hit]
    key, where = sorted_unique(e * (H + 1) + l, return_inverse=True)
    sums = np.bincount(where, weights=w, minlength=key.size)
    hit = np.flatnonzero(sums)
    return key[hit], sums[hit]


def masses(value: np.ndarray, p: float, cost: np.ndarray | None = None) -> np.ndarray:
    """c |θ|^p of a block (θ² directly for p = 2)."""
    w = np.square(value) if p == 2.0 else np.abs(value) ** p
    return w if cost is None else w * cost


def separable_layout(shape: tuple, enter: np.ndarray, leave: np.ndarray):
    """(entered unit per row of axis 0, start of each run of equal left units along axis 1, the left unit
    of each run) of a param whose entered unit depends on axis 0 only and left unit on axis 1 only (a
    dense or convolution weight, a bias), None for any other."""
    nd = len(shape)
    if nd == 0:
        return None
    e_full, l_full = (x.reshape((1,) * (nd - x.ndim) + x.shape) for x in (enter, leave))
    if any(n != 1 for n in e_full.shape[1:]) or l_full.shape[0] != 1 or any(n != 1 for n in l_full.shape[2:]):
        return None
    e_rows = np.broadcast_to(e_full.reshape(-1), (shape[0],))
    l_cols = np.broadcast_to(l_full.reshape(-1), (shape[1] if nd > 1 else 1,))
    starts = np.flatnonzero(np.r_[True, l_cols[1:] != l_cols[:-1]])
    return e_rows, starts, l_cols[starts]


def unit_column_blocks(value: np.ndarray, starts: np.ndarray, p: float, cost=None, wanted=None):
    """``(rows, A)`` a block of a separable param's rows at a time (a few MB): A (rows × runs) its masses
    c|θ|^p summed over the trailing axes and over each run of equal left units (``starts``, from
    `separable_layout`). Blocks holding no ``wanted`` row (a bool per row, None: all) are skipped."""
    rows_total = value.shape[0]
    step = max(1, BLOCK // max(1, value.size // max(1, rows_total)))
    for r in range(0, rows_total, step):
        rows = slice(r, r + step)
        if wanted is not None and not wanted[rows].any():
            continue
        chunk = value[rows]
        width = chunk.shape[1] if chunk.ndim > 1 else 1
        w = masses(chunk, p, None if cost is None else cost[rows]).reshape(chunk.shape[0], width, -1)
        w = w[:, :, 0] if w.shape[2] == 1 else w.sum(axis=2)
        yield rows, (np.add.reduceat(w, starts, axis=1) if starts.size < width else w)


def separable_blocks(value: np.ndarray, enter: np.ndarray, leave: np.ndarray, p: float, cost, H: int):
    """The (keys, sums) blocks of a param of `separable_layout`, None for any other: the masses are
    summed over the remaining axes and over each run of equal left units along axis 1 by reductions,
    with no per-entry keys. Pairs of zero mass are left out."""
    layout = separable_layout(value.shape, enter, leave)
    if layout is None:
        return None
    e_rows, starts, col_units = layout

    def blocks():
        for rows, w in unit_column_blocks(value, starts, p, cost):
            e = e_rows[rows]
            runs = np.flatnonzero(np.r_[True, e[1:] != e[:-1]])
            if runs.size < e.size:  # rows entering one unit in a run (an output layer's: none) summed first
                w, e = np.add.reduceat(w, runs, axis=0), e[runs]
            key = (e[:, None] * (H + 1) + col_units[None, :]).reshape(-1)
            w = w.reshape(-1)
            hit = np.flatnonzero(w)
            yield key[hit], w[hit]  # in any order, repeats allowed: the caller sorts and sums them

    return blocks()


# the linear sums are exact to rounding when every mass is normal and no sum can overflow
_LOW, _HIGH = 1e-290, 1e300


def pairs_from_params(units, p: float, costs: np.ndarray | None = None):
    """The `Pairs` of m = c ⊙ |θ|^p over ``units.params`` (``costs`` None or in θ order), or None where a
    pair's mass is below 1e-290, not finite, or their sum could pass 1e300: the caller then groups the
    flat masses (in log space where needed, `group_pairs`) and refuses non-finite ones."""

    H = len(units)
    keys, sums = [], []
    offset, count, high = 0, 0, 0.0
    for prm, (enter, leave) in zip(units.params, compact_rows(units)):
        cost = None if costs is None else costs[offset:offset + prm.size].reshape(prm.shape)
        offset += prm.size
        blocks = separable_blocks(prm.value, enter, leave, p, cost, H)
        if blocks is None:
            blocks = (pair_sums(e, l, masses(value, p, None if cost is None else cost[rows].reshape(-1)), H)
                      for rows, value, e, l in row_blocks(prm.value, enter, leave))
        parts = list(blocks)
        key = np.concatenate([k for k, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
        mass = np.concatenate([m for _, m in parts]) if parts else np.zeros(0)
        del parts
        if not key.size:
            continue
        # every pair's sum normal, finite and far from overflow (nan fails the test): exact to rounding
        if not (float(mass.min()) >= _LOW and float(mass.max()) < _HIGH):
            return None
        if not np.all(key[1:] > key[:-1]):  # rows in another order, or a sum split over blocks
            key, mass = _sum_by_key(key, mass)
        count += key.size
        high = max(high, float(mass.max()))
        keys.append(key)
        sums.append(mass)
    if count == 0 or not high * count < _HIGH:
        return None
    # the params' sorted keys merged (a layer's weights and its bias woven as one table, no sort of them all)
    key, (mass,), _ = _merge_sorted(keys, [sums], (np.add,), H + 1)
    big = float(mass.max())
    if not float(mass.min()) > big * _LINEAR_RANGE:  # Pairs.mass holds P_k / max P within 1e-282 of 1 (else: logs)
        return None
    mass /= big
    enter, leave = ends_of_keys(key, H)  # (key becomes leave in place)
    return Pairs(None, enter, leave, H, mass, math.log(big))
