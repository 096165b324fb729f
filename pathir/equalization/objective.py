"""The equalization objectives (docs/math.md §12) on the quantized tensors' unit-pair grids, with
their gradients.

With a_rc(z) = log max_{i∈(r,c)} |θ_i| + (z_r − z_c)/2 the log range of the pair entering unit r and
leaving unit c after a rescaling z (z = 0 for "no unit"), tensor T's log range is
log R_T(z) = max_{rc} a_rc(z).

``range``: Σ_T [log R_T(z) − mean_{i∈T, θ_i≠0} log |θ_i(z)|], the log of each tensor's quantization
step over the geometric mean of its weights, summed. The second term is linear in z, so the
objective is convex and piecewise linear; it does not change when one tensor is scaled as a whole
(nothing any quantizer could gain), and on a chain of two layers the linear terms cancel and it is
Nagel's criterion (Σ_h r¹_h r²_h / (R¹ R²) is rescaling-invariant there).

``path-metric``: log Σ_T R_T(z) · Σ_{i∈T} (S_i/|θ_i|) e^{(z_c(i) − z_r(i))/2}, the log of the first-order
bound on ‖Φ(θ) − Φ(Q(θ))‖₁ (up to the constant Δ/R / 2 = 1/(2(2^{b−1} − 1))): a log-sum-exp of sums of
convex functions, convex.

Each max is smoothed by a log-sum-exp of sharpness p, (1/p) log Σ e^{p a} ≥ max a, within
log(#pairs)/p of it; p = inf is the exact objective.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp

from pathir.equalization.tensors import TensorGrid, TensorPairs

__all__ = ["Objective", "OBJECTIVES"]

OBJECTIVES = ("noise", "range", "path-metric")
#: grids larger than this with fewer than this fraction of cells filled are kept sparse
SPARSE_FROM, SPARSE_FILL = 4096, 0.25
#: per kind with weights: the power k of the term R_T^k · Σ_i w_i e^{−k(z_r(i) − z_c(i))/2}
POWER = {"noise": 2, "path-metric": 1}


def _lse(a: np.ndarray, p: float, marginals: bool):
    """(1/p) log Σ e^{p a} over a grid (its max for p = inf), and its softmax's row and column sums."""
    top = float(np.max(a))
    if not math.isfinite(top):
        return top, None
    if math.isinf(p):
        return top, None
    e = np.exp(p * (a - top))
    total = float(e.sum())
    value = top + math.log(total) / p
    if not marginals:
        return value, None
    return value, (e.sum(axis=1) / total, e.sum(axis=0) / total)


class _Grid:
    """A grid's log values l_rc and their exponentials at one sharpness, A = e^{p(l − max l)}, so that
    the smoothed max of l_rc + σ(z_r − z_c)/2 is two mat-vecs (no exponential per cell). A grid whose
    cells are mostly empty (-inf: a grouped convolution's block diagonal) keeps A sparse."""

    def __init__(self, log: np.ndarray, sign: float):
        self.log, self.sign = log, sign
        self.top = float(np.max(log))
        self.sparse = log.size > SPARSE_FROM and np.count_nonzero(np.isfinite(log)) < SPARSE_FILL * log.size
        self.cache: dict[float, object] = {}  # p -> A (the solver uses two sharpnesses at a time)

    def _exp(self, p: float):
        """(A, Aᵀ) at sharpness p."""
        A = np.exp(p * (self.log - self.top))
        if not self.sparse:
            return A, A.T
        A = sp.csr_array(A)
        return A, A.T.tocsr()

    def lse(self, zr: np.ndarray, zc: np.ndarray, p: float, marginals: bool):
        if not math.isfinite(self.top):
            return self.top, None
        if math.isinf(p):
            return _lse(self.log + self.sign * 0.5 * (zr[:, None] - zc[None, :]), p, False)
        A = self.cache.get(p)
        if A is None:
            if len(self.cache) > 1:
                self.cache.pop(max(self.cache))  # the stage before's sharpness
            A = self.cache[p] = self._exp(p)
        A, At = A
        sr, sc = self.sign * 0.5 * p * zr, -self.sign * 0.5 * p * zc
        mr, mc = float(sr.max()), float(sc.max())
        u, v = np.exp(sr - mr), np.exp(sc - mc)
        Av = A @ v
        total = float(u @ Av)
        if not (total > 1e-250 and math.isfinite(total)):  # the product under- or overflowed: cell by cell
            return _lse(self.log + self.sign * 0.5 * (zr[:, None] - zc[None, :]), p, marginals)
        value = self.top + (mr + mc + math.log(total)) / p
        if not marginals:
            return value, None
        return value, (u * Av / total, v * (At @ u) / total)


