"""PathCond by projected Newton-CG on z (docs/math.md §7), from a coarse start.

Over the distinct unit pairs k (`unit_pairs`), S(z) = Σ_k P_k e^{z_l - z_e} is
the ENorm criterion E at -z, so F(z) = n log S(z) + A·z reads its sums and
Hessian-vector products from the pairs' Laplacian (`pair_laplacian`: a few
mat-vecs with the static mass matrix per point, no per-pair work). With
q_k = P_k e^{z_l - z_e} / S,

    ∇F = n (out - in) + A,     ∇²F = n (L_q - c cᵀ),     c = out - in,

where out_h / in_h are the shares of S leaving / entering unit h and L_q is
the Laplacian of the unit graph weighted by q. F is smooth and convex.

1. Coarse start (`coarse_start`): with the units grouped by layer, F over one
   shift per group is solved exactly (a dense problem of the number of layers);
   at initialisation most of F's decrease is there.
2. Projected Newton-CG: each iteration solves ∇²F d = -∇F by conjugate
   gradients preconditioned by the diagonal plus the coarse space's correction
   (`pathir.pairs.coarse`: the slow, layer-wide modes in one small solve),
   to a relative accuracy min(0.1, sqrt(‖∇F‖ / ‖∇F₀‖)) (superlinear near z*);
   the step is taken with a backtracking (Armijo) line search, projected on the
   box |z_h| <= M when ``max_log_scale`` M is finite: units at the bound whose
   gradient pushes outward are held there (projected Newton, Bertsekas 1982).
   A Levenberg-Marquardt damping of the diagonal, raised where steps are cut,
   keeps the iteration safe far from z*, where F is nearly piecewise linear.

It stops when the Newton decrement -∇F·d falls below ``tol`` relative to F's
size, and the result meets the first-order (KKT) condition: ∇F ≈ 0 on the
free units (each unit's in- and outflow equal to ``BALANCED``, or to
``SETTLED`` where the last full step moved F by at most ``tol``, or no step
moves z), and ∇F points into the box at the bound. CG is asked for at most
``RTOL_FLOOR`` relative accuracy per step: near z* that still gains three
digits per Newton step, at a third of the products.
"""

from __future__ import annotations

import math
import time

import numpy as np

from pathir.analyses.unit_rows import keys_for
from pathir.errors import ArgumentError
from pathir.pairs.coarse import CoarseSpace
from pathir.pairs.gridded_pairs import GriddedPairs
from pathir.pairs.pair_laplacian import PairLaplacian
from pathir.pairs.unit_pairs import group_pairs
from pathir.pathcond.block import block_sweeps, pair_state
from pathir.pathcond.coarse_start import coarse_shift
from pathir.pathcond.objective import PathCondResult, as_g, finish
from pathir.support.threads import one_blas_thread

__all__ = ["solve_newton"]

_EPS = float(np.finfo(np.float64).eps)
#: CG's relative accuracy per Newton step is never asked below this (near z* the sqrt rule asks ~1e-8 and
#: CG runs 10-20 products for it; from 1e-3 on each Newton step still gains three digits, at 3-8 products)
RTOL_FLOOR = 1e-3
#: the relative imbalance |∂F/∂z_h| / (n(out_h + in_h) + |A_h|) at which a point is z* to float64's
#: resolution: Newton stops there (after a full step whose decrement was below tol)
BALANCED = 1e-12
#: ... or to this, once a full step moved F by at most ``tol`` relative (the next Newton step would move F by
#: rounding only; on the zoo it saves the last step, 10-25 Hessian products, F unchanged to 1e-14)
SETTLED = 1e-9


def _kkt(grad: np.ndarray, z: np.ndarray, bound: float, live: np.ndarray, scale=None) -> float:
    """max |projected gradient| over the live units (one held at the bound by a gradient pushing outward: 0),
    each divided by ``scale`` where given (the terms ∂F/∂z_h balances: the relative imbalance)."""
    held = ((z <= -bound) & (grad > 0)) | ((z >= bound) & (grad < 0)) | ~live
    top = np.abs(np.where(held, 0.0, grad))
    if scale is not None:
        top /= np.maximum(scale, 1e-300)
    return float(np.max(top, initial=0.0))


