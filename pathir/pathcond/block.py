"""PathCond by exact block updates over independent sets of units (docs/math.md §7).

Units whose columns of B share no row (no parameter joins them) are minimised
jointly and exactly. For such a block, with S = Σ_i g_i e^{(Bz)_i}, B_h and C_h
the outgoing and incoming sums of unit h with z_h taken out, and D the mass of
the rows touching no unit of the block, stationarity in every z_h reads

    n B_h x_h² + A_h S x_h - n C_h = 0,      x_h = e^{z_h},

so x_h = sqrt(C_h / B_h) y_h(S) in closed form, and B_h x_h + C_h / x_h =
sqrt(A_h² S² / n² + 4 B_h C_h). S is then the root of the scalar equation

    ψ(S) = D + Σ_h sqrt(A_h² S² / n² + 4 B_h C_h) - S = 0.

ψ is convex and decreasing (Σ_h |A_h| < n for non-degenerate units) and
ψ(0) > 0, so Newton's method started left of the root climbs to it
monotonically; a start right of it is pulled back with one Newton step
(convexity puts that step left of the root) clamped at φ(0) = D + Σ sqrt(4 B_h C_h).

Blocks are the colours of a greedy colouring of the unit adjacency graph (two
colours for a layered MLP). A sweep visits every colour once; Anderson
acceleration of the sweep map, kept only where it lowers F below the plain
sweep's, turns its linear convergence into a dozen sweeps on real networks.
The sums run over distinct unit pairs (`unit_pairs`), as sparse mat-vecs in
the linear domain with log-space fallback, so a sweep costs O(#pairs) and g
may span any range.

When g spans hundreds of nats with no network structure behind it, F is
nearly piecewise linear and exact moves along units stall on its ridges (the
published coordinate descent crawls there too); if the sweeps have not
converged after ``polish_after`` of them, L-BFGS on F (pair sums, exact
gradient) finishes the job.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from pathir.analyses.unit_rows import keys_for
from pathir.pairs.unit_pairs import all_pairs, blocks_of, greedy_coloring, group_pairs, log_pair_total, pad, pair_terms
from pathir.pathcond.objective import PathCondResult, as_g, finish, log_positive_root

__all__ = ["solve_block", "pair_value", "pair_state", "block_sweeps"]


def _solve_s(log_b, log_c, log_d, a, log_s_prev):
    """log S solving ψ(S) = 0 (module docstring); ``a`` = |A_h| / n."""
    half = 0.5 * (log_b + log_c)
    shift = max(log_d, float(half.max()) + math.log(2.0))
    c = np.exp(2.0 * (half + math.log(2.0) - shift))
    d = math.exp(log_d - shift)
    a2 = a * a

    def psi(s):
        r = np.sqrt(a2 * s * s + c)
        slope = np.divide(a2 * s, r, out=np.zeros_like(r), where=r > 0)  # r = 0 only where a = c = 0
        return d + float(r.sum()) - s, float(slope.sum()) - 1.0

    floor = d + float(np.sqrt(c).sum())
    s = math.exp(min(log_s_prev - shift, 700.0))
    val, der = psi(s)
    if val < 0:
        s = max(floor, s - val / der)
    for _ in range(200):
        val, der = psi(s)
        step = -val / der
        if not step > 4e-16 * s:
            break
        s += step
    return shift + math.log(s)


def _block_z(log_b, log_c, signed_a, n: int, log_s: float) -> np.ndarray:
    """Each block unit's unconstrained minimiser given log S: z_h = ½ log(C_h / B_h) + log y_h."""
    half = 0.5 * (log_b + log_c)
    return 0.5 * (log_c - log_b) + log_positive_root(signed_a, log_s - half, n, n)


