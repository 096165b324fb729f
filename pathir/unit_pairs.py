"""The unit incidence matrix B (MATH.md §5) read as pairs of units.

Row i of B holds at most one -1 (the unit parameter i enters, e(i)) and at most
one +1 (the unit it leaves, l(i)). With the convention z_none = 0,

    (Bz)_i = z_{l(i)} - z_{e(i)}   and   Σ_i m_i e^{(Bz)_i} = Σ_k P_k e^{z_{l_k} - z_{e_k}}

over the distinct pairs k = (e_k, l_k), with P_k = Σ_{i in k} m_i. The PathCond
sum S (m = g) and the ENorm criterion (m = c θ², z -> -z) depend on the masses
only through the pairs, so the block solvers work on them: a dense layer of
fan-in 3072 collapses to one pair per unit, a 3x3 convolution to one pair per
(out, in) channel.

Units are 0..H-1; index H stands for "no unit" (an input, an output, or a unit
frozen at z = 0), so z is padded with one trailing 0 (`pad`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

__all__ = [
    "row_units", "side_counts", "degenerate_units", "pad", "Pairs", "group_pairs",
    "greedy_coloring", "segment_logsumexp", "stable_order", "SideSums", "side_sums",
]

# A linear-domain sum below this (relative to its static bound 1) may have lost
# terms to underflow: recompute it in log-space.
_TINY = 1e-280


def row_units(B) -> tuple[np.ndarray, np.ndarray, int]:
    """``(enter, leave, H)``: per row of B, the unit it enters (-1 entry) and leaves (+1 entry), or H.

    Raises ValueError unless every non-zero of B is ±1 and no row has two
    entries of one sign.
    """
    csr = sp.csr_array(B)
    if not csr.has_canonical_format:
        csr = csr.copy()
        csr.sum_duplicates()
    n, H = csr.shape
    v = csr.data
    if not np.all(np.abs(v) == 1):
        csr = csr.copy()
        csr.eliminate_zeros()
        v = csr.data
        if not np.all(np.abs(v) == 1):
            raise ValueError("B may hold only -1, 0 and +1")
    counts = np.diff(csr.indptr)
    if counts.max(initial=0) > 2:
        raise ValueError(f"row {int(np.argmax(counts))} of B has more than two non-zeros")
    first = csr.indptr[:-1][counts == 2]
    same = np.flatnonzero(v[first] == v[first + 1])
    if same.size:
        row = int(np.flatnonzero(counts == 2)[same[0]])
        raise ValueError(f"row {row} of B has two {v[first[same[0]]]:+g} entries: a parameter enters/leaves at most one unit")
    r = np.repeat(np.arange(n), counts)
    neg = v < 0
    enter = np.full(n, H, dtype=np.int64)
    leave = np.full(n, H, dtype=np.int64)
    enter[r[neg]] = csr.indices[neg]
    pos = ~neg
    leave[r[pos]] = csr.indices[pos]
    return enter, leave, H


def side_counts(enter: np.ndarray, leave: np.ndarray, H: int) -> np.ndarray:
    """A_h = |in_h| - |out_h| (MATH.md §7), so that -Σ_i (Bz)_i = A·z."""
    return np.bincount(enter, minlength=H + 1)[:H] - np.bincount(leave, minlength=H + 1)[:H]


def degenerate_units(positive: np.ndarray | None, enter: np.ndarray, leave: np.ndarray, H: int) -> np.ndarray:
    """Units with no positive mass on their whole incoming or whole outgoing side (sorted).

    ``positive`` masks the rows with mass > 0 (None: all of them).
    """
    if positive is not None:
        enter, leave = enter[positive], leave[positive]
    has_in = np.bincount(enter, minlength=H + 1)[:H] > 0
    has_out = np.bincount(leave, minlength=H + 1)[:H] > 0
    return np.flatnonzero(~(has_in & has_out))


def pad(z: np.ndarray) -> np.ndarray:
    """z with the trailing 0 of "no unit"."""
    return np.append(z, 0.0)


def segment_logsumexp(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """log Σ exp over the contiguous, non-empty segments beginning at ``starts``."""
    top = np.maximum.reduceat(values, starts)
    lengths = np.diff(np.append(starts, values.size))
    with np.errstate(divide="ignore"):
        return top + np.log(np.add.reduceat(np.exp(values - np.repeat(top, lengths)), starts))


def stable_order(keys: np.ndarray, bound: int) -> np.ndarray:
    """``argsort(keys, kind="stable")`` for integer keys in [0, bound]; radix sort when they fit 16 bits."""
    if bound < 1 << 15:
        keys = keys.astype(np.int16)
    return np.argsort(keys, kind="stable")


@dataclass(frozen=True)
class Pairs:
    """Distinct (entered, left) unit pairs, sorted by (enter, leave), with log P_k > -inf."""

    log_mass: np.ndarray
    enter: np.ndarray
    leave: np.ndarray
    num_units: int

    def degenerate(self) -> np.ndarray:
        """Units missing from the entered side or from the left side of every pair."""
        return degenerate_units(None, self.enter, self.leave, self.num_units)

    def freeze(self, units) -> "Pairs":
        """The pairs with ``units`` read as "no unit" (their z fixed at 0), regrouped."""
        units = np.asarray(units, dtype=np.int64)
        if units.size == 0:
            return self
        H = self.num_units
        remap = np.arange(H + 1)
        remap[units] = H
        key = remap[self.enter] * (H + 1) + remap[self.leave]
        order = np.argsort(key, kind="stable")
        sk = key[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        keys = sk[starts]
        return Pairs(segment_logsumexp(self.log_mass[order], starts), keys // (H + 1), keys % (H + 1), H)


def group_pairs(m: np.ndarray, enter: np.ndarray, leave: np.ndarray, H: int) -> Pairs:
    """Group the rows of B with mass m_i > 0 by unit pair.

    Sums are linear (one bincount) when the masses span less than ~650 nats,
    and grouped log-sum-exps otherwise, so no mass is lost to underflow.
    """
    pos = m > 0
    if not pos.all():
        m, enter, leave = m[pos], enter[pos], leave[pos]
    if m.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Pairs(np.zeros(0), empty, empty, H)
    key = enter * (H + 1) + leave
    top = m.max()
    if m.min() > top * 1e-282:
        w = m / top
        if (H + 1) ** 2 <= max(4 * m.size, 1 << 22):
            sums = np.bincount(key, weights=w, minlength=(H + 1) ** 2)
            keys = np.flatnonzero(sums)
            total = sums[keys]
        else:
            keys, inverse = np.unique(key, return_inverse=True)
            total = np.bincount(inverse, weights=w)
        log_mass = np.log(total) + math.log(top)
    else:
        order = np.argsort(key, kind="stable")
        sk = key[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        keys = sk[starts]
        log_mass = segment_logsumexp(np.log(m[order]), starts)
    return Pairs(log_mass, keys // (H + 1), keys % (H + 1), H)


def greedy_coloring(pairs: Pairs, active: np.ndarray, by_leave: np.ndarray | None = None) -> np.ndarray:
    """Colour per unit (-1 for inactive ones) such that no pair joins two units of one colour.

    Greedy in unit order (smallest colour unused by the neighbours): layered
    networks, whose units are numbered layer by layer, get two colours.
    ``by_leave`` is ``stable_order(pairs.leave, H)`` if already at hand.
    """
    H = pairs.num_units
    if by_leave is None:
        by_leave = stable_order(pairs.leave, H)
    grid = np.arange(H + 2)
    e_bounds = np.searchsorted(pairs.enter, grid)
    l_sorted = pairs.leave[by_leave]
    l_bounds = np.searchsorted(l_sorted, grid)
    e_of_l = pairs.enter[by_leave]
    colour = np.full(H + 1, -1, dtype=np.int64)  # colour[H] = -1: "no unit" constrains nothing
    for u in np.flatnonzero(active):
        nb = np.concatenate((colour[pairs.leave[e_bounds[u]:e_bounds[u + 1]]], colour[e_of_l[l_bounds[u]:l_bounds[u + 1]]]))
        nb = nb[nb >= 0]
        if nb.size == 0:
            colour[u] = 0
            continue
        used = np.zeros(nb.max() + 2, dtype=bool)
        used[nb] = True
        colour[u] = int(np.argmin(used))
    return colour[:H]


@dataclass(frozen=True)
class SideSums:
    """Row sums log Σ_{k in row r} P_k e^{f[col_k]} for a fixed pattern of (row, col, log P_k).

    Evaluated as one sparse mat-vec on P_k / max_row P (static) times
    e^{f - max f}; rows whose linear sum might have underflowed are redone in
    log-space, so the result is exact for any spread of P and f.
    """

    rows: np.ndarray
    matrix: sp.csr_array
    log_data: np.ndarray
    row_top: np.ndarray
    starts: np.ndarray

    def __call__(self, f: np.ndarray) -> np.ndarray:
        shift = f.max()
        with np.errstate(divide="ignore"):
            out = self.row_top + shift + np.log(self.matrix @ np.exp(f - shift))
        bad = ~(out - self.row_top - shift > math.log(_TINY))
        if bad.any():
            exact = segment_logsumexp(self.log_data + f[self.matrix.indices], self.starts)
            out[bad] = exact[bad]
        return out


def side_sums(row: np.ndarray, col: np.ndarray, log_mass: np.ndarray, num_cols: int) -> SideSums:
    """The SideSums of pairs given with ``row`` non-decreasing; ``rows`` lists the distinct row ids."""
    if row.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return SideSums(empty, sp.csr_array((0, num_cols)), np.zeros(0), np.zeros(0), empty)
    starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
    row_top = np.maximum.reduceat(log_mass, starts)
    lengths = np.diff(np.append(starts, row.size))
    data = np.exp(log_mass - np.repeat(row_top, lengths))
    indptr = np.append(starts, row.size)
    matrix = sp.csr_array((data, col, indptr), shape=(starts.size, num_cols))
    return SideSums(row[starts], matrix, log_mass, row_top, starts)
