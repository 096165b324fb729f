"""Rank-k factored grids of one size, evaluated together (the 1×1 convolutions of a network stage).

A rank-k grid (`FactoredGrid` with ``U``, ``V``: masses P_{e,l} = u_e v_l U_e · V_l) has, at z, the
rows A_e = α_e U_e and B_l = β_l V_l (α = u e^{z_e}, β = v e^{-z_l}, each taken over its largest) and

    E = sa · sb,   I_e = A_e · sb,   O_l = B_l · sa,
    (∇²E p)_e += p_e I_e − A_e · (Σ_l p_l B_l),   (∇²E p)_l += p_l O_l − B_l · (Σ_e p_e A_e),

with sa = Σ_e A_e and sb = Σ_l B_l: O((|E| + |L|) k) per grid. Grids with the same |E|, |L| and k
are stacked, so a Hessian product over all of them is a few batched BLAS calls instead of a few
per grid. Each grid keeps its own scale: its total E (at least ROW_SPREAD⁻² of e^{a_top + b_top},
`pathir.lifting.low_rank`), so that the largest of the parts' scales, which the caller shares, never
pushes another part's terms below float64's normal range.
"""

from __future__ import annotations

import math

import numpy as np

from pathir.pairs.unit_pairs import pad

__all__ = ["LowRankStack", "StackPoint"]


class LowRankStack:
    """Rank-k grids (``FactoredGrid`` with U, V) of one |E|, |L| and k over the same H units, stacked."""

    def __init__(self, grids):
        self.grids = tuple(grids)
        self.num_units = self.grids[0].num_units
        self.enter = np.stack([g.enter for g in self.grids])  # (G, E)
        self.leave = np.stack([g.leave for g in self.grids])  # (G, L)
        self.log_u = np.stack([g.log_u for g in self.grids])
        self.log_v = np.stack([g.log_v for g in self.grids])
        self.U = np.stack([g.U for g in self.grids])  # (G, E, k)
        self.V = np.stack([g.V for g in self.grids])  # (G, L, k)

    def point(self, z: np.ndarray) -> "StackPoint":
        return StackPoint(self, z)


def _mv(M: np.ndarray, x: np.ndarray) -> np.ndarray:
    """M[g] @ x[g] for every g: (G, R, C), (G, C) -> (G, R)."""
    return np.matmul(M, x[:, :, None])[:, :, 0]


def _vm(x: np.ndarray, M: np.ndarray) -> np.ndarray:
    """x[g] @ M[g] for every g: (G, R), (G, R, C) -> (G, C)."""
    return np.matmul(x[:, None, :], M)[:, 0, :]


