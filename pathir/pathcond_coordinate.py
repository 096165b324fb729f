"""PathCond by cyclic coordinate descent: the published algorithm (MATH.md §7).

One unit at a time, in index order. For unit h, with the others fixed and
x = e^{z_h}, Σ_i g_i e^{(Bz)_i} = B_h x + C_h / x + D_h and the exact minimiser
is the positive root of

    (n + A_h) B_h x² + A_h D_h x + (A_h - n) C_h = 0.

As in the paper, the current vector g ⊙ e^{Bz} and its total S are kept and
updated incrementally: a unit touches only its own rows, so a sweep costs
O(nnz(B)), and D_h = S - (B_h x + C_h / x). S is recomputed exactly after
every sweep. The vector is kept as its log, so g may span any range;
x = sqrt(C_h / B_h) y is solved for y, which stays of order one.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .pathcond_objective import PathCondResult, _as_g, _log, _logsumexp, finish
from .unit_pairs import degenerate_units, row_units, side_counts

__all__ = ["solve_coordinate"]


def _rows_by_unit(unit: np.ndarray, H: int) -> list[np.ndarray]:
    order = np.argsort(unit, kind="stable")
    bounds = np.searchsorted(unit[order], np.arange(H + 1))
    return [order[bounds[h]:bounds[h + 1]] for h in range(H)]


def _log_root(a: int, log_r: float, n: int) -> float:
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


def solve_coordinate(g, B, *, max_sweeps: int = 1000, tol: float = 1e-10) -> PathCondResult:
    """Minimise F by cyclic coordinate descent over the units (the reference solver).

    Parameters
    ----------
    g : (n,) array, diag G, non-negative.
    B : (n, H) sparse matrix with entries in {-1, 0, +1}, at most one of each sign per row.
    max_sweeps : sweeps over all units at most.
    tol : stop when a sweep changes F by at most ``tol * max(1, |F|)`` or moves no z_h by more than ``tol``.

    Returns
    -------
    PathCondResult (``method == "coordinate"``).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> B = sp.csr_array(np.array([[-1.], [1.]]))
    >>> r = solve_coordinate(np.array([1.0, 4.0]), B)
    >>> bool(np.isclose(r.z[0], -np.log(2))), r.sweeps
    (True, 2)
    """
    start = time.perf_counter()
    enter, leave, H = row_units(B)
    n = enter.size
    g = _as_g(g, n)
    A = side_counts(enter, leave, H)
    degenerate = degenerate_units(g > 0, enter, leave, H)
    live = np.ones(H, dtype=bool)
    live[degenerate] = False
    ins, outs = _rows_by_unit(enter, H), _rows_by_unit(leave, H)
    units = [(h, ins[h], outs[h], int(A[h])) for h in np.flatnonzero(live)]

    ell = _log(g)
    z = np.zeros(H)
    log_s = _logsumexp(ell)
    history, times = [n * log_s], [time.perf_counter() - start]
    converged, sweeps = False, 0
    for sweeps in range(1, max_sweeps + 1):
        z_before = z.copy()
        for h, rin, rout, a in units:
            li, lo = ell[rin], ell[rout]
            l_in, l_out = _lse(li), _lse(lo)
            zh = z[h]
            log_b, log_c = l_out - zh, l_in + zh
            l_unit = _logaddexp(l_in, l_out)
            frac = math.exp(l_unit - log_s)
            log_d = log_s + math.log1p(-frac) if frac < 1.0 else -math.inf
            half = 0.5 * (log_b + log_c)
            new = 0.5 * (log_c - log_b) + _log_root(a, log_d - half, n)
            step = new - zh
            ell[rout] = lo + step
            ell[rin] = li - step
            z[h] = new
            log_s = _logaddexp(log_d, _logaddexp(log_b + new, log_c - new))
        log_s = _logsumexp(ell)
        f = n * log_s + float(A @ z)
        history.append(f)
        times.append(time.perf_counter() - start)
        if abs(history[-2] - f) <= tol * max(1.0, abs(f)) or np.max(np.abs(z - z_before), initial=0.0) <= tol:
            converged = True
            break
    return finish(g, enter, leave, A, z, method="coordinate", sweeps=sweeps, converged=converged, degenerate=degenerate,
                  start=start, history=history, times=times)
