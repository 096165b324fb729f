"""PathCond by cyclic coordinate descent: the published algorithm (docs/math.md §7).

One unit at a time, in index order. For unit h, with the others fixed and
x = e^{z_h}, Σ_i g_i e^{(Bz)_i} = B_h x + C_h / x + D_h and the exact minimiser
is the positive root of

    (n + A_h) B_h x² + A_h D_h x + (A_h - n) C_h = 0.

As in the paper, the vector w = g ⊙ e^{Bz} and its total S are kept and
updated incrementally: a unit touches only its own rows, so a sweep costs
O(nnz(B)), and D_h = S - (B_h x + C_h / x) (summed directly instead when
the unit holds more than 1 - 1e-4 of S, where the subtraction would cancel).
After every sweep w is divided by its max and S recomputed exactly. The root is taken as x = sqrt(C_h / B_h) y
(`log_positive_root`), so y stays of order one.

When w would leave the float64 range (g spanning more than ~600 nats, or a
sweep that under/overflows) the solver keeps log w instead: same algorithm,
exact for any range, about 2.5x slower per sweep.
"""

from __future__ import annotations

import math
import time

import numpy as np

from pathir.analyses.unit_rows import canonical, column_balance, keys_for
from pathir.pathcond.objective import PathCondResult, as_g, finish, log0, logsumexp, row_state

__all__ = ["solve_coordinate"]

_SAFE = 1e-280  # linear-domain entries must stay within [_SAFE, 1 / _SAFE] of the max
_CANCEL = 1e-4  # D_h = S - (unit's mass) loses eps S / D_h to cancellation: below this, sum D_h directly


def log_root(a: int, log_r: float, n: int) -> float:
    """Scalar ``log_positive_root(a, log_r, n + a, n - a)``, in plain floats for the per-unit loop."""
    q = 4.0 * (n + a) * (n - a)
    log_t = math.log(abs(a)) + log_r if a != 0 and log_r > -math.inf else -math.inf
    if log_t > 300.0:
        log_sum = log_t + math.log1p(math.sqrt(1.0 + q * math.exp(-2.0 * log_t)))
    else:
        t = math.exp(log_t)
        log_sum = math.log(t + math.sqrt(t * t + q))
    return math.log(2.0 * (n - a)) - log_sum if a >= 0 else log_sum - math.log(2.0 * (n + a))


def _logaddexp(a: float, b: float) -> float:
    if a == -math.inf or b == -math.inf:
        return max(a, b)
    return max(a, b) + math.log1p(math.exp(-abs(a - b)))


def _lse(v: np.ndarray) -> float:
    top = float(v.max())
    return top + math.log(float(np.exp(v - top).sum()))


def _sweep_linear(w: np.ndarray, s: float, z: np.ndarray, units, n: int, bound: float = math.inf) -> float:
    """One sweep on w = g e^{Bz} / scale (in place); returns the running S."""
    for h, rin, rout, a in units:
        wi, wo = w[rin], w[rout]
        si, so = float(wi.sum()), float(wo.sum())
        zh = z[h]
        log_b, log_c = math.log(so) - zh, math.log(si) + zh
        d = s - si - so
        if d < _CANCEL * s:  # the unit holds nearly all of S: sum the rest instead of subtracting
            w[rin], w[rout] = 0.0, 0.0
            d = float(w.sum())
        log_d = math.log(d) if d > 0 else -math.inf
        new = 0.5 * (log_c - log_b) + log_root(a, log_d - 0.5 * (log_b + log_c), n)
        new = min(max(new, -bound), bound)  # F is convex in z_h: the clamped root is the bounded minimiser
        ratio = math.exp(new - zh)
        w[rout] = wo * ratio
        w[rin] = wi / ratio
        z[h] = new
        s = max(d, 0.0) + so * ratio + si / ratio
    return s


def _sweep_log(ell: np.ndarray, log_s: float, z: np.ndarray, units, n: int, bound: float = math.inf) -> float:
    """One sweep on ell = log(g e^{Bz}) (in place); returns the running log S."""
    for h, rin, rout, a in units:
        li, lo = ell[rin], ell[rout]
        l_in, l_out = _lse(li), _lse(lo)
        zh = z[h]
        log_b, log_c = l_out - zh, l_in + zh
        frac = math.exp(_logaddexp(l_in, l_out) - log_s)
        if frac < 1.0 - _CANCEL:
            log_d = log_s + math.log1p(-frac)
        else:  # the unit holds nearly all of S: sum the rest instead of subtracting
            ell[rin], ell[rout] = -math.inf, -math.inf
            log_d = logsumexp(ell)
        new = 0.5 * (log_c - log_b) + log_root(a, log_d - 0.5 * (log_b + log_c), n)
        new = min(max(new, -bound), bound)  # F is convex in z_h: the clamped root is the bounded minimiser
        step = new - zh
        ell[rout] = lo + step
        ell[rin] = li - step
        z[h] = new
        log_s = _logaddexp(log_d, _logaddexp(log_b + new, log_c - new))
    return log_s


