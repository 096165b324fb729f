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
    "greedy_coloring", "segment_logsumexp", "SideSums", "side_sums",
]

# A linear-domain sum below this (relative to its static bound 1) may have lost
# terms to underflow: recompute it in log-space.
_TINY = 1e-280


def row_units(B) -> tuple[np.ndarray, np.ndarray, int]:
    """``(enter, leave, H)``: per row of B, the unit it enters (-1 entry) and leaves (+1 entry), or H.

    Raises ValueError unless every non-zero of B is ±1 and no row has two
    entries of one sign.
    """
    coo = sp.coo_array(B, copy=True)
    coo.sum_duplicates()
    n, H = coo.shape
    keep = coo.data != 0
    r, c, v = coo.row[keep], coo.col[keep], coo.data[keep]
    if not np.all((v == 1) | (v == -1)):
        raise ValueError("B may hold only -1, 0 and +1")
    neg = v < 0
    for sign, mask in (("-1", neg), ("+1", ~neg)):
        twice = np.flatnonzero(np.bincount(r[mask], minlength=n) > 1)
        if twice.size:
            raise ValueError(f"row {twice[0]} of B has two {sign} entries: a parameter enters/leaves at most one unit")
    enter = np.full(n, H, dtype=np.int64)
    leave = np.full(n, H, dtype=np.int64)
    enter[r[neg]] = c[neg]
    leave[r[~neg]] = c[~neg]
    return enter, leave, H


def side_counts(enter: np.ndarray, leave: np.ndarray, H: int) -> np.ndarray:
    """A_h = |in_h| - |out_h| (MATH.md §7), so that -Σ_i (Bz)_i = A·z."""
    return np.bincount(enter, minlength=H + 1)[:H] - np.bincount(leave, minlength=H + 1)[:H]


def degenerate_units(positive: np.ndarray, enter: np.ndarray, leave: np.ndarray, H: int) -> np.ndarray:
    """Units with no positive mass on their whole incoming side or whole outgoing side (sorted)."""
    has_in = np.bincount(enter[positive], minlength=H + 1)[:H] > 0
    has_out = np.bincount(leave[positive], minlength=H + 1)[:H] > 0
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


@dataclass(frozen=True)
class Pairs:
    """Distinct (entered, left) unit pairs with log P_k = log Σ_{i in k} m_i > -inf."""

    log_mass: np.ndarray
    enter: np.ndarray
    leave: np.ndarray
    num_units: int


def group_pairs(m: np.ndarray, enter: np.ndarray, leave: np.ndarray, H: int, frozen=()) -> Pairs:
    """Group the rows of B with mass m_i > 0 by unit pair; ``frozen`` units count as "no unit".

    Sums are linear (one bincount) when the masses span less than ~650 nats,
    and grouped log-sum-exps otherwise, so no mass is lost to underflow.
    """
    remap = np.arange(H + 1)
    remap[np.asarray(frozen, dtype=np.int64)] = H
    pos = m > 0
    mass = m[pos]
    key = remap[enter[pos]] * (H + 1) + remap[leave[pos]]
    if mass.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Pairs(np.zeros(0), empty, empty, H)
    top = mass.max()
    if mass.min() > top * 1e-282:
        w = mass / top
        if (H + 1) ** 2 <= max(4 * mass.size, 1 << 22):
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
        log_mass = segment_logsumexp(np.log(mass[order]), starts)
    return Pairs(log_mass, keys // (H + 1), keys % (H + 1), H)


def greedy_coloring(pairs: Pairs, active: np.ndarray) -> np.ndarray:
    """Colour per unit (-1 for inactive ones) such that no pair joins two units of one colour.

    Greedy in unit order (smallest colour unused by the neighbours): layered
    networks, whose units are numbered layer by layer, get two colours.
    """
    H = pairs.num_units
    e, l = pairs.enter, pairs.leave
    both = (e < H) & (l < H) & active[np.minimum(e, H - 1)] & active[np.minimum(l, H - 1)] & (e != l)
    e, l = e[both], l[both]
    adj = sp.csr_array((np.ones(2 * e.size, dtype=np.int32), (np.r_[e, l], np.r_[l, e])), shape=(H, H))
    indptr, indices = adj.indptr, adj.indices
    colour = np.full(H, -1, dtype=np.int64)
    for u in np.flatnonzero(active):
        nb = colour[indices[indptr[u]:indptr[u + 1]]]
        nb = nb[nb >= 0]
        if nb.size == 0:
            colour[u] = 0
            continue
        used = np.zeros(nb.max() + 2, dtype=bool)
        used[nb] = True
        colour[u] = int(np.argmin(used))
    return colour


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
    """Build the SideSums of the given pairs; ``rows`` lists the distinct row ids, in order."""
    order = np.lexsort((col, row))
    row, col, log_mass = row[order], col[order], log_mass[order]
    starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]]) if row.size else np.zeros(0, dtype=np.int64)
    rows = row[starts]
    row_top = np.maximum.reduceat(log_mass, starts) if row.size else np.zeros(0)
    lengths = np.diff(np.append(starts, row.size))
    data = np.exp(log_mass - np.repeat(row_top, lengths))
    indptr = np.append(starts, row.size).astype(np.int64)
    matrix = sp.csr_array((data, col.astype(np.int64), indptr), shape=(rows.size, num_cols))
    return SideSums(rows, matrix, log_mass, row_top, starts)