def _solve_s_clamped(log_b, log_c, log_d, signed_a, n: int, bound: float, log_s_prev: float):
    """(log S, z) solving the block's stationarity with every |z_h| <= ``bound`` (module docstring).

    Given S, each unit's restriction of F is convex in z_h, so its box-constrained minimiser is its
    unconstrained one clamped; S then solves ψ(S) = D + Σ_h (B_h e^{z_h(S)} + C_h e^{-z_h(S)}) - S = 0.
    dψ/dS = Σ_free a_h² S / r_h - 1 < 0 (a clamped unit's term no longer moves), so ψ has one root,
    found by Newton's method kept inside a bracket (ψ is no longer convex where units reach the bound).
    """
    a = np.abs(signed_a) / n
    a2 = a * a
    half = 0.5 * (log_b + log_c)
    shift = max(log_d, float(half.max()) + math.log(2.0))
    c = np.exp(2.0 * (half + math.log(2.0) - shift))
    d = math.exp(log_d - shift)
    at_top = np.exp(log_b + bound - shift) + np.exp(log_c - bound - shift)      # B e^{M} + C e^{-M}, scaled
    at_bottom = np.exp(log_b - bound - shift) + np.exp(log_c + bound - shift)   # B e^{-M} + C e^{M}

    def psi(s):
        z = _block_z(log_b, log_c, signed_a, n, shift + math.log(s))
        r = np.sqrt(a2 * s * s + c)
        terms = np.where(z > bound, at_top, np.where(z < -bound, at_bottom, r))
        free = np.abs(z) <= bound
        slope = np.divide(a2 * s, r, out=np.zeros_like(r), where=free & (r > 0))
        return d + float(terms.sum()) - s, float(slope.sum()) - 1.0

    lo, hi = 0.0, math.inf
    s = math.exp(min(log_s_prev - shift, 700.0))
    for _ in range(400):
        val, der = psi(s)
        if val > 0:
            lo = s
        else:
            hi = s
        step = -val / der
        if not abs(step) > 4e-16 * s:
            break
        s_new = s + step
        if not lo < s_new < hi:  # Newton left the bracket: bisect it (geometrically while it is open)
            s_new = 2.0 * lo + 1.0 if hi == math.inf else (0.5 * (lo + hi) if lo > 0 else 0.5 * hi)
        if not lo <= s_new <= hi or s_new == s:
            break
        s = s_new
    log_s = shift + math.log(s)
    return log_s, np.clip(_block_z(log_b, log_c, signed_a, n, log_s), -bound, bound)


def pair_value(pairs, A: np.ndarray, z: np.ndarray, n: int):
    """(F(z), ∇F(z), out, in) from the unit pairs, out/in = each unit's share of S leaving/entering it:
    ∂F/∂z_h = n (out_h - in_h) + A_h."""
    H = z.size
    if pairs.size == 0:
        zero = np.zeros(H)
        return -math.inf, A.copy(), zero, zero
    top, e = pair_terms(pairs, pad(z))
    total = float(e.sum())
    q = e / total
    out_mass = np.bincount(pairs.leave, weights=q, minlength=H + 1)[:H]
    in_mass = np.bincount(pairs.enter, weights=q, minlength=H + 1)[:H]
    return n * (top + math.log(total)) + float(A @ z), n * (out_mass - in_mass) + A, out_mass, in_mass


def pair_state(pairs, A: np.ndarray, z: np.ndarray, n: int):
    """(F(0), F(z), ∇F(z), its scale n|B|ᵀp + |A|) from the unit pairs."""
    f1, grad, out_mass, in_mass = pair_value(pairs, A, z, n)
    f0 = -math.inf
    if pairs.size:  # at z = 0 the terms are the masses
        top, e = (pairs.log_top, pairs.mass) if pairs.mass is not None else pair_terms(pairs, np.zeros(z.size + 1))
        f0 = n * (top + math.log(float(e.sum())))
    return f0, f1, grad, n * (out_mass + in_mass) + np.abs(A)


def _polish(pairs, A: np.ndarray, n: int, z: np.ndarray, live: np.ndarray, iterations: int, tol: float,
            history: list, times: list, start: float, bound: float = math.inf,
            callback=None) -> tuple[np.ndarray, bool, int]:
    """L-BFGS(-B) on F over the live units from z, with |z_h| <= ``bound``: (z, converged, iterations).

    Block sweeps crawl when g spans hundreds of nats: F is then nearly
    piecewise linear and exact moves along units (or blocks) stall on its
    ridges, while a quasi-Newton direction follows the valley.
    """
    from scipy.optimize import minimize

    idx = np.flatnonzero(live)
    full = z.copy()

    def value(x):
        full[idx] = x
        f, grad, _, _ = pair_value(pairs, A, full, n)
        return f, grad[idx]

    def record(intermediate_result):
        history.append(float(intermediate_result.fun))
        times.append(time.perf_counter() - start)
        if callback is not None:
            callback(len(history) - 1, history[-1])

    # no test on the F decrease: L-BFGS's first steps along a ridge gain little; it stops on the
    # gradient or when no step lowers F any more in float64 (an "abnormal" line search)
    box = None if math.isinf(bound) else [(-bound, bound)] * idx.size
    res = minimize(value, np.clip(z[idx], -bound, bound), jac=True, method="L-BFGS-B", callback=record, bounds=box,
                   options={"maxiter": iterations, "ftol": 0.0, "gtol": tol * n, "maxcor": 20})
    out = z.copy()
    out[idx] = res.x
    return out, bool(res.success) or "ABNORMAL" in str(res.message), int(res.get("nit", 0))


@dataclass
class _Point:
    """A point z of the block iteration: log S there, F = n log S + A·z, and the first
    block's sums (log B_h, log C_h, log D) at z (None where there are no blocks)."""

    z: np.ndarray
    log_s: float
    f: float
    first: tuple | None