def solve_coordinate(g, B, *, max_sweeps: int = 1000, tol: float = 1e-10,
                     log_domain: bool | None = None, row_key=None, max_log_scale: float = math.inf,
                     callback=None) -> PathCondResult:
    """Minimise F by cyclic coordinate descent over the units (the reference solver).

    Parameters
    ----------
    g : (n,) array, diag G, non-negative.
    B : (n, H) sparse matrix with entries in {-1, 0, +1}, at most one of each sign per row.
    max_sweeps : sweeps over all units at most.
    tol : stop when a sweep changes F by at most ``tol * max(1, |F|, |A·z|)`` (A = -Bᵀ1) or moves no
        z_h by more than ``tol``.
    log_domain : keep log w rather than w; None chooses from the spread of g (and switches when needed).
    row_key : optional row keys of B (`unit_rows.keys_for`), sparing the full check of B.
    max_log_scale : bound on every |z_h| (the per-unit update is clamped: still exact); ``math.inf``: none.
    callback : called as ``callback(sweep, F)`` after each sweep.

    Returns
    -------
    PathCondResult (``method == "coordinate"``; ``extra["log_domain"]``: whether it ended on log w).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> B = sp.csr_array(np.array([[-1.], [1.]]))
    >>> r = solve_coordinate(np.array([1.0, 4.0]), B)
    >>> bool(np.isclose(r.z[0], -np.log(2))), r.sweeps
    (True, 2)
    """
    start = time.perf_counter()
    bound = float(max_log_scale)
    if row_key is None:
        B = canonical(B)
        A = column_balance(B)
    else:
        B, _, _, A = keys_for(B, row_key)
    n, H = B.shape
    g = as_g(g, n)
    csc = B.tocsc()
    units, degenerate = [], []
    for h in range(H):
        rows, sign = csc.indices[csc.indptr[h]:csc.indptr[h + 1]], csc.data[csc.indptr[h]:csc.indptr[h + 1]]
        # intp rows: numpy converts any other index type on every gather and scatter of the sweep
        rin, rout = rows[sign < 0].astype(np.intp), rows[sign > 0].astype(np.intp)
        if g[rin].any() and g[rout].any():
            units.append((h, rin, rout, int(A[h])))
        else:
            degenerate.append(h)
    positive = g > 0
    all_positive = bool(positive.all())

    z = np.zeros(H)
    top = float(g.max(initial=0.0))
    if log_domain is None:
        log_domain = not (top > 0 and float(g[positive].min()) > top * 1e-260)
    log_domain = bool(log_domain) or top == 0
    if log_domain:
        ell = log0(g)
        log_s = logsumexp(ell)
        f = n * log_s
    else:
        w = g / top
        scale, s = math.log(top), float(w.sum())
        f = n * (scale + math.log(s))
    history, times = [f], [time.perf_counter() - start]
    converged, sweeps = False, 0
    for sweeps in range(1, max_sweeps + 1):
        z_before = z.copy()
        if not log_domain:
            _sweep_linear(w, s, z, units, n, bound)
            big = float(w.max())
            small = float(w.min() if all_positive else w[positive].min())
            if math.isfinite(big) and big > 0 and small > big * _SAFE and big < 1 / _SAFE:
                w /= big
                scale, s = scale + math.log(big), float(w.sum())
                f_new = n * (scale + math.log(s)) + float(A @ z)
            else:  # the range outgrew float64: redo this sweep on log w
                log_domain, z = True, z_before.copy()
                ell = log0(g) + B @ z
                log_s = logsumexp(ell)
        if log_domain:
            _sweep_log(ell, log_s, z, units, n, bound)
            log_s = logsumexp(ell)
            f_new = n * log_s + float(A @ z)
        history.append(f_new)
        times.append(time.perf_counter() - start)
        if callback is not None:
            callback(sweeps, f_new)
        size = max(1.0, abs(f_new), abs(float(A @ z)))  # F's rounding follows its largest term
        if abs(f - f_new) <= tol * size or np.max(np.abs(z - z_before), initial=0.0) <= tol:
            converged = True
            break
        f = f_new
    return finish(g, B, z, row_state(g, B, A, z), method="coordinate", sweeps=sweeps, converged=converged,
                  degenerate=np.asarray(degenerate, dtype=np.int64), start=start, history=history, times=times,
                  bound=bound, extra={"log_domain": log_domain})