class _State:
    """F, ∇F and the Hessian operator at z, from the pairs' Laplacian at -z (module docstring);
    shares (out, in, c) and the Hessian are over S, i.e. of log S."""

    def __init__(self, lap: PairLaplacian, A: np.ndarray, n: int, z: np.ndarray):
        self.z = z
        self.point = point = lap.point(-z, both=True)
        total = point.total
        self.out, self.inn = point.out / total, point.inc / total
        self.c = self.out - self.inn
        self.f = n * point.log_e + float(A @ z)
        self.grad = n * self.c + A

    def laplacian_diag(self) -> np.ndarray:
        """L_q's diagonal without the pairs that enter and leave one unit (they cancel in L_q)."""
        return self.point.diag() / self.point.total

    def laplacian_times(self, d: np.ndarray) -> np.ndarray:
        return self.point.hessian_times(d) / self.point.total


def _newton_direction(state: _State, free: np.ndarray, n: int, damping: float, rtol: float, max_cg: int,
                      coarse: CoarseSpace | None) -> tuple[np.ndarray, int]:
    """d solving (L_q - c cᵀ + damping·diag(L_q)) d = -∇F / n on the free units (0 elsewhere) by CG,
    preconditioned by the diagonal and, with ``coarse``, the coarse correction; it stops when the
    preconditioned residual is ``rtol`` times the right-hand side's."""
    diag = state.laplacian_diag()
    mask = free.astype(np.float64)
    scale = np.maximum(np.where(free, diag, 1.0), 1e-300)
    jacobi = mask / ((1.0 + damping) * scale)
    c = state.c * mask

    def hv(v):
        return (state.laplacian_times(v) + damping * diag * v - c * float(c @ v)) * mask

    precondition = None
    if coarse is not None:
        table = coarse.aggregate(state.point, free) / state.point.total
        precondition = coarse.preconditioner(table, coarse.restrict(state.out + state.inn + damping * diag, free),
                                             c, free, jacobi)
    if precondition is None:
        def precondition(r):
            return jacobi * r

    b = -state.grad * mask / n
    d = np.zeros_like(b)
    r = b.copy()
    s = precondition(r)
    rs = float(r @ s)
    target = rtol * math.sqrt(max(rs, 0.0))
    p = s.copy()
    count = 0
    while count < max_cg and rs > 0:
        count += 1
        hp = hv(p)
        curvature = float(p @ hp)
        if not curvature > 0:
            break
        alpha = rs / curvature
        d += alpha * p
        r -= alpha * hp
        s = precondition(r)
        rs_new = float(r @ s)
        if math.sqrt(max(rs_new, 0.0)) <= target:
            break
        p = s + (rs_new / rs) * p
        rs = rs_new
    if not float(state.grad @ d) < 0:  # CG broke down (rounding on a near-singular system): scaled steepest descent
        d = -state.grad * jacobi / n
    return d, count