class _BlockSweeps:
    """One sweep of exact block updates: each colour's units solved jointly and exactly
    (closed form per unit given S, S from a scalar monotone equation), colour after colour."""

    def __init__(self, pairs, blocks, A: np.ndarray, n: int):
        self.pairs, self.blocks, self.A, self.n = pairs, blocks, A, n
        self.abs_a = [np.abs(A[b.units]) / n for b in blocks]

    def sums(self, blk, z):
        zp = pad(z)
        return blk.outgoing(-zp), blk.incoming(zp), blk.rest_log(zp)

    def log_total(self, z, first) -> float:
        """log S at z, from the first block's sums ``first`` = (log B_h, log C_h, log D) at z."""
        if not self.blocks:
            return log_pair_total(all_pairs(self.pairs), pad(z))
        log_b, log_c, log_d = first
        zu = z[self.blocks[0].units]
        terms = np.concatenate((log_b + zu, log_c - zu, [log_d]))
        top = float(terms.max())
        return top + math.log(float(np.exp(terms - top).sum()))

    def state(self, z) -> _Point:
        first = self.sums(self.blocks[0], z) if self.blocks else None
        log_s = self.log_total(z, first)
        return _Point(z, log_s, self.n * log_s + float(self.A @ z), first)

    def sweep(self, z, at: _Point, bound: float = math.inf) -> _Point:
        """The image of ``at`` (the point z) under one sweep, each block solved exactly within
        |z_h| <= ``bound``; its ``first`` is filled in lazily."""
        z, log_s = z.copy(), at.log_s
        for i, (blk, a) in enumerate(zip(self.blocks, self.abs_a)):
            log_b, log_c, log_d = at.first if i == 0 else self.sums(blk, z)
            log_s = _solve_s(log_b, log_c, log_d, a, log_s)
            new = _block_z(log_b, log_c, self.A[blk.units], self.n, log_s)
            if float(np.max(np.abs(new), initial=0.0)) > bound:  # the unconstrained block leaves the box
                log_s, new = _solve_s_clamped(log_b, log_c, log_d, self.A[blk.units], self.n, bound, log_s)
            z[blk.units] = new
        return _Point(z, log_s, self.n * log_s + float(self.A @ z), None)

    def with_first(self, point: _Point) -> _Point:
        if point.first is None and self.blocks:
            point.first = self.sums(self.blocks[0], point.z)
        return point


class _Anderson:
    """Anderson acceleration (type II) of the sweep map with memory ``depth``: the image
    combination whose residual is smallest, kept only where it beats the plain sweep,
    so F still decreases monotonically."""

    def __init__(self, depth: int):
        self.depth, self.accepted = depth, 0
        self.d_res, self.d_img, self.last = [], [], None

    def improve(self, z, image: _Point, sweeps: _BlockSweeps, bound: float = math.inf) -> _Point:
        res = image.z - z
        if self.depth and self.last is not None:
            self.d_res.append(res - self.last[0])
            self.d_img.append(image.z - self.last[1])
            del self.d_res[:-self.depth], self.d_img[:-self.depth]
        self.last = (res, image.z)
        if self.d_res:
            gamma = np.linalg.lstsq(np.column_stack(self.d_res), res, rcond=1e-12)[0]
            trial = sweeps.state(np.clip(image.z - np.column_stack(self.d_img) @ gamma, -bound, bound))
            if trial.f < image.f:
                self.accepted += 1
                return trial
            self.d_res.clear(), self.d_img.clear()
        return sweeps.with_first(image)


def block_sweeps(pairs, A: np.ndarray, n: int, live: np.ndarray, z: np.ndarray, budget: int, tol: float,
                 history: list, times: list, start: float, *, anderson: int = 5, bound: float = math.inf,
                 callback=None) -> tuple[np.ndarray, bool, int, dict]:
    """Up to ``budget`` accelerated block sweeps from z (``pairs`` frozen at the degenerate units, ``live``
    the others): ``(z, converged, sweeps, extra)``; F after each sweep is appended to ``history``.

    With a finite ``bound`` each block is solved exactly on the box |z_h| <= bound (`_solve_s_clamped`),
    so the sweeps still lower F monotonically and their fixed points meet the box's KKT condition.
    """
    sweeps_of = _BlockSweeps(pairs, blocks_of(pairs, greedy_coloring(pairs, live)), A, n)
    state = sweeps_of.state(z)
    acceleration = _Anderson(anderson)
    converged, sweeps, quiet = False, 0, 0
    extra = {"colours": len(sweeps_of.blocks), "anderson_steps": 0}
    for sweeps in range(1, budget + 1):
        image = sweeps_of.sweep(z, state, bound)
        new = acceleration.improve(z, image, sweeps_of, bound)
        step = float(np.max(np.abs(new.z - z), initial=0.0))
        f, (z, state) = state.f, (new.z, new)
        history.append(state.f)
        times.append(time.perf_counter() - start)
        if callback is not None:
            callback(len(history) - 1, state.f)
        size = max(1.0, abs(state.f), abs(float(A @ z)))  # F's rounding follows its largest term
        quiet = quiet + 1 if abs(f - state.f) <= tol * size else 0
        if step <= tol:
            converged = True
            break
        if quiet > anderson:  # F has stopped moving: done if z has too, else it crawls along a ridge
            converged = step <= math.sqrt(tol)
            break
    return z, converged, sweeps, {**extra, "anderson_steps": acceleration.accepted}


