"""The smoothed per-tensor maxima of one objective term, for every quantized tensor at once.

Tensor T's grid holds log values l_rc (-inf where no entry of T is that unit pair); the term is, per
tensor, the log-sum-exp at sharpness p of l_rc + σ(z_r − z_c)/2 (its max for p = inf), with the
softmax's row and column sums as marginals. With A = e^{p(l − max l)} precomputed, a tensor costs two
mat-vecs and no exponential per cell. Large grids are evaluated one by one (dense BLAS, or sparse
where mostly empty); the many small ones (depthwise, 1×1 and classifier layers of zoo models) share
one block-diagonal sparse matrix, so an evaluation makes a handful of calls instead of two per tensor.
Rows (and columns) of all tensors are laid end to end: tensor t's rows are ``row_slice(t)``.

A is taken at a centre z⁰: A = e^{p(l_rc + σ(z⁰_r − z⁰_c)/2 − top)}, its largest entry 1, and a call at z
scales rows and columns by the move z − z⁰. Far from the centre at a high sharpness the scaled product
under- or overflows (the cells that dominate at z were below e^{-745} at z⁰); then A is taken again
centred at z, where the product is at least 1, and only if that fails too is the grid summed cell by
cell. A re-centring costs one pass over the grid, as a cell-by-cell sum does, and serves the calls
near z after it: the noise objective's solve re-centres a few times per stage; the range objective's
sharpest stages (p = 64, 256), whose trial points jump, still re-centre at most calls.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp

__all__ = ["GridStack"]

#: grids larger than this are evaluated one by one; smaller ones together
ONE_BY_ONE = 32768
#: a grid evaluated alone is kept sparse where fewer than this fraction of its cells is filled
SPARSE_FILL = 0.25
#: a product below this (or not finite) is redone cell by cell
_UNDERFLOW = 1e-250


def _lse(a: np.ndarray, p: float, marginals: bool):
    """(1/p) log Σ e^{p a} over a grid (its max for p = inf), and its softmax's row and column sums."""
    top = float(np.max(a))
    if not math.isfinite(top) or math.isinf(p):
        return top, None
    e = np.exp(p * (a - top))
    total = float(e.sum())
    value = top + math.log(total) / p
    if not marginals:
        return value, None
    return value, (e.sum(axis=1) / total, e.sum(axis=0) / total)


class _Grid:
    """One large grid: A centred at some z⁰ per sharpness (dense, or sparse where mostly empty)."""

    def __init__(self, log: np.ndarray, sign: float):
        self.log, self.sign = log, sign
        self.top = float(np.max(log))
        self.sparse = np.count_nonzero(np.isfinite(log)) < SPARSE_FILL * log.size
        if self.sparse:  # the filled cells in row-major (CSR) order, and the order of Aᵀ's CSR
            self.r, self.c = np.nonzero(np.isfinite(log))
            self.filled = log[self.r, self.c]
            self.by_col = np.lexsort((self.r, self.c))
            self.indptr = np.concatenate([[0], np.cumsum(np.bincount(self.r, minlength=log.shape[0]))])
            self.indptr_t = np.concatenate([[0], np.cumsum(np.bincount(self.c, minlength=log.shape[1]))])
        self.cache: dict[float, tuple] = {}  # p -> (A, Aᵀ, z⁰ rows, z⁰ cols, top at z⁰): two sharpnesses at a time

    def _centre(self, p: float, zr: np.ndarray, zc: np.ndarray) -> tuple:
        """A at sharpness p centred at (zr, zc), cached (replacing the entry of p)."""
        if p not in self.cache and len(self.cache) > 1:
            self.cache.pop(max(self.cache))  # the stage before's sharpness
        if self.sparse:
            shifted = self.filled + self.sign * 0.5 * (zr[self.r] - zc[self.c])
            top = float(np.max(shifted))
            e = np.exp(p * (shifted - top))
            R, C = self.log.shape
            A = sp.csr_array((e, self.c, self.indptr), shape=(R, C))
            At = sp.csr_array((e[self.by_col], self.r[self.by_col], self.indptr_t), shape=(C, R))
        else:
            shifted = self.log + self.sign * 0.5 * (zr[:, None] - zc[None, :])
            top = float(np.max(shifted))
            A = np.exp(p * (shifted - top))
            At = A.T
        self.cache[p] = (A, At, zr.copy(), zc.copy(), top)
        return self.cache[p]

    def cells(self, zr, zc, p, marginals):
        return _lse(self.log + self.sign * 0.5 * (zr[:, None] - zc[None, :]), p, marginals)

    def lse(self, zr: np.ndarray, zc: np.ndarray, p: float, marginals: bool):
        if not math.isfinite(self.top) or math.isinf(p):
            return self.cells(zr, zc, p, False)
        entry, centred = self.cache.get(p), False
        while True:
            if entry is None:
                entry, centred = self._centre(p, zr, zc), True
            A, At, zr0, zc0, top = entry
            sr, sc = self.sign * 0.5 * p * (zr - zr0), -self.sign * 0.5 * p * (zc - zc0)
            mr, mc = float(sr.max()), float(sc.max())
            u, v = np.exp(sr - mr), np.exp(sc - mc)
            Av = A @ v
            total = float(u @ Av)
            if total > _UNDERFLOW and math.isfinite(total):
                value = top + (mr + mc + math.log(total)) / p
                if not marginals:
                    return value, None
                return value, (u * Av / total, v * (At @ u) / total)
            if centred:  # not even at its own centre (cannot happen but for a NaN z)
                break
            entry = None  # the product under- or overflowed: centre A here
        return self.cells(zr, zc, p, marginals)


