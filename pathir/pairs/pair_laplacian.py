"""The unit pairs as a weighted graph Laplacian, evaluated at a point z (docs/math.md §7, §8).

With the pairs k = (e_k, l_k) of `pathir.pairs.unit_pairs` and their masses
P_k, E(z) = Σ_k P_k e^{z_{e_k} - z_{l_k}} (z_H = 0, "no unit"); with
t_k = P_k e^{z_e - z_l}, I_h = Σ_{e_k = h} t_k and O_h = Σ_{l_k = h} t_k,

    ∇E = I - O,      ∇²E = Σ_k t_k (u_e - u_l)(u_e - u_l)ᵀ,

a Laplacian grounded at "no unit". ENorm minimises E itself; PathCond's
S(z) = Σ_k P_k e^{z_l - z_e} is E(-z), so both solvers read their sums,
gradients and Hessian-vector products from one `PairLaplacian`.
"""

from __future__ import annotations

import math
from functools import cached_property

import numpy as np
import scipy.sparse as sp

from pathir.pairs.pair_matrix import PairMatrix
from pathir.pairs.unit_pairs import Pairs, pad, pair_terms, segment_logsumexp

__all__ = ["PairLaplacian", "PairPoint", "TINY", "FactoredPoint", "ExplicitPoint", "clamped_steps", "unit_steps"]


def _grouped_logsumexp(values: np.ndarray, order: np.ndarray | None, group: np.ndarray, size: int) -> np.ndarray:
    """log Σ exp(values) per group id in [0, size) (-inf for an empty group); ``group[order]``
    is sorted (``order`` None: ``group`` already is)."""
    g = group if order is None else group[order]
    out = np.full(size, -math.inf)
    if g.size:
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        out[g[starts]] = segment_logsumexp(values if order is None else values[order], starts)
    return out


def clamped_steps(z: np.ndarray, log_in: np.ndarray, log_out: np.ndarray, bound: float | None) -> np.ndarray:
    """Per unit, its exact ENorm update clamped to |z| ≤ bound, minus z (nan where a side is empty)."""
    with np.errstate(invalid="ignore"):
        target = z + 0.5 * (log_out - log_in)
    return (target if bound is None else np.clip(target, -bound, bound)) - z


def unit_steps(pairs: Pairs, z: np.ndarray, bound: float | None) -> np.ndarray:
    """`clamped_steps` at z with the unit masses summed in log space (no mass lost to underflow)."""
    H = pairs.num_units
    zp = pad(z)
    v = pairs.log_mass + zp[pairs.enter] - zp[pairs.leave]
    log_in = _grouped_logsumexp(v, None, pairs.enter, H + 1)[:H]
    log_out = _grouped_logsumexp(v, pairs.by_leave.order, pairs.leave, H + 1)[:H]
    return clamped_steps(z, log_in, log_out, bound)


# a unit mass below this (relative to the largest term, 1) may have lost terms to underflow
TINY = 1e-280


class PairLaplacian:
    """The pairs as the Hessian of E, built once; `point` evaluates E, ∇E and ∇²E at a z.

    Where the masses are linear (``pairs.mass``) and z's spread keeps every term in float64's
    range, a point needs no per-pair work: t_k = P_top e^{high - low} mass_k u_{e_k} v_{l_k} with
    u = e^{z - high}, v = e^{low - z} (z padded with "no unit"'s 0), so I = u ⊙ (M v),
    O = v ⊙ (Mᵀ u) and the Hessian's off-diagonal part applies as u ⊙ M (v ⊙ p) and its
    transpose, for the static mass matrix M (`PairMatrix`: dense blocks per layer). Otherwise
    the terms are formed one by one in log space (`ExplicitPoint`).
    """

    def __init__(self, pairs: Pairs):
        H = pairs.num_units
        self.pairs, self.H = pairs, H
        e, l = pairs.enter, pairs.leave
        self.self_pairs = np.flatnonzero(e == l)
        self.matrix = None if pairs.mass is None else PairMatrix(e, l, pairs.mass, H + 1)
        if pairs.mass is not None:
            self.self_mass = np.bincount(e[self.self_pairs], weights=pairs.mass[self.self_pairs], minlength=H + 1)[:H]
            self.min_mass = float(pairs.mass.min(initial=1.0))

    def cells(self, groups: np.ndarray, m1: int) -> np.ndarray:
        """Per pair, its cell g(enter) m1 + g(leave) of a group-pair table (kept for the last ``groups``)."""
        cached = getattr(self, "_cells", None)
        if cached is None or cached[0] is not groups:
            dtype = np.int32 if m1 * m1 < 2**31 else np.int64
            cells = groups[self.pairs.enter].astype(dtype) * m1 + groups[self.pairs.leave].astype(dtype)
            self._cells = cached = (groups, cells)
        return cached[1]

    @cached_property
    def explicit_pattern(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inner pairs, CSR indptr over entered units, their left units) of the off-diagonal part."""
        H, e, l = self.H, self.pairs.enter, self.pairs.leave
        inner = np.flatnonzero((e < H) & (l < H) & (e != l))
        indptr = np.searchsorted(e[inner], np.arange(H + 1))
        return inner, indptr, l[inner].astype(np.int32 if H < 2**31 - 1 else np.int64)

    def point(self, z: np.ndarray, both: bool = False) -> "FactoredPoint | ExplicitPoint":
        """E and its sums at z; ``both``: O is read in the same pass over M as I (when both are needed)."""
        if self.matrix is not None:
            zp = pad(z)
            high, low = float(zp.max()), float(zp.min())
            if 2.0 * (high - low) < math.log(self.min_mass) + 690.0:
                return FactoredPoint(self, z, zp, high, low, both)
        log_scale, t = pair_terms(self.pairs, -pad(z))  # P e^{z_e - z_l} = t e^{log_scale}
        return ExplicitPoint(self, z, log_scale, t)


class PairPoint:
    """E at one z in a common scale: ``inc`` = I, ``out`` = O, ``total`` = E (all over one factor
    e^{log_e} / total), ``log_e`` = log E; `diag` (the Jacobi preconditioner) and `hessian_times`."""

    lap: PairLaplacian
    z: np.ndarray
    total: float
    log_e: float

    def steps(self, live: np.ndarray, bound: float | None) -> np.ndarray:
        """`clamped_steps` at this point: from the linear sums where every live unit's sums are
        far from underflow, else in log space (`unit_steps`)."""
        if np.all(self.inc[live] > TINY) and np.all(self.out[live] > TINY):
            with np.errstate(divide="ignore"):
                return clamped_steps(self.z, np.log(self.inc), np.log(self.out), bound)
        return unit_steps(self.lap.pairs, self.z, bound)

    def grouped(self, groups: np.ndarray, m1: int, keep: np.ndarray | None = None) -> np.ndarray:
        """T (m1 x m1): T[a, b] = Σ t_k over the pairs entering a unit of group a and leaving one of group b
        (``groups`` per unit, "no unit" included: H + 1 entries in [0, m1)), in this point's scale;
        with ``keep`` (H + 1 entries, 0 or 1), only the pairs with both ends kept."""
        raise NotImplementedError

    def diag(self) -> np.ndarray:
        """∇²E's diagonal, I + O without the pairs entering and leaving one unit."""
        return self._diagonal

    @cached_property
    def _diagonal(self) -> np.ndarray:
        return np.maximum(self.inc + self.out - 2.0 * self.self_terms(), 0.0)


