"""The smoothed per-tensor maxima of one objective term, for every quantized tensor at once.

Tensor T's grid holds log values l_rc (-inf where no entry of T is that unit pair); the term is, per
tensor, the log-sum-exp at sharpness p of l_rc + σ(z_r − z_c)/2 (its max for p = inf), with the
softmax's row and column sums as marginals. With A = e^{p(l − max l)} precomputed, a tensor costs two
mat-vecs and no exponential per cell. Large dense grids of one shape (the 1×1 convolutions of a stage)
are stacked and evaluated by one batched BLAS product per shape; every other grid (small ones, and
mostly empty ones such as grouped convolutions) shares one block-diagonal sparse matrix. An evaluation
makes a handful of calls however many tensors there are. With ``low_rank_at=p``, grids whose e^{p·l} has a
certified low-rank factorisation (the noise objective's weights: :mod:`pathir.equalization.low_rank`) are
summed through their factors at that sharpness, and cell by cell at any other. Rows (and columns) of all
tensors are laid end to end: tensor t's rows are ``row_slice(t)``.

A is taken at a centre z⁰: A = e^{p(l_rc + σ(z⁰_r − z⁰_c)/2 − top)}, its largest entry 1, and a call at z
scales rows and columns by the move z − z⁰. Far from the centre at a high sharpness the scaled product
under- or overflows (the cells that dominate at z were flushed to 0 at z⁰); then A is taken again
centred at z (only that grid's, in a stack of dense grids), where the product is at least 1, and only if
that fails too is the grid summed cell by cell. A re-centring costs one pass over the grid, as a
cell-by-cell sum does, and serves the calls near z after it: the noise objective's solve re-centres a
few times per stage; the range objective's sharpest stages (p = 64, 256), whose trial points jump,
still re-centre at most calls.

The stacked dense grids hold A in float32 by default (``GridStack(dtype=...)``): their products are
bound by memory traffic (a regnet's 400×400 grids outgrow the cache), and half the bytes is nearly
half the time. A float32 A is a consistent smooth model of the objective (a sum of positive terms,
each log value within about C·6e-8/p nats of the float64 one for C columns): the solver's smoothed
stages follow it, and every value the solver reports (p = inf) is summed cell by cell in float64.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp

from pathir.equalization.low_rank import LowRank, factor_grid

__all__ = ["GridStack"]

#: dense grids larger than this are stacked by shape (batched BLAS); smaller ones join the sparse block
ONE_BY_ONE = 12000
#: a grid is sparse (it joins the sparse block whatever its size) where fewer than this fraction of its
#: cells is filled
SPARSE_FILL = 0.25
#: rows of a stacked grid centred at a time (its float64 temporary: this many rows, not the grid)
_BLOCK = 256
#: a product below this (or not finite) is re-centred, then redone cell by cell
_UNDERFLOW = 1e-250
#: the same for products of a float32 A: its cells below float32's smallest normal (1.2e-38) are lost,
#: each less than that, so a total above 1e-20 is exact to 1e-18 relative per cell
_UNDERFLOW_32 = 1e-20


def _row_blocks(n: int) -> list[slice]:
    """Slices of ``_BLOCK`` rows covering ``n`` rows."""
    return [slice(i, i + _BLOCK) for i in range(0, n, _BLOCK)]


def _shifted(log: np.ndarray, zr: np.ndarray, zc: np.ndarray, sign: float, rows: slice) -> np.ndarray:
    """The grid's log values at (zr, zc), l_rc + σ(z_r − z_c)/2, for a block of ``rows`` (a fresh float64 array)."""
    return log[rows] + sign * 0.5 * (zr[rows, None] - zc[None, :])


def _by_cells(log: np.ndarray, zr: np.ndarray, zc: np.ndarray, sign: float, p: float, marginals: bool):
    """One grid's smoothed max (1/p) log Σ e^{p a} (its max at p = inf) and its softmax's row and column sums at
    (zr, zc), summed cell by cell, a block of ``_BLOCK`` rows at a time (no grid-sized temporary): at p = inf,
    and where a product failed even at its own centre."""
    blocks = _row_blocks(log.shape[0])
    top = max((float(np.max(_shifted(log, zr, zc, sign, b))) for b in blocks), default=-math.inf)
    if not math.isfinite(top) or math.isinf(p):
        return top, None
    total, row_sums, col_sums = 0.0, np.empty(log.shape[0]), np.zeros(log.shape[1])
    for b in blocks:
        e = _shifted(log, zr, zc, sign, b)
        e -= top
        e *= p
        np.exp(e, out=e)
        total += float(e.sum())
        if marginals:
            row_sums[b] = e.sum(axis=1)
            col_sums += e.sum(axis=0)
    value = top + math.log(total) / p
    return value, ((row_sums / total, col_sums / total) if marginals else None)


