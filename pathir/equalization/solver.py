"""Minimising an equalization objective over |z_h| ≤ max_log_scale.

The objectives are convex but piecewise linear (maxima). The solver follows the smoothed objective
(each max a log-sum-exp of sharpness p) along increasing p, each stage a bounded L-BFGS (:mod:`pathir.equalization.lbfgs`) started
where the last one stopped. The exact objective is flat along many directions (a channel below its
tensor's range may move freely until it reaches it); a small multiple ``balance`` of the objective at
sharpness ``BALANCE_SHARPNESS`` is added at every stage, which pulls the channels left free toward
balance (on a chain of two layers, toward r¹_h/R¹ = r²_h/R² as in Nagel's closed form), and a tiny ridge
(ridge/2)‖z‖² keeps z = 0 where nothing is seen at all (a tensor scaled as a whole, units no quantized
tensor touches). Every stage's iterate is function-preserving; the last one's convergence is reported.

The range objective is a linear program (one t_T per tensor above every cell's a_rc(z)). Once its
smoothing has reached p = ``LP_FROM`` the LP finishes it by cutting planes: solved on the cells near
each tensor's max, then on those the solution lifts above its t_T too, until none is (that solution
is then the whole LP's optimum), in the ℓ1-nearest point to the smoothed iterate (which carries the
balance term's choice among the optimal points). Where the LP would grow past ``LP_CELLS`` cells, or
move a unit past ``LP_REACH``, the sharp stages run as before. On regnet_x_400mf this takes the range objective from 36 s (stopped at
the iteration limit) to 3.3 s, at its exact optimum.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from pathir.equalization.lbfgs import minimize_box
from pathir.equalization.objective import Objective
from pathir.support.threads import one_blas_thread

__all__ = ["SolveResult", "solve", "SHARPNESS", "exact_range_optimum", "cutting_plane_range_optimum"]

#: the sharpness schedule per objective. ``range`` is piecewise linear: its last stage is within
#: log(#pairs)/p of the exact objective per max, and an exact LP finishes it (from p = LP_FROM on, where
#: cutting planes settle it: the sharper stages are its fallback). ``noise`` and
#: ``path-metric`` are smooth but for the per-tensor max; a max smoothed at p = 32 (within
#: log(#pairs)/32 nats, a few percent of a step) is as good a model of the rounding as the max itself.
#: ``noise`` doubles p from 4 on: each short stage restarts L-BFGS with a preconditioner taken where
#: the last one stopped, where one long stage at p = 32 converged linearly on a stale one (shufflenet_v2
#: 271-328 evaluations -> 188-217, densenet121 seed 3: 304 -> 143, the objective as low or lower;
#: docs/equalize.md). ``path-metric`` measured no better so.
SHARPNESS = {"range": (1.0, 4.0, 16.0, 64.0, 256.0), "noise": (2.0, 4.0, 8.0, 16.0, 32.0),
             "path-metric": (2.0, 8.0, 32.0)}
#: the range objective's smoothing stops once this sharpness is done: its exact optimum (an LP) finishes
#: it, by cutting planes (:func:`cutting_plane_range_optimum`); the sharper stages run only where that fails
LP_FROM = 4.0
#: a cutting-plane round constrains each tensor's cells within this many nats of its max
LP_MARGIN = 0.5
#: cutting planes are given up once the LP holds more cells than this (HiGHS then takes seconds a round:
#: 2.4 s at 67,000 cells on densenet121's 44,576 units, 13 s at 128,000) and the sharp stages run instead
LP_CELLS = 40_000
#: how far (nats) a cutting-plane LP may move a unit from the smoothed iterate; a solution that needs more
#: is left to the sharp stages
LP_REACH = 8.0
#: graphs with at most this many unit-pair cells get the exact LP over all of them after the sharp stages
EXACT_LP_CELLS = 200_000
#: the sharpness of the balance term, and its weight
BALANCE_SHARPNESS, BALANCE = 2.0, 1e-2
#: every objective is a log (nats): a stage stops once its last WINDOW iterations lowered it by less than
#: ATOL each on average (1e-4 nats: 0.0004 dB of the noise it models); the stages before the last, which
#: only carry the iterate toward the last one's basin, at EARLY times that. Ten iterations, not five: a
#: run of short steps (a line search cutting a few in a row) stopped shufflenet_v2's last stage 0.06 nats
#: above the optimum; over ten every measured solve ends within 0.012 nats of it (docs/equalize.md)
ATOL, WINDOW, EARLY = 1e-4, 10, 10.0


@dataclass
class SolveResult:
    """z (one log-scale per unit), the exact objective before (z = 0) and after, iterations per stage,
    whether the last stage met its tolerance, and how many units sit at the bound."""

    z: np.ndarray
    value_before: float
    value_after: float
    iterations: list[int] = field(default_factory=list)
    converged: bool = True
    at_bound: int = 0
    seconds: float = 0.0
    message: str = ""


def solve(objective: Objective, max_log_scale: float = math.inf, sharpness=None, ridge: float = 1e-6,
          balance: float = BALANCE, max_iter: int = 300, tol: float = 1e-7, callback=None,
          lower: np.ndarray | None = None, atol: float = ATOL, window: int = WINDOW) -> SolveResult:
    """Minimise ``objective`` over z with |z_h| ≤ ``max_log_scale`` (and z_h ≥ ``lower[h]``, where
    given); ``callback(stage, value)`` after each stage. The result's z never does worse than z = 0 on
    the exact objective (else z = 0).

    BLAS runs on one thread meanwhile: the solver's vector operations are small, and threaded BLAS
    spins them ten times slower on a busy machine."""

    with one_blas_thread():
        return _solve(objective, max_log_scale, SHARPNESS[objective.kind] if sharpness is None else sharpness,
                      ridge, balance, max_iter, tol, callback, lower, atol, window)


def _solve(objective, max_log_scale, sharpness, ridge, balance, max_iter, tol, callback, lower, atol, window) -> SolveResult:
    start = time.perf_counter()
    H = objective.H
    z = np.zeros(H)
    before = objective.value(z)
    # no unit to move, or no nonzero quantized weight (on any path: no grid, or every term -inf)
    if H == 0 or before == -math.inf or not objective.pairs.grids:
        return SolveResult(z, before, before, seconds=time.perf_counter() - start)
    lo = np.full(H, -float(max_log_scale))
    if lower is not None:
        lo = np.minimum(np.maximum(lo, lower), 0.0)  # z = 0 stays feasible
    hi = np.full(H, float(max_log_scale))
    bounded = bool(np.isfinite(lo).any() or np.isfinite(hi).any())
    iterations, converged, message = [], True, ""
    ranged = objective.kind == "range"  # the others weigh every channel: no balance term
    extra = ((BALANCE_SHARPNESS, balance),) if ranged else ()
    exact = tried = False  # the range objective's LP by cutting planes: solved; attempted (once)
    for stage, p in enumerate(sharpness):
        if exact:
            break
        objective.retain({p, *(q for q, _ in extra)})  # the last stage's cached grids are not read again
        # in y = d ⊙ z, d² the Hessian's diagonal estimate at the stage's start: the units a tensor's range
        # hangs on and the units only the balance term sees get comparable curvature
        d = np.sqrt(objective.curvature(z, p, extra) + ridge)

        # past p = 16 the balance term fades with the smoothing, so the exact objective's optimum is reached
        extra_p = ((BALANCE_SHARPNESS, balance * min(1.0, 16.0 / p)),) if ranged else ()

        def f(y, p=p, d=d, extra_p=extra_p):
            x = y / d
            value, grad = objective.value_and_grad(x, p, extra=extra_p)
            return value + 0.5 * ridge * float(x @ x), (grad + ridge * x) / d

        last = stage == len(sharpness) - 1
        res = minimize_box(f, z * d, lo * d, hi * d, max_iter=max_iter, ftol=tol, atol=atol * (1 if last else EARLY),
                           window=window)
        z = np.clip(np.asarray(res.x, dtype=np.float64) / d, lo, hi)
        iterations.append(res.nit)
        converged, message = bool(res.success), str(res.message)
        if ranged and p >= LP_FROM and not tried:
            tried = True
            polished = cutting_plane_range_optimum(objective, z, lo, hi)
            if polished is not None and objective.value(polished) <= objective.value(z):
                z, exact, converged, message = polished, True, True, "the exact optimum (linear program)"
        if callback is not None:
            callback(stage, objective.value(z))
    if ranged and not exact and objective.pairs.size <= EXACT_LP_CELLS:
        polished = exact_range_optimum(objective, z, lo, hi)
        if polished is not None and objective.value(polished) <= objective.value(z):
            z = polished
    after = objective.value(z)
    if not after <= before:  # the smoothing never makes things worse than doing nothing
        z, after = np.zeros(H), before
    at_bound = int(np.sum((z <= lo + 1e-9 * np.abs(lo)) | (z >= hi - 1e-9 * np.abs(hi)))) if bounded else 0
    return SolveResult(z, before, after, iterations, converged, at_bound, time.perf_counter() - start, message)


def cutting_plane_range_optimum(objective: Objective, z0: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                                margin: float = LP_MARGIN, rounds: int = 50, max_cells: int = LP_CELLS,
                                reach: float = LP_REACH):
    """:func:`exact_range_optimum` over every cell, solved on a few: each tensor's cells within ``margin``
    nats of its max at z0 first, then, round by round, the cells the last solution lifts above its
    tensor's t_T (with their own margin band). A solution that violates no cell's constraint is
    feasible for the whole LP and optimal in its relaxation, so it is the whole LP's optimum. None
    where an LP fails, or ``rounds`` do not settle it, or one LP would hold more than ``max_cells``
    cells, or all of them together more than four times that."""
    grids = objective.pairs.grids

    def lifted(zp):  # per grid, every cell's log range at z (-inf where the tensor has no such pair)
        return [g.log_max + 0.5 * (zp[g.rows][:, None] - zp[g.cols][None, :]) for g in grids]

    # a box of ±reach around z0 inside the LP: no unit runs to a far bound (or to infinity) before the
    # cells that hold it are cut in; a solution inside it solves the LP without it (a convex problem)
    lo_lp, hi_lp = np.maximum(lo, z0 - reach), np.minimum(hi, z0 + reach)
    cells = [a >= np.max(a) - margin for a in lifted(np.append(z0, 0.0))]
    work = 0  # cells summed over the rounds' LPs: a round costs about its cells (deterministic, unlike a clock)
    for _ in range(rounds):
        held = sum(int(np.count_nonzero(mask)) for mask in cells)
        work += held
        if held > max_cells or work > 4 * max_cells:
            return None
        z = exact_range_optimum(objective, z0, lo_lp, hi_lp, cells)
        if z is None:
            return None
        settled = True
        for mask, a in zip(cells, lifted(np.append(z, 0.0))):
            top = np.max(a)
            if top > np.max(a, where=mask, initial=-np.inf) + 1e-7:  # a cell left out is above t_T: cut
                mask |= a >= top - margin
                settled = False
        if settled:
            inner = ((z > lo_lp + 1e-9) | (lo_lp <= lo)) & ((z < hi_lp - 1e-9) | (hi_lp >= hi))
            return z if inner.all() else None
    return None


def exact_range_optimum(objective: Objective, z0: np.ndarray, lo: np.ndarray, hi: np.ndarray, cells=None,
                        proximity: float = 1e-6):
    """The range objective's exact minimiser nearest z0 (in ℓ1, weight ``proximity``): the LP
    min Σ_T t_T − linear·z + proximity·‖z − z0‖₁ s.t. t_T ≥ log max_(r,c) + (z_r − z_c)/2 for every cell
    (for the cells ``cells[t]`` marks in tensor t's grid, where given), lo ≤ z ≤ hi (HiGHS), in the
    variables z = z0 + u − w, 0 ≤ u ≤ hi − z0, 0 ≤ w ≤ z0 − lo and t (the box and the ℓ1 term need no
    rows of their own). None where the LP solver fails."""
    H, grids = objective.H, objective.pairs.grids
    T = len(grids)
    z0 = np.asarray(z0, dtype=np.float64)
    zp = np.append(z0, 0.0)
    rows, cols, vals, rhs = [], [], [], []
    k = 0
    for t, g in enumerate(grids):
        r_idx, c_idx = np.nonzero(np.isfinite(g.log_max) if cells is None else cells[t])
        n = r_idx.size
        ids = np.arange(k, k + n)
        for units, sign in ((g.rows[r_idx], 0.5), (g.cols[c_idx], -0.5)):
            keep = units < H
            for offset, coefficient in ((0, sign), (H, -sign)):  # u, then w
                rows.append(ids[keep]), cols.append(units[keep] + offset), vals.append(np.full(keep.sum(), coefficient))
        rows.append(ids), cols.append(np.full(n, 2 * H + t)), vals.append(np.full(n, -1.0))
        rhs.append(-g.log_max[r_idx, c_idx] - 0.5 * (zp[g.rows[r_idx]] - zp[g.cols[c_idx]]))
        k += n
    A_ub = sp.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(k, 2 * H + T))
    c = np.concatenate([proximity - objective.linear, proximity + objective.linear, np.ones(T)])
    room = [(0, None if math.isinf(b) else b) for b in np.concatenate([hi - z0, z0 - lo])]
    res = linprog(c, A_ub=A_ub, b_ub=np.concatenate(rhs), bounds=room + [(None, None)] * T, method="highs")
    return z0 + res.x[:H] - res.x[H:2 * H] if res.status == 0 else None