def solve_block(g, B, *, max_sweeps: int = 1000, tol: float = 1e-10, anderson: int = 5,
                polish_after: int | None = 50, row_key=None, max_log_scale: float = math.inf,
                callback=None, pairs=None) -> PathCondResult:
    """Minimise F by exact block updates over independent sets of units (the default solver).

    Parameters
    ----------
    g : (n,) array, diag G, non-negative.
    B : (n, H) sparse matrix with entries in {-1, 0, +1}, at most one of each sign per row; or None
        where ``row_key`` is a `unit_rows.RowKeys`, which holds all the solver reads of B.
    max_sweeps : sweeps over all colours at most.
    anderson : memory of the Anderson acceleration of the sweep map (0: plain block sweeps); an
        extrapolated point is taken only where it lowers F below the plain sweep's.
    polish_after : if the sweeps have not converged after this many (or F stopped moving while z
        still does), L-BFGS on F takes over for the rest of ``max_sweeps`` (iterations); None: sweeps only.
    tol : stop when a sweep moves no z_h by more than ``tol``, or when ``anderson + 1`` sweeps in a row
        each change F by at most ``tol * max(1, |F|, |A·z|)`` (A = -Bᵀ1) and the last moved no z_h by
        more than sqrt(tol).
    row_key : optional (n,) int array, e(i) (H + 1) + l(i) per row of B (`unit_rows.matrix_row_keys`), or a
        `unit_rows.RowKeys` with the column balance too, as ``Compiled.row_keys()`` builds them with B:
        spares re-deriving (and re-checking) them from B.
    max_log_scale : bound on every |z_h| (box-constrained F, still convex); where a sweep would cross
        it, L-BFGS-B on the box finishes the job. ``math.inf``: unconstrained.
    callback : called as ``callback(step, F)`` after each sweep or L-BFGS iteration.
    pairs : g already grouped by unit pair (`unit_pairs.group_compact` over ``row_key``); g may then be None.

    Returns
    -------
    PathCondResult (``method == "block"``; ``extra``: number of ``colours`` and ``pairs``, accepted
    ``anderson_steps``, ``lbfgs_iterations``; ``sweeps`` counts both kinds of steps).

    Examples
    --------
    A 1-2-1 network without biases: both hidden units balance their in and out mass.

    >>> import numpy as np, scipy.sparse as sp
    >>> B = sp.csr_array(np.array([[-1, 0], [0, -1], [1, 0], [0, 1]], dtype=float))
    >>> r = solve_block(np.array([1.0, 1.0, 4.0, 9.0]), B)
    >>> np.round(r.z, 6).tolist(), r.extra["colours"]
    ([-0.693147, -1.098612], 1)
    >>> print(f"{r.f_initial:.4f} -> {r.f_final:.4f}")
    10.8322 -> 9.2103
    """
    start = time.perf_counter()
    B, key, H, A = keys_for(B, row_key)
    n = key.size
    A = A.astype(np.float64)
    if pairs is None:
        g = as_g(g, n)
        pairs = group_pairs(g, key, H)
    degenerate = pairs.degenerate()
    pairs = pairs.freeze(degenerate)
    live = np.ones(H, dtype=bool)
    live[degenerate] = False
    z = np.zeros(H)
    history, times = [pair_state(pairs, A, z, n)[0]], [time.perf_counter() - start]
    budget = max_sweeps if polish_after is None else min(max_sweeps, polish_after)
    z, converged, sweeps, extra = block_sweeps(pairs, A, n, live, z, budget, tol, history, times, start,
                                               anderson=anderson, bound=max_log_scale, callback=callback)
    polished = 0
    if not converged and sweeps < max_sweeps and extra["colours"] and (polish_after is not None
                                                                        or max_log_scale < math.inf):
        z, converged, polished = _polish(pairs, A, n, z, live, max_sweeps - sweeps, tol, history, times, start,
                                         max_log_scale, callback)
        sweeps += polished
    return finish(g, B, z, pair_state(pairs, A, z, n), method="block", sweeps=sweeps, converged=converged,
                  key=key, bound=max_log_scale, degenerate=degenerate, start=start, history=history, times=times,
                  extra={**extra, "pairs": pairs.size, "lbfgs_iterations": polished})