class FactoredPoint(PairPoint):
    """E at z from the static mass matrix and the scalings u = e^{z - high}, v = e^{low - z}
    (`PairLaplacian`); every term mass_k u_e v_l lies in (e^-690, 1]: nothing underflows."""

    def __init__(self, lap: PairLaplacian, z: np.ndarray, zp: np.ndarray, high: float, low: float,
                 both: bool = False):
        self.lap, self.z = lap, z
        self.u, self.v = np.exp(zp - high), np.exp(low - zp)
        if both:
            ahead, back = lap.matrix.both(self.v, self.u)
            self.out = (self.v * back)[:lap.H]
        else:
            ahead = lap.matrix(self.v)
        entering = self.u * ahead  # I, and the mass entering "no unit" last
        self.total = float(entering.sum())
        self.log_e = lap.pairs.log_top + (high - low) + math.log(self.total)
        self.inc = entering[:lap.H]

    def terms(self) -> np.ndarray:
        """t_k for every pair, in this point's scale."""
        pairs = self.lap.pairs
        return pairs.mass * self.u[pairs.enter] * self.v[pairs.leave]

    def grouped(self, groups: np.ndarray, m1: int, keep: np.ndarray | None = None) -> np.ndarray:
        """The terms summed by (group entered, group left), in this point's scale (`PairPoint.grouped`):
        one pass over the mass matrix, no per-pair work on its dense blocks."""
        u, v = (self.u, self.v) if keep is None else (self.u * keep, self.v * keep)
        return self.lap.matrix.grouped(v, u, groups, m1)

    @cached_property
    def out(self) -> np.ndarray:
        return (self.v * self.lap.matrix.T(self.u))[:self.lap.H]

    def self_terms(self) -> np.ndarray:
        H = self.lap.H
        return self.lap.self_mass * self.u[:H] * self.v[:H]

    def hessian_times(self, p: np.ndarray) -> np.ndarray:
        """∇²E p (in this point's scale) for p over the units: the off-diagonal part, pairs entering and
        leaving one unit included, cancels those pairs' share of I + O."""
        u, v, pp = self.u, self.v, pad(p)
        ahead, back = self.lap.matrix.both(v * pp, u * pp)
        return (self.inc + self.out) * p - (u * ahead + v * back)[:self.lap.H]


class ExplicitPoint(PairPoint):
    """E at z from the terms t_k (over e^{log_scale}, max 1), formed pair by pair."""

    def __init__(self, lap: PairLaplacian, z: np.ndarray, log_scale: float, t: np.ndarray):
        self.lap, self.z, self.t = lap, z, t
        self.total = float(t.sum())
        self.log_e = log_scale + math.log(self.total) if self.total > 0 else -math.inf
        H, pairs = lap.H, lap.pairs
        self.inc = np.bincount(pairs.enter, weights=t, minlength=H + 1)[:H]
        self.out = np.bincount(pairs.leave, weights=t, minlength=H + 1)[:H]

    def terms(self) -> np.ndarray:
        """t_k for every pair, in this point's scale."""
        return self.t

    def grouped(self, groups: np.ndarray, m1: int, keep: np.ndarray | None = None) -> np.ndarray:
        pairs = self.lap.pairs
        t = self.t if keep is None else self.t * keep[pairs.enter] * keep[pairs.leave]
        return np.bincount(self.lap.cells(groups, m1), weights=t, minlength=m1 * m1).reshape(m1, m1)

    def self_terms(self) -> np.ndarray:
        lap = self.lap
        return np.bincount(lap.pairs.enter[lap.self_pairs], weights=self.t[lap.self_pairs], minlength=lap.H + 1)[:lap.H]

    @cached_property
    def _upper(self) -> sp.csr_array:
        inner, indptr, indices = self.lap.explicit_pattern
        return sp.csr_array((self.t[inner], indices, indptr), shape=(self.lap.H, self.lap.H))

    def hessian_times(self, p: np.ndarray) -> np.ndarray:
        upper = self._upper
        return self.diag() * p - upper @ p - upper.T @ p
