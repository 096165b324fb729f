"""Rank-k factored grids of one size, evaluated together (the 1×1 convolutions of a network stage).

A rank-k grid (`FactoredGrid` with ``U``, ``V``: masses P_{e,l} = u_e v_l U_e · V_l) has, at z, the
rows A_e = α_e U_e and B_l = β_l V_l (α = u e^{z_e}, β = v e^{-z_l}, each taken over its largest) and

    E = sa · sb,   I_e = A_e · sb,   O_l = B_l · sa,
    (∇²E p)_e += p_e I_e − A_e · (Σ_l p_l B_l),   (∇²E p)_l += p_l O_l − B_l · (Σ_e p_e A_e),

with sa = Σ_e A_e and sb = Σ_l B_l: O((|E| + |L|) k) per grid. Grids of one rank k are stacked,
each padded to the stack's largest |E| and |L| with rows of no unit (index H) whose factors are 0,
so a Hessian product over all of them is a few batched BLAS calls instead of a few per grid (the
caller groups grids of near sizes: densenet's 1×1 convolutions read a concatenation one block wider
each layer, so no two have one size). Each grid keeps its own scale: its total E (at least ROW_SPREAD⁻² of e^{a_top + b_top},
`pathir.lifting.low_rank`), so that the largest of the parts' scales, which the caller shares, never
pushes another part's terms below float64's normal range.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp

from pathir.pairs.unit_pairs import pad

__all__ = ["LowRankStack", "StackPoint"]


def _padded(rows: list[np.ndarray], fill) -> np.ndarray:
    """The arrays stacked on a new first axis, each padded along its first axis to the longest with ``fill``."""
    n = max(r.shape[0] for r in rows)
    out = np.full((len(rows), n, *rows[0].shape[1:]), fill, dtype=rows[0].dtype)
    for g, r in enumerate(rows):
        out[g, :r.shape[0]] = r
    return out


class LowRankStack:
    """Rank-k grids (``FactoredGrid`` with U, V) of one k over the same H units, stacked: grid g's rows
    ``enter[g, :sizes[g, 0]]`` and columns ``leave[g, :sizes[g, 1]]``, the rest padding (unit H, log
    factor -inf, factor rows 0: no term)."""

    def __init__(self, grids):
        self.grids = tuple(grids)
        H = self.num_units = self.grids[0].num_units
        self.sizes = np.array([(g.enter.size, g.leave.size) for g in self.grids], dtype=np.int64)
        self.enter = _padded([g.enter for g in self.grids], H)  # (G, E)
        self.leave = _padded([g.leave for g in self.grids], H)  # (G, L)
        self.log_u = _padded([np.asarray(g.log_u, dtype=np.float64) for g in self.grids], -np.inf)
        self.log_v = _padded([np.asarray(g.log_v, dtype=np.float64) for g in self.grids], -np.inf)
        self.U = _padded([g.U for g in self.grids], 0.0)  # (G, E, k)
        self.V = _padded([g.V for g in self.grids], 0.0)  # (G, L, k)
        self.real_rows = np.arange(self.enter.shape[1]) < self.sizes[:, :1]  # (G, E): not padding
        self.real_cols = np.arange(self.leave.shape[1]) < self.sizes[:, 1:]  # (G, L)

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
        st = self.stack
        with np.errstate(divide="ignore"):  # (the padding's log 0)
            return ((self.log_alpha + b_top[:, None] + np.log(_mv(st.U, self.sb)))[st.real_rows],
                    (self.log_beta + self.a_top[:, None] + np.log(_mv(st.V, self.sa)))[st.real_cols])

    def _grid(self, g: int) -> tuple:
        """Grid g's (A, B, enter, leave, U, V) without its padding."""
        st = self.stack
        e, l = st.sizes[g]
        return self.A[g, :e], self.B[g, :l], st.enter[g, :e], st.leave[g, :l], st.U[g, :e], st.V[g, :l]

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
        e^{log_scale} (`PairPoint.grouped`: ``groups`` and ``keep`` have H + 1 entries): Σ_g shift_g R_g C_gᵀ
        with R_g, C_g grid g's rows of A and B summed by group, every grid in one product."""
        m1 = table.shape[0]
        st = self.stack
        R = _sums_by_group(groups[st.enter], self.A, m1, None if keep is None else keep[st.enter])
        R *= self._shift(log_scale)[:, :, None]  # (G, m1, k)
        C = _sums_by_group(groups[st.leave], self.B, m1, None if keep is None else keep[st.leave])
        G, k = R.shape[0], R.shape[2]
        table += R.transpose(1, 0, 2).reshape(m1, G * k) @ C.transpose(1, 0, 2).reshape(m1, G * k).T

    def add_self_terms(self, into: np.ndarray, log_scale: float) -> None:
        """The terms of the pairs (h, h) (units on both sides of a grid) added into ``into`` over e^{log_scale}."""
        shift = self._shift(log_scale)[:, 0]
        for g in range(len(self.stack.grids)):
            A, B, enter, leave, _, _ = self._grid(g)
            both, ie, il = np.intersect1d(enter, leave, assume_unique=True, return_indices=True)
            into[both] += np.einsum("ij,ij->i", A[ie], B[il]) * shift[g]

    def log_extremes(self) -> tuple[float, float]:
        """(min, max) over the grids of log t_{e,l}."""
        lo, hi = math.inf, -math.inf
        for g in range(len(self.stack.grids)):
            e, l = self.stack.sizes[g]
            _, _, _, _, U, V = self._grid(g)
            logs = self.log_alpha[g, :e][:, None] + self.log_beta[g, :l][None, :] + np.log(U @ V.T)
            lo, hi = min(lo, float(logs.min())), max(hi, float(logs.max()))
        return lo, hi


def _sums_by_group(index: np.ndarray, M: np.ndarray, m: int, weight: np.ndarray | None) -> np.ndarray:
    """(G, m, k): entry [g, j] the sum of the rows r of M[g] with index[g, r] = j, each times weight[g, r]
    (1 without), in one sparse product."""
    G, R, k = M.shape
    flat = (index + m * np.arange(G)[:, None]).ravel()
    values = np.ones(flat.size) if weight is None else np.asarray(weight, dtype=np.float64).ravel()
    S = sp.csr_array((values, (flat, np.arange(flat.size))), shape=(G * m, G * R))
    return (S @ M.reshape(G * R, k)).reshape(G, m, k)
