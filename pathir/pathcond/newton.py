"""PathCond by projected Newton-CG on z (docs/math.md §7), warm-started by block sweeps.

Over the distinct unit pairs k (`unit_pairs`), with q_k = P_k e^{z_l - z_e} / S,

    ∇F = n (out - in) + A,     ∇²F = n (L_q - c cᵀ),     c = out - in,

where out_h / in_h are the shares of S leaving / entering unit h and L_q is
the Laplacian of the unit graph weighted by q (pairs with one end on "no unit"
only add to its diagonal out + in). F is F(z) = n log S(z) + A·z, smooth and
convex: Newton converges quadratically once close, where block sweeps (a
non-linear Gauss-Seidel) and L-BFGS crawl on deep, concatenation-heavy graphs.

Each iteration solves ∇²F d = -∇F by conjugate gradients preconditioned with the
diagonal out + in; L_q is assembled as a sparse H x H matrix on a pattern fixed
once, so a CG step is one sparse mat-vec over the unit pairs. The step is taken
with a backtracking (Armijo) line search, projected on the box |z_h| <= M when
``max_log_scale`` M is finite: units at the bound whose gradient pushes outward
are held there (projected Newton, Bertsekas 1982), the rest take the Newton
step. It stops when the Newton decrement -∇F·d falls below ``tol`` relative to
F's size, and the result meets the first-order (KKT) condition: ∇F ≈ 0 on the
free units, and ∇F points into the box at the bound.
"""

from __future__ import annotations

import math
import time

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spl

from pathir.pathcond.block import block_sweeps, pair_state
from pathir.pathcond.objective import PathCondResult, as_g, finish
from pathir.rescaling.unit_pairs import group_pairs, pad, pair_terms
from pathir.rescaling.unit_rows import keys_for
from pathir.sorted_unique import sorted_unique

__all__ = ["solve_newton"]

_EPS = float(np.finfo(np.float64).eps)


def _kkt(grad: np.ndarray, z: np.ndarray, bound: float, live: np.ndarray) -> float:
    """max |projected gradient| over the live units (one held at the bound by a gradient pushing outward: 0)."""
    held = ((z <= -bound) & (grad > 0)) | ((z >= bound) & (grad < 0)) | ~live
    return float(np.max(np.abs(np.where(held, 0.0, grad)), initial=0.0))


class _Curvature:
    """F, ∇F and the Hessian operator at z from the unit pairs (module docstring)."""

    def __init__(self, pairs, A: np.ndarray, n: int):
        self.pairs, self.A, self.n, H = pairs, A, n, A.size
        e, l = pairs.enter, pairs.leave
        inner = np.flatnonzero((e < H) & (l < H))
        # each unit-unit pair is two symmetric off-diagonal entries; pairs (a, b) and (b, a) share one
        cell = np.concatenate([e[inner] * H + l[inner], l[inner] * H + e[inner]])
        cells, self.slot = sorted_unique(cell, return_inverse=True)
        del cell
        self.inner = inner  # slot[k] and slot[inner.size + k] are the two cells of pair inner[k]
        rows = cells // H
        self.indices = (cells % H).astype(np.int32 if H < 2**31 else np.int64)
        self.indptr = np.searchsorted(rows, np.arange(H + 1))
        self.num_cells = cells.size

    def value(self, z: np.ndarray):
        """(F, ∇F, q, c = out - in, out + in) at z."""
        H, pairs = self.A.size, self.pairs
        top, t = pair_terms(pairs, pad(z))
        total = float(t.sum())
        q = t / total
        out = np.bincount(pairs.leave, weights=q, minlength=H + 1)[:H]
        inn = np.bincount(pairs.enter, weights=q, minlength=H + 1)[:H]
        f = self.n * (top + math.log(total)) + float(self.A @ z)
        return f, self.n * (out - inn) + self.A, q, out - inn, out + inn

    def laplacian(self, q: np.ndarray) -> sp.csr_array:
        """The off-diagonal part of L_q: -q on each unit-unit pair, both ways."""
        k, w = self.inner.size, q[self.inner]
        # each cell gets at most one term from each half (the pairs are distinct): the sums of one bincount
        data = np.bincount(self.slot[:k], weights=w, minlength=self.num_cells)
        data += np.bincount(self.slot[k:], weights=w, minlength=self.num_cells)
        data = np.negative(data, out=data)
        H = self.A.size
        return sp.csr_array((data, self.indices, self.indptr), shape=(H, H))