class Objective:
    """One objective on one graph's quantized tensors: ``value(z, p)`` and ``value_and_grad(z, p)``
    (the gradient with respect to z ∈ R^H). ``extra``: further sharpnesses whose smoothed value and
    gradient ``value_and_grad`` adds, weighted (the solver's balance term), at no second pass."""

    def __init__(self, pairs: TensorPairs, kind: str = "range"):
        if kind not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {kind!r}")
        if kind in POWER and any(g.log_weight is None for g in pairs.grids):
            raise ValueError(f"the {kind} objective needs the pairs' weights")
        self.pairs, self.kind = pairs, kind
        self.H = pairs.num_units
        self.ranges = [_Grid(g.log_max, 1.0) for g in pairs.grids]
        # Σ_i w_i e^{−kΔ/2} = (k-th power of) the smoothed max at sharpness k of log(w)/k − Δ/2
        self.power = POWER.get(kind, 1)
        self.weights = [_Grid(g.log_weight / self.power, -1.0) for g in pairs.grids] if kind in POWER else None
        # Σ_T mean_{i∈T, θ_i≠0} (z_r(i) − z_c(i))/2 = linear · z: the geometric means' part of "range"
        self.linear = np.zeros(self.H)
        self.constant = -sum(g.mean_log for g in pairs.grids) if kind == "range" else 0.0
        if kind == "range":
            for g in pairs.grids:
                self._add(self.linear, g, g.row_count / g.nonzero, g.col_count / g.nonzero)

    def _add(self, out: np.ndarray, g: TensorGrid, rows: np.ndarray, cols: np.ndarray, scale: float = 1.0) -> None:
        """out += scale · Σ (rows_r ½δ_r − cols_c ½δ_c) over g's units (none dropped)."""
        H = self.H  # a grid's rows (and its columns) are distinct units: plain fancy-index adds
        r, c = g.rows < H, g.cols < H
        out[g.rows[r]] += 0.5 * scale * rows[r]
        out[g.cols[c]] -= 0.5 * scale * cols[c]

    def curvature(self, z: np.ndarray, p: float, extra: tuple = ()) -> np.ndarray:
        """An estimate of the Hessian's diagonal at z (each smoothed max's softmax marginals times q/4,
        summed over the units they touch): the solver's diagonal preconditioner."""
        zp = np.append(np.asarray(z, dtype=np.float64), 0.0)
        out = np.zeros(self.H)
        if self.weights is not None:  # k·c_T times each smoothed max's own curvature (the LSE over T left out)
            k = self.power
            _, c, parts = self._terms(zp, p, True)
            for ct, (g, rm, wm) in zip(() if c is None else c, parts):
                for marg, q in ((rm, p), (wm, k)):
                    if marg is not None:
                        self._add(out, g, marg[0], -marg[1], k * ct * q / 2)
            return out
        for g, grid in zip(self.pairs.grids, self.ranges):
            zr, zc = zp[g.rows], zp[g.cols]
            for q, weight in ((p, 1.0), *extra):
                _, marg = grid.lse(zr, zc, q, True)
                if marg is not None:
                    rows, cols = marg
                    self._add(out, g, rows, -cols, weight * q / 2)  # (q/4)·(rows + cols): _add halves
        return out

    def value(self, z: np.ndarray, p: float = math.inf) -> float:
        return self.value_and_grad(z, p, grad=False)[0]

    def value_and_grad(self, z: np.ndarray, p: float, grad: bool = True, extra: tuple = ()):
        """(objective at sharpness p + Σ weight · objective at sharpness q for (q, weight) in ``extra``,
        its gradient or None)."""
        z = np.asarray(z, dtype=np.float64)
        zp = np.append(z, 0.0)
        out = np.zeros(self.H) if grad else None
        if self.kind == "range":
            scale = 1.0 + sum(w for _, w in extra)
            value = scale * (self.constant - float(self.linear @ z))
            for g, grid in zip(self.pairs.grids, self.ranges):
                zr, zc = zp[g.rows], zp[g.cols]
                for q, weight in ((p, 1.0), *extra):
                    v, marg = grid.lse(zr, zc, q, grad)
                    value += weight * v
                    if grad and marg is not None:
                        self._add(out, g, *marg, weight)
            if grad:
                out -= scale * self.linear
            return value, out
        total, k = 0.0, self.power
        for q, weight in ((p, 1.0), *extra):
            value, c, parts = self._terms(zp, q, grad)
            if c is None:  # no quantized weight on any path (or no weights): nothing to move
                return (value, np.zeros(self.H) if grad else None)
            total += weight * value
            if grad:
                for ct, (g, rm, wm) in zip(c, parts):
                    if rm is not None:
                        self._add(out, g, *rm, k * weight * ct)
                    if wm is not None:
                        self._add(out, g, *wm, -k * weight * ct)
        return total, out

    def _terms(self, zp: np.ndarray, q: float, marginals: bool):
        """(log Σ_T e^{k(r_T + w_T)} at sharpness q, the softmax c_T over the tensors, per tensor (grid,
        range marginals, weight marginals)); c is None where every term is -inf."""
        k = self.power
        terms, parts = [], []
        for g, rg, wg in zip(self.pairs.grids, self.ranges, self.weights):
            zr, zc = zp[g.rows], zp[g.cols]
            r, rm = rg.lse(zr, zc, q, marginals)
            w, wm = wg.lse(zr, zc, float(k), marginals)
            terms.append(k * (r + w))
            parts.append((g, rm, wm))
        terms = np.asarray(terms)
        top = float(np.max(terms))
        if not math.isfinite(top):
            return -math.inf, None, parts
        c = np.exp(terms - top)
        total = float(c.sum())
        return top + math.log(total), c / total, parts
