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

from pathir.equalization.stack import GridStack
from pathir.equalization.tensors import TensorGrid, TensorPairs

__all__ = ["Objective", "KINDS"]

#: the objectives solved here (``run.OBJECTIVES`` adds output-noise: the noise kind on other weights)
KINDS = ("noise", "range", "path-metric")
#: per kind with weights: the power k of the term R_T^k · Σ_i w_i e^{−k(z_r(i) − z_c(i))/2}
POWER = {"noise": 2, "path-metric": 1}
#: the one sharpness the weights' term is read at (its shift scaled by k instead: ``Objective.__init__``)
WEIGHT_SHARPNESS = 1.0


class Objective:
    """One objective on one graph's quantized tensors: ``value(z, p)`` and ``value_and_grad(z, p)``
    (the gradient with respect to z ∈ R^H). ``extra``: further sharpnesses whose smoothed value and
    gradient ``value_and_grad`` adds, weighted (the solver's balance term), at no second pass."""

    def __init__(self, pairs: TensorPairs, kind: str = "range"):
        if kind not in KINDS:
            raise ValueError(f"objective must be one of {KINDS}, got {kind!r}")
        if kind in POWER and any(g.log_weight is None for g in pairs.grids):
            raise ValueError(f"the {kind} objective needs the pairs' weights")
        self.pairs, self.kind = pairs, kind
        self.H = pairs.num_units
        rows, cols = [g.rows for g in pairs.grids], [g.cols for g in pairs.grids]
        self.ranges = GridStack([g.log_max for g in pairs.grids], rows, cols, 1.0)
        self.power = POWER.get(kind, 1)
        # Σ_i w_i e^{−kΔ/2} = e^{k r} with r = (1/k) log Σ_i e^{log w_i − kΔ/2}: the grids' smoothed max at sharpness
        # 1 with the shift scaled by k, over k (the grids' own logs: no copy of them divided by k). Read at that one
        # sharpness, where its grids (paths' mass after a unit times mass before one) have low rank
        self.weights = GridStack([g.log_weight for g in pairs.grids], rows, cols, -float(self.power),
                                 low_rank_at=WEIGHT_SHARPNESS) if kind in POWER else None
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

    def _scatter(self, out: np.ndarray, stack: GridStack, rows, cols, scale: np.ndarray) -> None:
        """out += Σ_T scale_T · (½ rows → the tensor's row units, −½ cols → its column units), every
        tensor at once (marginals laid end to end as ``stack`` lays them)."""
        H = self.H
        out += 0.5 * np.bincount(stack.row_unit, scale[stack.row_owner] * rows, minlength=H + 1)[:H]
        out -= 0.5 * np.bincount(stack.col_unit, scale[stack.col_owner] * cols, minlength=H + 1)[:H]

    def retain(self, sharpnesses) -> None:
        """Free what is cached for any sharpness but ``sharpnesses`` (the weights' term keeps its own)."""
        self.ranges.retain(sharpnesses)
        if self.weights is not None:
            self.weights.retain({WEIGHT_SHARPNESS})

    def curvature(self, z: np.ndarray, p: float, extra: tuple = ()) -> np.ndarray:
        """An estimate of the Hessian's diagonal at z (each smoothed max's softmax marginals times q/4,
        summed over the units they touch): the solver's diagonal preconditioner."""
        zp = np.append(np.asarray(z, dtype=np.float64), 0.0)
        out = np.zeros(self.H)
        ones = np.ones(len(self.pairs))
        if self.weights is not None:  # k·c_T times each smoothed max's own curvature (the LSE over T left out)
            k = self.power
            _, c, parts = self._terms(zp, p, True)
            if c is not None:
                (rr, rc), (wr, wc) = parts
                self._scatter(out, self.ranges, rr, -rc, k * c * p / 2)
                self._scatter(out, self.weights, wr, -wc, k * c * k / 2)
            return out
        for q, weight in ((p, 1.0), *extra):
            _, rows, cols = self.ranges.lse(zp, q, True)
            if rows is not None:
                self._scatter(out, self.ranges, rows, -cols, weight * q / 2 * ones)  # (q/4)·(rows + cols)
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
            ones = np.ones(len(self.pairs))
            for q, weight in ((p, 1.0), *extra):
                values, rows, cols = self.ranges.lse(zp, q, grad)
                value += weight * float(values.sum())
                if grad and rows is not None:
                    self._scatter(out, self.ranges, rows, cols, weight * ones)
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
                (rr, rc), (wr, wc) = parts
                if rr is not None:
                    self._scatter(out, self.ranges, rr, rc, k * weight * c)
                if wr is not None:
                    self._scatter(out, self.weights, wr, wc, -k * weight * c)
        return total, out

    def _terms(self, zp: np.ndarray, q: float, marginals: bool):
        """(log Σ_T e^{k(r_T + w_T)} at sharpness q, the softmax c_T over the tensors, ((range row and
        column marginals), (weight row and column marginals))); c is None where every term is -inf."""
        k = self.power
        r, rr, rc = self.ranges.lse(zp, q, marginals)
        w, wr, wc = self.weights.lse(zp, WEIGHT_SHARPNESS, marginals)
        w = w / k
        parts = ((rr, rc), (wr, wc))
        with np.errstate(invalid="ignore"):
            terms = k * (r + w)
        terms = np.where(np.isnan(terms), -np.inf, terms)
        top = float(np.max(terms)) if terms.size else -math.inf
        if not math.isfinite(top):
            return -math.inf, None, parts
        c = np.exp(terms - top)
        total = float(c.sum())
        return top + math.log(total), c / total, parts
