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
    "canonical", "row_keys", "row_units", "column_balance", "degenerate_units", "pad", "Pairs", "group_pairs",
    "greedy_coloring", "segment_logsumexp", "stable_order", "SideSums", "side_sums", "all_pairs",
    "log_pair_total", "Block", "blocks_of",
]

# A linear-domain sum below this (relative to its static bound 1) may have lost
# terms to underflow: recompute it in log-space.
_TINY = 1e-280


def canonical(B) -> sp.csr_array:
    """B as a canonical CSR array, checked: non-zeros are ±1, at most one of each sign per row."""
    csr = sp.csr_array(B)
    if not csr.has_canonical_format:
        csr = csr.copy()
        csr.sum_duplicates()
    if not np.all(np.abs(csr.data) == 1):
        csr = csr.copy()
        csr.eliminate_zeros()
        if not np.all(np.abs(csr.data) == 1):
            raise ValueError("B may hold only -1, 0 and +1")
    counts = np.diff(csr.indptr)
    if counts.max(initial=0) > 2:
        raise ValueError(f"row {int(np.argmax(counts))} of B has more than two non-zeros")
    # a row with two ±1 entries holds one of each sign iff it sums to 0
    same = np.flatnonzero((counts == 2) & (csr @ np.ones(csr.shape[1]) != 0))
    if same.size:
        row = int(same[0])
        raise ValueError(f"row {row} of B has two {csr.data[csr.indptr[row]]:+g} entries: "
                         "a parameter enters at most one unit and leaves at most one")
    return csr


def row_keys(B, checked: bool = False) -> tuple[np.ndarray, int]:
    """``(key, H)`` with key_i = e(i) (H + 1) + l(i) (e, l = H for "no unit").

    B is checked by `canonical` unless ``checked`` says it already was.
    """
    csr = B if checked else canonical(B)
    n, H = csr.shape
    # one mat-vec: a -1 at column j adds (j - H)(H + 1) to the "no unit" key H(H + 1) + H, a +1 adds j - H
    weight = np.where(csr.data < 0, float(H + 1), 1.0)
    shift = sp.csr_array((weight, csr.indices, csr.indptr), shape=csr.shape) @ np.arange(-H, 0, dtype=np.float64)
    return (shift + float(H * (H + 1) + H)).astype(np.int64), H


def row_units(B) -> tuple[np.ndarray, np.ndarray, int]:
    """``(enter, leave, H)``: per row of B, the unit it enters (-1 entry) and leaves (+1 entry), or H.

    Raises ValueError unless every non-zero of B is ±1 and no row has two
    entries of one sign.
    """
    key, H = row_keys(B)
    enter, leave = np.divmod(key, H + 1)
    return enter, leave, H


def column_balance(B) -> np.ndarray:
    """A_h = |in_h| - |out_h| = -(Bᵀ1)_h straight from B."""
    B = sp.csr_array(B)
    return -np.rint(B.T @ np.ones(B.shape[0])).astype(np.int64)


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


def group_pairs(m: np.ndarray, key: np.ndarray, H: int) -> Pairs:
    """Group the rows with mass m_i > 0 by unit pair (``key`` from `row_keys`).

    Sums are linear (one bincount) when the masses span less than ~650 nats,
    and grouped log-sum-exps otherwise, so no mass is lost to underflow.
    """
    pos = m > 0
    if not pos.all():
        m, key = m[pos], key[pos]
    if m.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Pairs(np.zeros(0), empty, empty, H)
    top = m.max()
    if m.min() > top * 1e-282:
        w = m / top
        if (H + 1) ** 2 <= max(4 * m.size, 1 << 22):
            sums = np.bincount(key, weights=w, minlength=(H + 1) ** 2)
            keys = np.flatnonzero(sums != 0)
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
    enter, leave = np.divmod(keys, H + 1)
    return Pairs(log_mass, enter, leave, H)


