"""Unit pairs summed param by param, without the flat θ or B's row keys (docs/math.md §8).

A param's rows of B have compact ends (``pathir.passes.incidence.compact_rows``):
an (entered unit, left unit) array pair broadcastable to its shape. Summing
m_i = c_i |θ_i|^p per (entered, left) pair a block of rows at a time gives the
`Pairs` that `pathir.rescaling.unit_pairs.group_pairs` builds from the flat
masses and row keys, with no array of all n rows (a convolution's kernel
entries of one (out, in) channel pair collapse inside their block).
"""

from __future__ import annotations

import math

import numpy as np

from pathir.errors import PathirError

__all__ = ["row_blocks", "pair_sums", "pairs_from_params"]

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
    from pathir.sorted_unique import sorted_unique

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


# the linear sums are exact to rounding when every mass is normal and no sum can overflow
_LOW, _HIGH = 1e-290, 1e300


def pairs_from_params(units, p: float, costs: np.ndarray | None = None):
    """The `Pairs` of m = c ⊙ |θ|^p over ``units.params`` (``costs`` None or in θ order), or None where
    a positive mass is below 1e-290 or their sum could pass 1e300 (the caller then groups the flat
    masses, in log space where needed: `group_pairs`). Raises PathirError where |θ|^p is not finite."""
    from pathir.passes.incidence import compact_rows
    from pathir.rescaling.unit_pairs import Pairs

    H = len(units)
    keys, sums = [], []
    low, high, count, offset = math.inf, 0.0, 0, 0
    for prm, (enter, leave) in zip(units.params, compact_rows(units)):
        cost = None if costs is None else costs[offset:offset + prm.size].reshape(prm.shape)
        offset += prm.size
        for rows, value, e, l in row_blocks(prm.value, enter, leave):
            w = np.abs(value) ** p
            if cost is not None:
                w = w * cost[rows].reshape(-1)
            top = float(w.max(initial=0.0))
            if not math.isfinite(top):
                raise PathirError(f"|θ|^{p:g} is not finite (huge or non-finite weights): ENorm cannot be computed")
            high, count = max(high, top), count + w.size
            low = min(low, float(np.min(w, where=w > 0, initial=math.inf)))
            key, total = pair_sums(e, l, w, H)
            keys.append(key)
            sums.append(total)
    if high == 0.0 or not (low >= _LOW and high * count < _HIGH):
        return None
    key, mass = np.concatenate(keys), np.concatenate(sums)
    if not np.all(key[1:] > key[:-1]):
        order = np.argsort(key, kind="stable")  # the blocks' keys are sorted runs: timsort's best case
        key, mass = key[order], mass[order]
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        key, mass = key[starts], np.add.reduceat(mass, starts)
    big = float(mass.max())
    enter, leave = np.divmod(key, H + 1)
    return Pairs(None, enter, leave, H, mass / big, math.log(big))