def _newton_direction(off: sp.csr_array, diag: np.ndarray, c: np.ndarray, grad: np.ndarray, free: np.ndarray,
                      n: int, max_cg: int, damping: float) -> tuple[np.ndarray, int]:
    """d solving (L_q - c cᵀ + damping·diag(L_q)) d = -∇F / n on the free units (0 elsewhere), by
    Jacobi-preconditioned CG with the Eisenstat-Walker forcing term min(1/2, sqrt(‖r‖)) (superlinear
    near z*, where the damping has gone to 0)."""
    H = diag.size
    mask = free.astype(np.float64)
    scale = np.where(free, diag, 1.0)
    scale = np.maximum(scale, 1e-300)
    cf = c * mask

    def hv(v):
        v = v * mask
        return (off @ v) * mask + (1.0 + damping) * diag * v - cf * float(cf @ v) + (1.0 - mask) * v

    b = -grad * mask / n
    residual = float(np.linalg.norm(b / np.sqrt(scale)))
    count = [0]

    def tick(_):
        count[0] += 1

    op = spl.LinearOperator((H, H), matvec=hv, dtype=np.float64)
    pre = spl.LinearOperator((H, H), matvec=lambda v: v / ((1.0 + damping) * scale), dtype=np.float64)
    d, _ = spl.cg(op, b, M=pre, rtol=min(0.5, math.sqrt(residual)), atol=0.0, maxiter=max_cg, callback=tick)
    d = d * mask
    if not float(grad @ d) < 0:  # CG broke down (rounding on a near-singular system): steepest descent
        d = -grad * mask / (n * scale)
    return d, count[0]


