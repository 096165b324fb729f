"""ENorm by a projected Newton-CG method on the unit pairs (docs/math.md §8).

With the pairs k = (e_k, l_k) of `pathir.pairs.unit_pairs` and their masses
P_k, the criterion is E(z) = Σ_k P_k e^{z_{e_k} - z_{l_k}} (z_H = 0, "no unit").
With t_k = P_k e^{z_e - z_l}, I_h = Σ_{e_k = h} t_k and O_h = Σ_{l_k = h} t_k,

    ∇E = I - O,      ∇²E = Σ_k t_k (u_e - u_l)(u_e - u_l)ᵀ,

a weighted graph Laplacian grounded at "no unit" (diagonal I + O without the
pairs that enter and leave one unit). Each iteration solves ∇²E d = O - I on
the free units by conjugate gradients preconditioned by that diagonal, then
takes the largest step 2^-j along d (projected on the box |z| ≤ L) that lowers
E by Armijo's rule. E is convex, so the iterates converge to its minimiser;
near it the steps are Newton steps (superlinear).

Stopping rule, the reference solvers' own: every unit's exact ENorm update,
clamped to the box, min(L, max(-L, z_h + ½ log(O_h / I_h))) - z_h, is at most
``tol``; it is checked in log space (no mass lost to underflow). Where the
linear-domain sums lose a live unit to underflow, the iteration is a block
sweep of `pathir.enorm.solver` instead (exact in log space).
"""

from __future__ import annotations

import math
import time

import numpy as np

from pathir.analyses.unit_rows import keys_for
from pathir.enorm.result import ENormResult, at_bound, masses
from pathir.errors import ArgumentError
from pathir.pairs.pair_laplacian import TINY, PairLaplacian, PairPoint
from pathir.pairs.unit_pairs import Pairs, blocks_of, greedy_coloring, group_pairs, pad
from pathir.support.threads import one_blas_thread

__all__ = ["solve_enorm_newton", "newton_direction"]

_ARMIJO = 1e-4
# a relative change of E below this is within the rounding of its float64 sum
_RESOLUTION = 1e-12


def newton_direction(point, rhs: np.ndarray, free: np.ndarray, rtol: float,
                     max_iterations: int) -> tuple[np.ndarray, int]:
    """d with ∇²E d ≈ rhs on the ``free`` units (d = 0 elsewhere), by Jacobi-preconditioned CG.

    Stops when every free unit's residual over its diagonal is at most ``rtol`` times the
    largest |rhs_h| / D_h (the per-unit scale of the balance condition). Returns (d, iterations).
    """
    diag = point.diag()
    mask = free.astype(np.float64)
    inv = np.where(free & (diag > 0), 1.0 / np.where(diag > 0, diag, 1.0), 0.0)
    r = rhs * mask
    target = rtol * float(np.max(np.abs(r) * inv, initial=0.0))
    d = np.zeros_like(rhs)
    if not target > 0:
        return d, 0
    s = inv * r
    p = s.copy()
    rs = float(r @ s)
    for it in range(1, max_iterations + 1):
        hp = point.hessian_times(p) * mask
        curvature = float(p @ hp)
        if not curvature > 0:
            return d, it
        alpha = rs / curvature
        d += alpha * p
        r -= alpha * hp
        s = inv * r
        if float(np.max(np.abs(s))) <= target:
            return d, it
        rs_new = float(r @ s)
        p = s + (rs_new / rs) * p
        rs = rs_new
    return d, max_iterations


def armijo_step(lap: PairLaplacian, here: "PairPoint", d: np.ndarray, bound: float | None, live: np.ndarray,
                largest_step: float, max_halvings: int = 40) -> "PairPoint | None":
    """The first z' = clip(z + 2^-j d) with E(z') ≤ E(z) + 1e-4 ∇E·(z' - z); None if none of
    ``max_halvings`` halvings lowers E so. Where the predicted decrease is below float64's
    resolution of E, the full step is taken if it shrinks the largest unit step (``largest_step``)."""
    slope = (here.inc - here.out) / here.total  # ∇E / E
    step = 1.0
    for j in range(max_halvings):
        trial = here.z + step * d
        if bound is not None:
            trial = np.clip(trial, -bound, bound)
        decrease = float(slope @ (trial - here.z))
        if decrease < 0:
            there = lap.point(trial)
            if there.log_e - here.log_e <= math.log1p(max(_ARMIJO * decrease, -0.999)):
                return there
            if j == 0 and -decrease < _RESOLUTION:
                shrinks = float(np.max(np.abs(there.steps(live, bound)[live]), initial=0.0)) < largest_step
                return there if shrinks else None
        step *= 0.5
    return None