class StackPoint:
    """The stacked grids at one z. ``log_scales`` (G,): each grid's log E; ``log_scale`` their largest.
    Every ``add_*`` adds over e^{log_scale} given by the caller (at least ``log_scale``)."""

    def __init__(self, stack: LowRankStack, z: np.ndarray):
        zp = pad(z)
        self.stack = stack
        self.log_alpha = stack.log_u + zp[stack.enter]
        self.log_beta = stack.log_v - zp[stack.leave]
        self.a_top, b_top = self.log_alpha.max(axis=1), self.log_beta.max(axis=1)
        self.base = self.a_top + b_top
        self.A = stack.U * np.exp(self.log_alpha - self.a_top[:, None])[:, :, None]
        self.B = stack.V * np.exp(self.log_beta - b_top[:, None])[:, :, None]
        self.sa, self.sb = self.A.sum(axis=1), self.B.sum(axis=1)  # (G, k)
        self.row_in, self.col_out = _mv(self.A, self.sb), _mv(self.B, self.sa)  # I and O over e^{base}
        self.log_scales = self.base + np.log(np.einsum("gk,gk->g", self.sa, self.sb))
        self.log_scale = float(self.log_scales.max())

    def _shift(self, log_scale: float) -> np.ndarray:
        return np.exp(self.base - log_scale)[:, None]

    def _add(self, into: np.ndarray, units: np.ndarray, values: np.ndarray) -> None:
        """into[units] += values, units repeating across grids."""
        into += np.bincount(units.ravel(), values.ravel(), minlength=into.size)

    def log_total(self) -> float:
        """log E over every grid of the stack."""
        top = self.log_scale
        return top + math.log(float(np.exp(self.log_scales - top).sum()))

    def log_sides(self) -> tuple[np.ndarray, np.ndarray]:
        """(log I_e, log O_l) per grid row and column, the grids' laid end to end, exact for any spread."""
        b_top = self.base - self.a_top
        return ((self.log_alpha + b_top[:, None] + np.log(_mv(self.stack.U, self.sb))).ravel(),
                (self.log_beta + self.a_top[:, None] + np.log(_mv(self.stack.V, self.sa))).ravel())

    def add_sides(self, inc: np.ndarray, out: np.ndarray, log_scale: float) -> None:
        """I and O added into ``inc``/``out`` (H + 1 entries, "no unit" last) over e^{log_scale}."""
        shift = self._shift(log_scale)
        self._add(inc, self.stack.enter, self.row_in * shift)
        self._add(out, self.stack.leave, self.col_out * shift)

    def add_hessian_times(self, p: np.ndarray, into: np.ndarray, log_scale: float) -> None:
        """∇²E p over the grids' pairs added into ``into`` (H + 1 entries, p_H = 0) over e^{log_scale}."""
        shift = self._shift(log_scale)
        pe, pl = p[self.stack.enter], p[self.stack.leave]
        self._add(into, self.stack.enter, (self.row_in * pe - _mv(self.A, _vm(pl, self.B))) * shift)
        self._add(into, self.stack.leave, (self.col_out * pl - _mv(self.B, _vm(pe, self.A))) * shift)

    def add_grouped(self, table: np.ndarray, groups: np.ndarray, keep: np.ndarray | None, log_scale: float) -> None:
        """The terms summed by (group entered, group left) added into ``table`` (m1 x m1) over
        e^{log_scale} (`PairPoint.grouped`: ``groups`` and ``keep`` have H + 1 entries)."""
        m1 = table.shape[0]
        shift = self._shift(log_scale)[:, 0]
        for g in range(len(self.stack.grids)):
            A, B = self.A[g], self.B[g]
            enter, leave = self.stack.enter[g], self.stack.leave[g]
            if keep is not None:
                A, B = A * keep[enter][:, None], B * keep[leave][:, None]
            table += (_row_sums_by(groups[enter], A, m1) @ _row_sums_by(groups[leave], B, m1).T) * shift[g]

    def add_self_terms(self, into: np.ndarray, log_scale: float) -> None:
        """The terms of the pairs (h, h) (units on both sides of a grid) added into ``into`` over e^{log_scale}."""
        shift = self._shift(log_scale)[:, 0]
        for g in range(len(self.stack.grids)):
            both, ie, il = np.intersect1d(self.stack.enter[g], self.stack.leave[g], assume_unique=True,
                                          return_indices=True)
            into[both] += np.einsum("ij,ij->i", self.A[g][ie], self.B[g][il]) * shift[g]

    def log_extremes(self) -> tuple[float, float]:
        """(min, max) over the grids of log t_{e,l}."""
        lo, hi = math.inf, -math.inf
        for g in range(len(self.stack.grids)):
            logs = self.log_alpha[g][:, None] + self.log_beta[g][None, :] + np.log(self.stack.U[g] @ self.stack.V[g].T)
            lo, hi = min(lo, float(logs.min())), max(hi, float(logs.max()))
        return lo, hi


def _row_sums_by(index: np.ndarray, M: np.ndarray, m: int) -> np.ndarray:
    """(m x k): row j the sum of the rows r of M with index[r] = j."""
    out = np.zeros((m, M.shape[1]))
    if index.size and np.all(index == index[0]):  # a layer's units: one group
        out[index[0]] = M.sum(axis=0)
        return out
    order = np.argsort(index, kind="stable")
    si = index[order]
    starts = np.flatnonzero(np.r_[True, si[1:] != si[:-1]])
    out[si[starts]] = np.add.reduceat(M[order], starts, axis=0)
    return out
