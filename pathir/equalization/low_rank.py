"""Grids whose exponentials have low rank, summed through their factors.

A weighted term's grid (the noise objective's Σ_rc G_rc e^{−(z_r − z_c)}: G_rc the diag-G mass of unit
pair (r, c)) is nearly a product: G_rc ≈ B_r F_c, the paths' mass after r times their mass before c,
summed over the positions of a convolution's output. With its rows and columns balanced,
e^{p·l_rc} = e^{d_r} W_rc e^{e_c} with W ∈ (0, 1] (its largest entry 1 in every row and column after
the scalings), W is a sum of a few positive outer products, and a rank-k factorisation W ≈ P Qᵀ
found by a seeded randomised range finder is kept where it is certified entry by entry:
|W − P Qᵀ| ≤ ``EPS`` · W at every cell. For positive u and v that bounds the bilinear form too,
|uᵀ(W − P Qᵀ)v| ≤ EPS · uᵀWv, so the smoothed value is the grid's to EPS/p nats at every z, and the
marginals to a relative EPS. A grid costs (R + C)·k per product instead of R·C: on a zoo model's
1×1 convolutions k is 6 to 20 where R and C are hundreds.

The factors are built for one sharpness (e^{p·l} has low rank at the p it was measured at, not at
others): :class:`LowRank` answers only there; the caller sums the grids cell by cell at any other.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

__all__ = ["LowRank", "factor_grid", "EPS"]

#: the largest relative error of any cell of a kept factorisation
EPS = 1e-10
#: ranks tried (oversampled by OVERSAMPLE); a grid needing more than a quarter of its smaller side stays dense
RANKS, OVERSAMPLE = (2, 6, 16, 40), 4
#: grids smaller than this are not factored (their products cost about what the factors' would)
MIN_CELLS = 1024
#: a product below this (or not finite) is summed cell by cell
_UNDERFLOW = 1e-250


def factor_grid(log: np.ndarray, p: float, rng: np.random.Generator):
    """(d, e, P, Q) with e^{p·log} = e^{d_r} (P Qᵀ)_rc e^{e_c} to a relative ``EPS`` at every cell, or None where
    ``log`` has a cell that is not finite, is small, or needs a rank over a quarter of its smaller side."""
    R, C = log.shape
    if log.size < MIN_CELLS or not np.isfinite(log).all():
        return None
    W = p * log  # one array of the grid's size, worked in place
    d = W.max(axis=1)
    W -= d[:, None]
    e = W.max(axis=0)
    W -= e[None, :]
    np.exp(W, out=W)
    for k in RANKS:
        width = k + OVERSAMPLE
        if width > min(R, C) // 4:
            return None
        Q, _ = np.linalg.qr(W @ rng.standard_normal((C, width)))
        B = Q.T @ W
        if _certified(W, Q, B):
            return d, e, Q, B.T
    return None


def _certified(W: np.ndarray, Q: np.ndarray, B: np.ndarray, rows: int = 256) -> bool:
    """|W − Q B| ≤ EPS · W at every cell, checked a block of rows at a time (no second array of W's size)."""
    for i in range(0, W.shape[0], rows):
        block = W[i:i + rows]
        if not np.all(np.abs(block - Q[i:i + rows] @ B) <= EPS * block):
            return False
    return True


class LowRank:
    """The factored grids of a stack, evaluated together at sharpness ``p``: rows (and columns) of the grids
    ``tensors`` laid end to end (``rows``, ``cols``: their places in the stack's layout), the factors block-
    diagonal sparse matrices, so an evaluation is four sparse products whatever the number of grids."""

    def __init__(self, tensors, factors, rows, cols, sign: float, p: float):
        self.tensors, self.sign, self.p = np.asarray(tensors, dtype=np.int64), sign, p
        n = len(factors)
        self.rows, self.cols = np.concatenate(rows), np.concatenate(cols)
        self.d = np.concatenate([f[0] for f in factors])
        self.e = np.concatenate([f[1] for f in factors])
        self.row_off = np.concatenate([[0], np.cumsum([r.size for r in rows])]).astype(np.int64)
        self.col_off = np.concatenate([[0], np.cumsum([c.size for c in cols])]).astype(np.int64)
        self.k_off = np.concatenate([[0], np.cumsum([f[2].shape[1] for f in factors])]).astype(np.int64)
        self.row_owner = np.repeat(np.arange(n), np.diff(self.row_off))
        self.col_owner = np.repeat(np.arange(n), np.diff(self.col_off))
        self.P = sp.block_diag([f[2] for f in factors], format="csr")
        self.Q = sp.block_diag([f[3] for f in factors], format="csr")
        self.Pt, self.Qt = self.P.T.tocsr(), self.Q.T.tocsr()

    def lse(self, zr_all: np.ndarray, zc_all: np.ndarray, marginals: bool):
        """(values, row marginals, column marginals laid out as ``rows`` / ``cols``, indices of the grids whose
        product under- or overflowed: the caller sums those cell by cell)."""
        p = self.p
        er = self.d + self.sign * 0.5 * p * zr_all[self.rows]
        ec = self.e - self.sign * 0.5 * p * zc_all[self.cols]
        mr = np.maximum.reduceat(er, self.row_off[:-1])
        mc = np.maximum.reduceat(ec, self.col_off[:-1])
        u, v = np.exp(er - mr[self.row_owner]), np.exp(ec - mc[self.col_owner])
        a, b = self.Pt @ u, self.Qt @ v
        totals = np.add.reduceat(a * b, self.k_off[:-1])
        ok = (totals > _UNDERFLOW) & np.isfinite(totals)
        safe = np.where(ok, totals, 1.0)
        values = np.where(ok, (mr + mc + np.log(safe)) / p, -np.inf)
        if not marginals:
            return values, None, None, np.flatnonzero(~ok)
        scale = np.where(ok, 1.0 / safe, 0.0)
        rm = u * (self.P @ b) * scale[self.row_owner]
        cm = v * (self.Q @ a) * scale[self.col_owner]
        return values, rm, cm, np.flatnonzero(~ok)