def solve_newton(g, B, *, max_sweeps: int = 1000, tol: float = 1e-10, row_key=None,
                 max_log_scale: float = math.inf, warm_sweeps: int = 0, max_cg: int = 200,
                 callback=None, pairs=None, groups=None) -> PathCondResult:
    """Minimise F by projected Newton-CG from a coarse start (the fastest exact solver on deep graphs).

    Parameters
    ----------
    g : (n,) array, diag G, non-negative.
    B : (n, H) sparse matrix with entries in {-1, 0, +1}, at most one of each sign per row; or None
        where ``row_key`` is a `unit_rows.RowKeys`.
    max_sweeps : steps at most: the coarse start (one), block sweeps and Newton iterations.
    tol : the block sweeps stop as in `solve_block`; Newton stops when the decrement -∇F·d is at
        most ``tol * max(1, |F|, |A·z|)`` (A = -Bᵀ1).
    row_key : B's row keys (`unit_rows.keys_for`), as ``Compiled.row_keys()`` gives them.
    max_log_scale : bound M on every |z_h| (``math.inf``: unconstrained); the problem stays convex.
    warm_sweeps : exact block sweeps (`block.block_sweeps`) after the coarse start, before Newton.
    max_cg : CG iterations per Newton step at most.
    callback : called as ``callback(step, F)`` after the coarse start, each sweep and each Newton iteration.
    pairs : g already grouped by unit pair (`unit_pairs.group_compact` over ``row_key``); g may then be None.
        A `GriddedPairs` keeps its dense layers' grids factored through the coarse start and Newton
        (materialised for ``warm_sweeps``).
    groups : (H,) group of each unit (`pathir.pairs.coarse.unit_groups`: by layer) for the coarse
        start and the coarse correction of CG; None: neither (diagonal preconditioning only).

    Returns
    -------
    PathCondResult (``method == "newton"``; ``extra``: ``coarse_groups``, ``block_sweeps``,
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

    # the mat-vecs are memory-bound: more BLAS threads gain nothing (`pathir.enorm.newton`)
    with one_blas_thread():
        return _solve(g, B, max_sweeps=max_sweeps, tol=tol, row_key=row_key, max_log_scale=max_log_scale,
                      warm_sweeps=warm_sweeps, max_cg=max_cg, callback=callback, pairs=pairs, groups=groups)


def _coarse_start(lap, coarse: CoarseSpace, A: np.ndarray, n: int, here: _State, live: np.ndarray,
                  bound: float) -> _State:
    """``here`` moved by the best shift per group (`coarse_start`), if that lowers F."""
    z = here.z
    table = coarse.aggregate(here.point) / here.point.total  # degenerate units are in no pair: no mask needed
    lo = np.full(coarse.m, -math.inf)
    hi = np.full(coarse.m, math.inf)
    if bound < math.inf:
        g = np.where(live, coarse.groups, coarse.m)
        low, high = np.full(coarse.m + 1, math.inf), np.full(coarse.m + 1, -math.inf)
        np.minimum.at(low, g, z)
        np.maximum.at(high, g, z)
        lo, hi = -bound - low[:coarse.m], bound - high[:coarse.m]
    w, drop = coarse_shift(table, coarse.restrict(A, live), n, lo, hi)
    if not drop < 0:
        return here
    shifted = np.clip(z + np.where(live, w[coarse.groups], 0.0), -bound, bound)
    there = _State(lap, A, n, shifted)
    return there if there.f < here.f else here


def _materialised(pairs):
    return pairs.materialise() if isinstance(pairs, GriddedPairs) else pairs


def _solve(g, B, *, max_sweeps, tol, row_key, max_log_scale, warm_sweeps, max_cg, callback, pairs,
           groups) -> PathCondResult:
    start = time.perf_counter()
    B, key, H, A = keys_for(B, row_key)
    n = key.size
    A = A.astype(np.float64)
    bound = float(max_log_scale)
    if not bound >= 0:
        raise ArgumentError(f"max_log_scale must be >= 0 (math.inf: unbounded), got {max_log_scale}")
    if pairs is None:
        g = as_g(g, n)
        pairs = group_pairs(g, key, H)
    if warm_sweeps and isinstance(pairs, GriddedPairs):
        pairs = pairs.materialise()  # the block sweeps read the pairs one by one
    degenerate = pairs.degenerate()
    pairs = pairs.freeze(degenerate)
    live = np.ones(H, dtype=bool)
    live[degenerate] = False
    z = np.zeros(H)
    coarse = None if groups is None or not pairs.size else CoarseSpace(groups, H)
    lap = None if not (pairs.size and live.any()) else (
        pairs.laplacian() if isinstance(pairs, GriddedPairs) else PairLaplacian(pairs))
    iterations = cg_total = sweeps = 0
    converged = lap is None
    extra = {"coarse_groups": 0 if coarse is None else coarse.m}
    here = None if lap is None else _State(lap, A, n, z)
    history = [pair_state(_materialised(pairs), A, z, n)[0] if here is None else here.f]
    times = [time.perf_counter() - start]
    coarse_steps = 0
    if coarse is not None and here is not None:  # one step: the coarse start
        here = _coarse_start(lap, coarse, A, n, here, live, bound)
        z, coarse_steps = here.z, 1
        history.append(here.f)
        times.append(time.perf_counter() - start)
        if callback is not None:
            callback(1, here.f)
    if warm_sweeps and here is not None:
        z, converged, sweeps, sweep_extra = block_sweeps(pairs, A, n, live, z, min(warm_sweeps, max_sweeps), tol,
                                                         history, times, start, bound=bound, callback=callback)
        extra.update(sweep_extra)
        pairs.drop_leave_order()  # the sweeps' (leave, enter) order: Newton reads the pairs as they are
        here = _State(lap, A, n, z)
    if not converged:
        damping = 1e-3  # Levenberg-Marquardt: far from z*, F is nearly piecewise linear and raw Newton steps overshoot
        kkt = _kkt(here.grad, z, bound, live)
        first_residual = None
        radius = 8.0  # trust radius on max_h |Δz_h| (nats per iteration), grown while whole capped steps succeed
        while coarse_steps + sweeps + iterations < max_sweeps:
            grad = here.grad
            free = live & ~((z <= -bound) & (grad > 0)) & ~((z >= bound) & (grad < 0))
            diag = here.laplacian_diag()
            residual = float(np.linalg.norm(grad * free / np.sqrt(np.maximum(np.where(free, diag, 1.0), 1e-300)))) / n
            first_residual = first_residual or residual
            rtol = max(RTOL_FLOOR, min(0.1, math.sqrt(residual / first_residual))) if first_residual > 0 else 0.1
            d, k = _newton_direction(here, free, n, damping, rtol, max_cg, coarse)
            cg_total += k
            iterations += 1
            f = here.f
            size = max(1.0, abs(f), abs(float(A @ z)))
            decrement = -float(grad @ d)
            small = decrement <= tol * size
            if small and damping > 0.0:
                damping = 0.0  # the damped model sees no decrease: judge by the true Newton step
                continue
            longest = float(np.max(np.abs(d), initial=0.0))
            capped = longest > radius
            if capped:  # where L_q is nearly 0 (F nearly linear) the Newton step is unbounded: cut to the radius
                d = d * (radius / longest)
            step, moved = 1.0, False
            for _ in range(40):  # Armijo along the projected path
                there = _State(lap, A, n, np.clip(z + step * d, -bound, bound))
                kkt_new = _kkt(there.grad, there.z, bound, live)
                if there.f <= f + 1e-4 * float(grad @ (there.z - z)):
                    moved = True
                    break
                if step == 1.0 and there.f <= f + 8 * _EPS * size and kkt_new < kkt:
                    moved = True  # F is flat to rounding here: the Newton step is judged by the gradient it leaves
                    break
                step *= 0.5
            if not moved:
                if damping < 1e8 and not small:  # a poor direction (ill-conditioned system): damp and retry
                    damping = max(damping, 1e-3) * 16.0
                    continue
                converged = small  # no float64-visible decrease left
                break
            radius = radius * 4.0 if step == 1.0 and capped else max(radius * step, 1.0) if step < 1.0 else radius
            # full steps: trust the quadratic model more; cut steps: less
            damping = 0.0 if step == 1.0 and damping < 1e-4 else damping * 0.25 if step == 1.0 else max(damping, 1e-3) * 4.0
            moved_by = float(np.max(np.abs(there.z - z), initial=0.0))
            progress = kkt_new < 0.5 * kkt
            here, z, kkt = there, there.z, kkt_new
            history.append(here.f)
            times.append(time.perf_counter() - start)
            if callback is not None:
                callback(len(history) - 1, here.f)
            imbalance = _kkt(here.grad, z, bound, live, n * (here.out + here.inn) + np.abs(A)) if step == 1.0 else 1.0
            settled = imbalance <= BALANCED or (imbalance <= SETTLED and f - here.f <= tol * size)
            if small and (moved_by <= tol or not progress or settled):
                # at z* to float64's resolution: every free unit's in- and outflow equal to BALANCED, or to SETTLED
                # once a full step moved F by no more than tol
                converged = True
                break
    at_bound = np.flatnonzero(live & (np.abs(z) >= bound)).tolist() if bound < math.inf else []
    if here is None or here.z is not z:
        state = pair_state(_materialised(pairs), A, z, n)
    else:  # F(0), F(z), ∇F(z) and its scale n|B|ᵀp + |A| from the points already evaluated
        state = (history[0], here.f, here.grad, n * (here.out + here.inn) + np.abs(A))
    return finish(g, B, z, state, method="newton", sweeps=coarse_steps + sweeps + iterations,
                  converged=converged, key=key, degenerate=degenerate, start=start, history=history, times=times,
                  bound=bound, extra={**extra, "block_sweeps": sweeps, "newton_iterations": iterations,
                                      "cg_iterations": cg_total, "pairs": pairs.size, "at_bound": at_bound})