def solve_newton(g, B, *, max_sweeps: int = 1000, tol: float = 1e-10, row_key=None,
                 max_log_scale: float = math.inf, warm_sweeps: int = 10, max_cg: int = 200,
                 callback=None, pairs=None) -> PathCondResult:
    """Minimise F by block sweeps, then projected Newton-CG (the fastest exact solver on deep graphs).

    Parameters
    ----------
    g : (n,) array, diag G, non-negative.
    B : (n, H) sparse matrix with entries in {-1, 0, +1}, at most one of each sign per row; or None
        where ``row_key`` is a `unit_rows.RowKeys`.
    max_sweeps : block sweeps plus Newton iterations at most.
    tol : the block sweeps stop as in `solve_block`; Newton stops when the decrement -∇F·d is at
        most ``tol * max(1, |F|, |A·z|)`` (A = -Bᵀ1).
    row_key : B's row keys (`unit_rows.keys_for`), as ``Compiled.row_keys()`` gives them.
    max_log_scale : bound M on every |z_h| (``math.inf``: unconstrained); the problem stays convex.
    warm_sweeps : block sweeps first (they converge outright on layered networks).
    max_cg : CG iterations per Newton step at most.
    callback : called as ``callback(step, F)`` after each sweep and each Newton iteration.
    pairs : g already grouped by unit pair (`unit_pairs.group_compact` over ``row_key``); g may then be None.

    Returns
    -------
    PathCondResult (``method == "newton"``; ``extra``: ``colours``, ``block_sweeps``,
    ``newton_iterations``, ``cg_iterations``, ``at_bound`` (units with |z_h| = M)).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> B = sp.csr_array(np.array([[-1, 0], [0, -1], [1, 0], [0, 1]], dtype=float))
    >>> r = solve_newton(np.array([1.0, 1.0, 4.0, 9.0]), B)
    >>> np.round(r.z, 6).tolist(), r.converged
    ([-0.693147, -1.098612], True)
    >>> r = solve_newton(np.array([1.0, 1.0, 4.0, 9.0]), B, max_log_scale=0.8)   # z_1 stops at the bound
    >>> np.round(r.z, 6).tolist(), r.extra["at_bound"]
    ([-0.693147, -0.8], [1])
    """
    start = time.perf_counter()
    B, key, H, A = keys_for(B, row_key)
    n = key.size
    A = A.astype(np.float64)
    bound = float(max_log_scale)
    if not bound >= 0:
        raise ValueError(f"max_log_scale must be >= 0 (math.inf: unbounded), got {max_log_scale}")
    if pairs is None:
        g = as_g(g, n)
        pairs = group_pairs(g, key, H)
    degenerate = pairs.degenerate()
    pairs = pairs.freeze(degenerate)
    live = np.ones(H, dtype=bool)
    live[degenerate] = False
    z = np.zeros(H)
    history, times = [pair_state(pairs, A, z, n)[0]], [time.perf_counter() - start]
    z, converged, sweeps, extra = block_sweeps(pairs, A, n, live, z, min(warm_sweeps, max_sweeps), tol, history,
                                               times, start, bound=bound, callback=callback)
    iterations = cg_total = 0
    pairs.drop_leave_order()  # the sweeps' (leave, enter) order: Newton reads the pairs as they are
    if not converged and pairs.size and live.any():
        curvature = _Curvature(pairs, A, n)
        f, grad, q, c, mass = curvature.value(z)
        damping = 1.0  # Levenberg-Marquardt: far from z*, F is nearly piecewise linear and raw Newton steps overshoot
        kkt = _kkt(grad, z, bound, live)
        while sweeps + iterations < max_sweeps:
            free = live & ~((z <= -bound) & (grad > 0)) & ~((z >= bound) & (grad < 0))
            d, k = _newton_direction(curvature.laplacian(q), mass, c, grad, free, n, max_cg, damping)
            cg_total += k
            iterations += 1
            size = max(1.0, abs(f), abs(float(A @ z)))
            decrement = -float(grad @ d)
            small = decrement <= tol * size
            if small and damping > 0.0:
                damping = 0.0  # the damped model sees no decrease: judge by the true Newton step
                continue
            step, moved = 1.0, False
            for _ in range(40):  # Armijo along the projected path
                trial = np.clip(z + step * d, -bound, bound)
                f_new, *rest = curvature.value(trial)
                kkt_new = _kkt(rest[0], trial, bound, live)
                if f_new <= f + 1e-4 * float(grad @ (trial - z)):
                    moved = True
                    break
                if step == 1.0 and f_new <= f + 8 * _EPS * size and kkt_new < kkt:
                    moved = True  # F is flat to rounding here: the Newton step is judged by the gradient it leaves
                    break
                step *= 0.5
            if not moved:
                if damping < 1e8 and not small:  # a poor direction (ill-conditioned system): damp and retry
                    damping = max(damping, 1e-3) * 16.0
                    continue
                converged = small  # no float64-visible decrease left
                break
            # full steps: trust the quadratic model more; cut steps: less
            damping = 0.0 if step == 1.0 and damping < 1e-4 else damping * 0.25 if step == 1.0 else max(damping, 1e-3) * 4.0
            moved_by = float(np.max(np.abs(trial - z), initial=0.0))
            progress = kkt_new < 0.5 * kkt
            z, f, kkt, (grad, q, c, mass) = trial, f_new, kkt_new, rest
            history.append(f)
            times.append(time.perf_counter() - start)
            if callback is not None:
                callback(len(history) - 1, f)
            if small and (moved_by <= tol or not progress):  # at z* to float64's resolution
                converged = True
                break
    at_bound = np.flatnonzero(live & (np.abs(z) >= bound)).tolist() if bound < math.inf else []
    return finish(g, B, z, pair_state(pairs, A, z, n), method="newton", sweeps=sweeps + iterations,
                  converged=converged, key=key, degenerate=degenerate, start=start, history=history, times=times,
                  bound=bound, extra={**extra, "block_sweeps": sweeps, "newton_iterations": iterations, "cg_iterations": cg_total,
                         "pairs": pairs.size, "at_bound": at_bound})