class _Batch:
    """The dense grids ``tensors`` of one shape R × C, stacked: A (G, R, C) centred per grid, one batched BLAS
    product per evaluation for all G. ``rows`` (G, R) and ``cols`` (G, C): each grid's rows and columns in
    the end-to-end layout (tensor t's start at ``row_off[t]``, ``col_off[t]``)."""

    def __init__(self, tensors: np.ndarray, logs: list[np.ndarray], row_off: np.ndarray, col_off: np.ndarray,
                 sign: float, dtype=np.float32):
        self.tensors, self.logs, self.sign, self.dtype = tensors, [logs[t] for t in tensors], sign, np.dtype(dtype)
        self.floor = _UNDERFLOW_32 if self.dtype == np.float32 else _UNDERFLOW
        R, C = self.logs[0].shape
        self.rows, self.cols = row_off[tensors][:, None] + np.arange(R), col_off[tensors][:, None] + np.arange(C)
        self.cache: dict[float, tuple] = {}  # p -> (A, z⁰ rows, z⁰ cols, tops at z⁰): two sharpnesses at a time

    def _centre(self, p: float, zr: np.ndarray, zc: np.ndarray, which) -> tuple:
        """A at sharpness p with grids ``which`` (all where p is new) centred at their rows of (zr, zc)."""
        entry = self.cache.get(p)
        if entry is None:
            if len(self.cache) > 1:
                self.cache.pop(max(self.cache))
            G, (R, C) = len(self.logs), self.logs[0].shape
            entry = self.cache[p] = (np.empty((G, R, C), dtype=self.dtype), np.empty((G, R)), np.empty((G, C)),
                                     np.empty(G))
            which = range(G)
        A, zr0, zc0, tops = entry
        for g in which:  # a block of rows at a time: no float64 grid-sized temporary
            log, blocks = self.logs[g], _row_blocks(self.logs[g].shape[0])
            tops[g] = max(float(np.max(_shifted(log, zr[g], zc[g], self.sign, b))) for b in blocks)
            for b in blocks:
                block = _shifted(log, zr[g], zc[g], self.sign, b)
                block -= tops[g]
                block *= p
                np.exp(block, out=A[g, b], casting="same_kind")  # float64 exponent, stored as A's dtype
            zr0[g], zc0[g] = zr[g], zc[g]
        return entry

    def _products(self, zr: np.ndarray, zc: np.ndarray, p: float, entry: tuple, marginals: bool):
        """(tops + scale shifts, u, v, A v, uᵀ A or None, totals uᵀ A v) per grid. With ``marginals`` both
        products of a grid run back to back, the second on a grid still in cache: one pass over memory."""
        A, zr0, zc0, tops = entry
        sr, sc = self.sign * 0.5 * p * (zr - zr0), -self.sign * 0.5 * p * (zc - zc0)
        mr, mc = sr.max(axis=1), sc.max(axis=1)
        u, v = np.exp(sr - mr[:, None]), np.exp(sc - mc[:, None])
        ua, va = u.astype(A.dtype, copy=False), v.astype(A.dtype, copy=False)
        if marginals:
            Av, Atu = np.empty_like(ua), np.empty_like(va)
            for g in range(A.shape[0]):
                np.matmul(A[g], va[g], out=Av[g])
                np.matmul(ua[g], A[g], out=Atu[g])
            Av, Atu = Av.astype(np.float64, copy=False), Atu.astype(np.float64, copy=False)
        else:
            Av, Atu = np.matmul(A, va[:, :, None])[:, :, 0].astype(np.float64, copy=False), None
        totals = np.einsum("gr,gr->g", u, Av)
        return tops + (mr + mc) / p, u, v, Av, Atu, totals

    def lse(self, zr_all: np.ndarray, zc_all: np.ndarray, p: float, marginals: bool):
        """(values (G,), row marginals (G, R), column marginals (G, C)) at the rows' and columns' z laid end to
        end, and the grids whose product failed even at their own centre (the caller sums them cell by cell)."""
        zr, zc = zr_all[self.rows], zc_all[self.cols]
        entry, centred = self.cache.get(p), np.zeros(len(self.logs), dtype=bool)
        if entry is None:
            entry, centred[:] = self._centre(p, zr, zc, None), True
        while True:
            base, u, v, Av, Atu, totals = self._products(zr, zc, p, entry, marginals)
            ok = (totals > self.floor) & np.isfinite(totals)
            redo = ~ok & ~centred
            if not redo.any():
                break
            self._centre(p, zr, zc, np.flatnonzero(redo))  # under- or overflowed: centre those grids here, once
            centred |= redo
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(ok, base + np.log(np.where(ok, totals, 1.0)) / p, -np.inf)
        if not marginals:
            return values, None, None, np.flatnonzero(~ok)
        scale = np.where(ok, 1.0 / np.where(ok, totals, 1.0), 0.0)[:, None]
        return values, u * Av * scale, v * Atu * scale, np.flatnonzero(~ok)