class _BlockSweep:
    """One sweep of the block solver (`pathir.enorm.solver.solve_enorm_block`), built on first use."""

    def __init__(self, pairs: Pairs, live: np.ndarray):
        self.blocks = blocks_of(pairs, greedy_coloring(pairs, live))

    def __call__(self, z: np.ndarray, bound: float | None) -> np.ndarray:
        z = z.copy()
        for blk in self.blocks:
            zp = pad(z)
            target = 0.5 * (blk.outgoing(zp) - blk.incoming(-zp))
            z[blk.units] = target if bound is None else np.clip(target, -bound, bound)
        return z


def solve_enorm_newton(w, B, c=None, *, max_sweeps: int = 1000, tol: float = 1e-10, row_key=None,
                       max_log_scale: float | None = None, callback=None, max_cg: int = 500,
                       pairs: Pairs | None = None) -> ENormResult:
    """ENorm by projected Newton-CG (module docstring); ``sweeps`` counts Newton iterations.

    Same arguments and result as `pathir.enorm.solver.solve_enorm_block`, same stopping rule
    (every unit's clamped exact update at most ``tol``), reached in 5-15 iterations on the
    torchvision zoo where the block sweeps need hundreds to thousands (concatenation-heavy graphs).
    ``callback(iteration, E)`` is called after each iteration. ``pairs``: the masses c ⊙ w already
    grouped by unit pair (`pathir.pairs.param_pairs.pairs_from_params`); w, B, c and row_key are then unused.

    >>> import numpy as np, scipy.sparse as sp
    >>> B = sp.csr_array(np.array([[-1, 0], [0, -1], [1, 0], [0, 1]], dtype=float))   # 1-2-1, no biases
    >>> r = solve_enorm_newton([1.0, 1.0, 4.0, 9.0], B)
    >>> np.round(r.z, 6).tolist(), f"{r.e_final:.6g}", r.converged
    ([0.693147, 1.098612], '10', True)
    """

    # the mat-vecs are memory-bound: more BLAS threads gain nothing and, on cores shared with other
    # work, cost up to 5x (resnet50's M @ x and Mᵀ @ y: 26 ms on one thread, 137 ms on two, loaded)
    with one_blas_thread():
        return _solve(w, B, c, max_sweeps=max_sweeps, tol=tol, row_key=row_key, max_log_scale=max_log_scale,
                      callback=callback, max_cg=max_cg, pairs=pairs)


def _solve(w, B, c, *, max_sweeps, tol, row_key, max_log_scale, callback, max_cg, pairs) -> ENormResult:
    start = time.perf_counter()
    if max_log_scale is not None and not max_log_scale >= 0:
        raise ArgumentError(f"max_log_scale must be >= 0 or None, got {max_log_scale}")
    bound = None if max_log_scale is None else float(max_log_scale)
    if pairs is None:
        _, key, H, _ = keys_for(B, row_key, balance=False)
        pairs = group_pairs(masses(w, c, key.size), key, H)
    H = pairs.num_units
    degenerate = pairs.degenerate()
    pairs = pairs.freeze(degenerate)
    live = np.ones(H, dtype=bool)
    live[degenerate] = False
    lap = PairLaplacian(pairs)
    sweep = None
    here = lap.point(np.zeros(H))
    log_e0 = here.log_e
    history = [log_e0]
    converged, iterations = False, 0
    steps = here.steps(live, bound)
    while True:
        largest = float(np.max(np.abs(steps[live]), initial=0.0))
        if largest <= tol:
            converged = True
            break
        if iterations == max_sweeps:
            break
        iterations += 1
        there = None
        diag = here.diag()
        if np.all(diag[live] > TINY):
            grad = here.inc - here.out
            z = here.z
            # bound-active units: at the bound with the descent direction pointing out of the box
            free = live.copy()
            if bound is not None:
                free &= ~(((z >= bound) & (grad < 0)) | ((z <= -bound) & (grad > 0)))
            rel = float(np.max(np.abs(grad[free]) / diag[free], initial=0.0))
            d, _ = newton_direction(here, -grad, free, min(0.1, math.sqrt(rel)), max_cg)
            there = armijo_step(lap, here, d, bound, live, largest)
        if there is None:  # no usable Newton step: one exact block sweep
            if sweep is None:
                sweep = _BlockSweep(pairs, live)
            there = lap.point(sweep(here.z, bound))
        here = there
        history.append(here.log_e)
        if callback is not None:
            callback(iterations, math.exp(here.log_e))
        steps = here.steps(live, bound)
    z = here.z
    step = float(np.max(np.abs(steps[live]), initial=0.0))  # the stopping rule, exact (Point.steps)
    imbalance = 2.0 * float(np.max(np.abs(here.steps(live, None)[live]), initial=0.0))
    return ENormResult(z, math.exp(log_e0), math.exp(here.log_e), iterations, converged,
                       np.asarray(degenerate, dtype=np.int64), time.perf_counter() - start, np.exp(history),
                       imbalance, "newton", at_bound(z, bound), step)
