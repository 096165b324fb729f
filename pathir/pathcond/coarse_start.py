"""PathCond's coarse start: F minimised over z = z₀ + P w, one shift w_a per group of units.

Restricted to a shift per group (`pathir.pairs.coarse.CoarseSpace`), F is
the same kind of function on the group-pair table T (pair terms at z₀ summed
by group entered a and group left b):

    F(z₀ + Pw) = n log Σ_ab T_ab e^{w_b - w_a} + (PᵀA)·w + F's part at z₀,

convex, with m ~ the number of layers. It is solved exactly by projected Newton
on the dense m x m Hessian, within the box that keeps every |z_h| <= M. At
torchvision's initialisation most of F's decrease is such a shift of whole
layers (g spans dozens of orders of magnitude across depth), which unit-level
Newton reaches only after many damped steps.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["coarse_shift"]


def _value(log_t: np.ndarray, a: np.ndarray, n: int, w: np.ndarray):
    """(F̃(w), ∇F̃, q) with q_ab = T_ab e^{w_b - w_a} / Σ (module docstring), w_m = 0."""
    wp = np.append(w, 0.0)
    e = log_t + wp[None, :] - wp[:, None]
    top = float(e.max())
    q = np.exp(e - top)
    total = float(q.sum())
    q /= total
    m = w.size
    leave, enter = q.sum(axis=0)[:m], q.sum(axis=1)[:m]
    return n * (top + math.log(total)) + float(a @ w), n * (leave - enter) + a, q


def coarse_shift(T: np.ndarray, a: np.ndarray, n: int, lo: np.ndarray, hi: np.ndarray,
                 max_iterations: int = 100) -> tuple[np.ndarray, float]:
    """(w, F̃(w) - F̃(0)): the minimiser of F̃ (module docstring) over lo <= w <= hi.

    ``T`` (m + 1) x (m + 1), row/column m "no unit" (w_m = 0); ``a`` = PᵀA. A group with no
    term entering or leaving it (F̃ unbounded along w_a) keeps w_a = 0.

    >>> import numpy as np
    >>> T = np.array([[0.0, 1.0], [4.0, 0.0]])   # one group: mass 1 entering it, 4 leaving it
    >>> w, drop = coarse_shift(T, np.zeros(1), 2, np.array([-5.0]), np.array([5.0]))
    >>> round(float(w[0]), 6), drop < 0
    (-0.693147, True)
    """
    m = a.size
    with np.errstate(divide="ignore"):
        log_t = np.log(T)
    inner_in, inner_out = T[:m].sum(axis=1), T[:, :m].sum(axis=0)
    fixed = ~((inner_in > 0) & (inner_out > 0))
    lo, hi = np.where(fixed, 0.0, np.minimum(lo, 0.0)), np.where(fixed, 0.0, np.maximum(hi, 0.0))
    w = np.zeros(m)
    f, grad, q = _value(log_t, a, n, w)
    f0 = f
    for _ in range(max_iterations):
        free = ~fixed & ~(((w <= lo) & (grad > 0)) | ((w >= hi) & (grad < 0)))
        idx = np.flatnonzero(free)
        if idx.size == 0:
            break
        leave, enter = q.sum(axis=0)[:m], q.sum(axis=1)[:m]
        c = leave - enter
        inner = q[:m, :m]
        hess = n * (np.diag(leave + enter) - inner - inner.T - np.outer(c, c))
        sub = hess[np.ix_(idx, idx)]
        sub[np.diag_indices(idx.size)] += 1e-12 * max(float(np.max(np.diag(sub))), 1e-300)
        d = np.zeros(m)
        try:
            d[idx] = np.linalg.solve(sub, -grad[idx])
        except np.linalg.LinAlgError:
            d[idx] = np.nan
        if not np.all(np.isfinite(d)):  # a singular group table: the diagonal step instead
            d[idx] = -grad[idx] / np.maximum(np.diag(sub), 1e-300)
        slope = float(grad @ d)
        if not slope < 0:
            break
        step, moved = 1.0, False
        for _ in range(60):
            trial = np.clip(w + step * d, lo, hi)
            f_new, g_new, q_new = _value(log_t, a, n, trial)
            if f_new <= f + 1e-4 * float(grad @ (trial - w)):
                moved = True
                break
            step *= 0.5
        if not moved:
            break
        change = float(np.max(np.abs(trial - w)))
        decrease = f - f_new
        w, f, grad, q = trial, f_new, g_new, q_new
        if change <= 1e-12 or decrease <= 1e-15 * max(1.0, abs(f)):
            break
    return w, f - f0