class GridStack:
    """Every tensor's grid of one term (``logs[t]`` over units ``rows[t]`` × ``cols[t]``), evaluated
    together: :meth:`lse` gives the per-tensor values and the marginals laid end to end."""

    def __init__(self, logs: list[np.ndarray], rows: list[np.ndarray], cols: list[np.ndarray], sign: float):
        self.T, self.sign = len(logs), sign
        self.grids = [_Grid(log, sign) for log in logs]
        self.top = np.array([g.top for g in self.grids])
        self.row_unit = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        self.col_unit = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
        self.row_off = np.concatenate([[0], np.cumsum([r.size for r in rows])]).astype(np.int64)
        self.col_off = np.concatenate([[0], np.cumsum([c.size for c in cols])]).astype(np.int64)
        self.row_owner = np.repeat(np.arange(self.T), np.diff(self.row_off))
        self.col_owner = np.repeat(np.arange(self.T), np.diff(self.col_off))
        finite = np.isfinite(self.top)
        self.alone = [t for t in range(self.T) if finite[t] and logs[t].size > ONE_BY_ONE]
        self.together = np.array([t for t in range(self.T) if finite[t] and logs[t].size <= ONE_BY_ONE], dtype=np.int64)
        r_idx, c_idx, vals, owner = [], [], [], []
        for t in self.together:
            r, c = np.nonzero(np.isfinite(logs[t]))
            r_idx.append(r + self.row_off[t]), c_idx.append(c + self.col_off[t])
            vals.append(logs[t][r, c]), owner.append(np.full(r.size, t))
        self._cells = tuple(map(np.concatenate, (r_idx, c_idx, vals, owner))) if vals else None
        self.cache: dict[float, tuple] = {}  # p -> (A, Aᵀ, z⁰ rows, z⁰ cols, tops at z⁰) of the small grids

    def row_slice(self, t: int) -> slice:
        return slice(self.row_off[t], self.row_off[t + 1])

    def col_slice(self, t: int) -> slice:
        return slice(self.col_off[t], self.col_off[t + 1])

    def _centre(self, p: float, zr: np.ndarray, zc: np.ndarray) -> tuple:
        """The small grids' block-diagonal A at sharpness p centred at (zr, zc) (rows and columns laid
        end to end), cached (replacing the entry of p)."""
        if p not in self.cache and len(self.cache) > 1:
            self.cache.pop(max(self.cache))
        r, c, log, owner = self._cells
        shifted = log + self.sign * 0.5 * (zr[r] - zc[c])
        tops = np.full(self.T, -np.inf)
        np.maximum.at(tops, owner, shifted)
        A = sp.csr_array((np.exp(p * (shifted - tops[owner])), (r, c)), shape=(self.row_unit.size, self.col_unit.size))
        self.cache[p] = (A, A.T.tocsr(), zr.copy(), zc.copy(), tops)
        return self.cache[p]

    def _together(self, zr_all, zc_all, p, entry):
        """(values (T,), finite for the small grids whose product held; those grids; those where it under-
        or overflowed; (u, Av, v, per-tensor totals, Aᵀ) for the marginals)."""
        A, At, zr0, zc0, tops = entry
        sr, sc = self.sign * 0.5 * p * (zr_all - zr0), -self.sign * 0.5 * p * (zc_all - zc0)
        mr = np.maximum.reduceat(sr, self.row_off[:-1])
        mc = np.maximum.reduceat(sc, self.col_off[:-1])
        u, v = np.exp(sr - mr[self.row_owner]), np.exp(sc - mc[self.col_owner])
        Av = A @ v
        totals = np.add.reduceat(u * Av, self.row_off[:-1])
        t = self.together
        good = (totals[t] > _UNDERFLOW) & np.isfinite(totals[t])
        values = np.full(self.T, -np.inf)
        ok = t[good]
        values[ok] = tops[ok] + (mr[ok] + mc[ok] + np.log(totals[ok])) / p
        return values, ok, t[~good], (u, Av, v, totals, At)

    def lse(self, zp: np.ndarray, p: float, marginals: bool):
        """(values (T,), row marginals, column marginals) at z (``zp``: z with a 0 appended for "no
        unit"); marginals None without ``marginals`` or at p = inf. A tensor with no finite cell is -inf."""
        values = np.full(self.T, -np.inf)
        rm = np.zeros(self.row_unit.size) if marginals and not math.isinf(p) else None
        cm = np.zeros(self.col_unit.size) if rm is not None else None
        zr_all, zc_all = zp[self.row_unit], zp[self.col_unit]
        one_by_one = list(self.alone)
        if math.isinf(p):
            one_by_one += list(self.together)
        elif self.together.size:
            entry, centred = self.cache.get(p), False
            if entry is None:
                entry, centred = self._centre(p, zr_all, zc_all), True
            block, ok, bad, parts = self._together(zr_all, zc_all, p, entry)
            if bad.size and not centred:  # under- or overflowed: centre the block here, once
                block, ok, bad, parts = self._together(zr_all, zc_all, p, self._centre(p, zr_all, zc_all))
            values[ok] = block[ok]
            one_by_one += list(bad)
            if rm is not None:
                u, Av, v, totals, At = parts
                scale = np.zeros(self.T)
                scale[ok] = 1.0 / totals[ok]
                rm[:] = u * Av * scale[self.row_owner]
                cm[:] = v * (At @ u) * scale[self.col_owner]
        for t in one_by_one:
            rs, cs = self.row_slice(t), self.col_slice(t)
            value, marg = self.grids[t].lse(zr_all[rs], zc_all[cs], p, rm is not None)
            values[t] = value
            if marg is not None:
                rm[rs], cm[cs] = marg
        return values, rm, cm