def greedy_coloring(pairs: Pairs, active: np.ndarray) -> np.ndarray:
    """Colour per unit (-1 for inactive ones) such that no pair joins two active units of one colour.

    Greedy in unit order (smallest colour unused by the lower-numbered
    neighbours): layered networks, whose units are numbered layer by layer,
    get two colours.
    """
    H = pairs.num_units
    e, l = pairs.enter, pairs.leave
    keep = (e < H) & (l < H)
    e, l = e[keep], l[keep]
    keep = active[e] & active[l] & (e != l)
    hi, lo = np.maximum(e, l)[keep], np.minimum(e, l)[keep]
    order = stable_order(hi, H)
    lo = lo[order]
    bounds = np.searchsorted(hi[order], np.arange(H + 1))
    colour = np.full(H, -1, dtype=np.int64)
    for u in np.flatnonzero(active):
        below = colour[lo[bounds[u]:bounds[u + 1]]]
        if below.size == 0:
            colour[u] = 0
            continue
        free = np.flatnonzero(np.bincount(below) == 0)
        colour[u] = int(free[0]) if free.size else int(below.max()) + 1
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


def all_pairs(pairs: Pairs, by_leave: np.ndarray) -> SideSums:
    """Every pair as one SideSums (rows = left unit, cols = entered unit), for `log_pair_total`."""
    return side_sums(pairs.leave[by_leave], pairs.enter[by_leave], pairs.log_mass[by_leave], pairs.num_units + 1)


def log_pair_total(sums: SideSums, z_padded: np.ndarray) -> float:
    """log Σ_k P_k e^{z_leave - z_enter} over the pairs of ``sums`` (rows = left unit, cols = entered unit)."""
    if sums.rows.size == 0:
        return -math.inf
    v = sums(-z_padded) + z_padded[sums.rows]
    top = float(v.max())
    return top + math.log(float(np.exp(v - top).sum()))


@dataclass(frozen=True)
class Block:
    """One independent set of units and the pair sums its update reads.

    ``outgoing(f)[j]`` = log Σ_{pairs leaving units[j]} P_k e^{f[other end]},
    ``incoming(f)[j]`` likewise over the pairs entering units[j]; ``rest`` holds
    the pairs touching no unit of the block, rows = left unit, cols = entered unit.
    """

    units: np.ndarray
    outgoing: SideSums
    incoming: SideSums
    rest: SideSums

    def rest_log(self, z_padded: np.ndarray) -> float:
        """log Σ_{rest pairs} P_k e^{z_leave - z_enter}."""
        return log_pair_total(self.rest, z_padded)


def blocks_of(pairs: Pairs, colour: np.ndarray, by_leave: np.ndarray) -> list[Block]:
    """The Blocks of a colouring (``colour[h] = -1``: unit not updated); ``by_leave`` orders the pairs by left unit."""
    H = pairs.num_units
    num = int(colour.max(initial=-1)) + 1
    colour_pad = np.append(colour, -1)
    # position of each unit within its colour, the block's row index
    local = np.zeros(H + 1, dtype=np.int64)
    for c in range(num):
        units = np.flatnonzero(colour == c)
        local[units] = np.arange(units.size)
    e_col = colour_pad[pairs.enter]
    leave_s, enter_s, log_s = pairs.leave[by_leave], pairs.enter[by_leave], pairs.log_mass[by_leave]
    l_col_s, e_col_s = colour_pad[leave_s], e_col[by_leave]
    blocks = []
    for c in range(num):
        units = np.flatnonzero(colour == c)
        out_k, in_k = l_col_s == c, e_col == c
        rest_k = ~out_k & (e_col_s != c)
        outgoing = side_sums(local[leave_s[out_k]], enter_s[out_k], log_s[out_k], H + 1)
        incoming = side_sums(local[pairs.enter[in_k]], pairs.leave[in_k], pairs.log_mass[in_k], H + 1)
        rest = side_sums(leave_s[rest_k], enter_s[rest_k], log_s[rest_k], H + 1)
        for side in (outgoing, incoming):
            if side.rows.size != units.size:
                raise ValueError(f"colour {c}: a unit has no mass on one side (it should have been found degenerate)")
        blocks.append(Block(units, outgoing, incoming, rest))
    return blocks