class GridStack:
    """Every tensor's grid of one term (``logs[t]`` over units ``rows[t]`` × ``cols[t]``), evaluated
    together: :meth:`lse` gives the per-tensor values and the marginals laid end to end. ``dtype``: that
    of the stacked dense grids' A (float64 for products exact to rounding)."""

    def __init__(self, logs: list[np.ndarray], rows: list[np.ndarray], cols: list[np.ndarray], sign: float,
                 dtype=np.float32, low_rank_at: float | None = None):
        self.T, self.sign = len(logs), sign
        self.logs = logs
        self.top = np.array([float(np.max(log)) if log.size else -math.inf for log in logs])
        self.row_unit = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        self.col_unit = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
        self.row_off = np.concatenate([[0], np.cumsum([r.size for r in rows])]).astype(np.int64)
        self.col_off = np.concatenate([[0], np.cumsum([c.size for c in cols])]).astype(np.int64)
        self.row_owner = np.repeat(np.arange(self.T), np.diff(self.row_off))
        self.col_owner = np.repeat(np.arange(self.T), np.diff(self.col_off))
        finite = np.isfinite(self.top)
        self.low = self._factored(low_rank_at, finite) if low_rank_at is not None else None
        if self.low is not None:
            finite[self.low.tensors] = False  # (for the two layouts below: the factored grids are neither)
        by_shape: dict[tuple, list[int]] = {}
        for t in np.flatnonzero(finite).tolist():
            if logs[t].size > ONE_BY_ONE and np.count_nonzero(np.isfinite(logs[t])) >= SPARSE_FILL * logs[t].size:
                by_shape.setdefault(logs[t].shape, []).append(t)
        self.batches = [_Batch(ts, logs, self.row_off, self.col_off, sign, dtype)
                        for ts in (np.array(ts, dtype=np.int64) for ts in by_shape.values())]
        stacked = np.zeros(self.T, dtype=bool)
        for batch in self.batches:
            stacked[batch.tensors] = True
        self.together = np.flatnonzero(finite & ~stacked)
        r_idx, c_idx, vals, owner = [], [], [], []
        for t in self.together:
            r, c = np.nonzero(np.isfinite(logs[t]))
            r_idx.append(r + self.row_off[t]), c_idx.append(c + self.col_off[t])
            vals.append(logs[t][r, c]), owner.append(np.full(r.size, t))
        self._cells = tuple(map(np.concatenate, (r_idx, c_idx, vals, owner))) if vals else None
        self.cache: dict[float, tuple] = {}  # p -> (A, Aᵀ, z⁰ rows, z⁰ cols, tops at z⁰) of the small grids

    def _factored(self, p: float, finite: np.ndarray) -> LowRank | None:
        """The grids whose e^{p·log} has a certified low-rank factorisation (:mod:`pathir.equalization.low_rank`),
        evaluated through it at sharpness p; None where none has."""
        rng = np.random.default_rng(0)  # the range finder's test vectors: the same factors on every run
        picked, factors = [], []
        for t in np.flatnonzero(finite).tolist():
            f = factor_grid(self.logs[t], p, rng)
            if f is not None:
                picked.append(t), factors.append(f)
        if not picked:
            return None
        rows = [self.row_off[t] + np.arange(self.logs[t].shape[0]) for t in picked]
        cols = [self.col_off[t] + np.arange(self.logs[t].shape[1]) for t in picked]
        return LowRank(picked, factors, rows, cols, self.sign, p)

    def retain(self, sharpnesses) -> None:
        """Drop the A cached at any other sharpness (a finished stage's: each is half a float64 copy of its
        grids, which the sharper stages after it never read)."""
        keep = set(sharpnesses)
        for cache in [self.cache, *(batch.cache for batch in self.batches)]:
            for p in [p for p in cache if p not in keep]:
                del cache[p]

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
        one_by_one = []
        if math.isinf(p):
            one_by_one += list(self.together)
            for batch in self.batches:
                one_by_one += list(batch.tensors)
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
        if self.low is not None:  # factored at one sharpness: cell by cell at any other
            if p == self.low.p:
                vals, rows, cols, failed = self.low.lse(zr_all, zc_all, rm is not None)
                values[self.low.tensors] = vals
                if rows is not None:
                    rm[self.low.rows], cm[self.low.cols] = rows, cols
                one_by_one += list(self.low.tensors[failed])
            else:
                one_by_one += list(self.low.tensors)
        if not math.isinf(p):
            for batch in self.batches:
                vals, rows, cols, failed = batch.lse(zr_all, zc_all, p, rm is not None)
                values[batch.tensors] = vals
                if rows is not None:
                    rm[batch.rows], cm[batch.cols] = rows, cols
                one_by_one += list(batch.tensors[failed])
        for t in one_by_one:
            rs, cs = self.row_slice(t), self.col_slice(t)
            value, marg = _by_cells(self.logs[t], zr_all[rs], zc_all[cs], self.sign, p, rm is not None)
            values[t] = value
            if marg is not None:
                rm[rs], cm[cs] = marg
        return values, rm, cm
