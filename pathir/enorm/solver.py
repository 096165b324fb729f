"""ENorm (Stock et al. 2019, docs/math.md §8) on arrays.

With w = θ² (n,), optional costs c (n,) and the unit incidence matrix B, the
rescaled squared parameters are w_i e^{-(Bz)_i} (θ_i ← θ_i e^{-(Bz)_i/2}, as
for PathCond) and ENorm minimises the convex criterion

    E(z) = Σ_i c_i w_i e^{-(Bz)_i}.

For one unit, with O_h (I_h) the current cost-weighted mass of its outgoing
(incoming) rows, E = O_h e^{-t} + I_h e^{t} + rest along z_h ← z_h + t, so the
exact update is t = ½ log(O_h / I_h): afterwards both sides weigh sqrt(O_h I_h)
(the fixed point balances every unit). Units that share no row do not interact
at all, so a block (independent set) update is the same per-unit update done
for the whole block at once. Units with no mass on one side are degenerate
(E decreases without bound along z_h): kept at 0 and reported.
"""

from __future__ import annotations

import math
import time

import numpy as np

from pathir.analyses.unit_rows import canonical, keys_for
from pathir.enorm.newton import solve_enorm_newton
from pathir.enorm.result import ENormResult, at_bound
from pathir.enorm.result import masses as _masses
from pathir.errors import ArgumentError
from pathir.pairs.log_space import log0, logsumexp
from pathir.pairs.unit_pairs import all_pairs, blocks_of, greedy_coloring, group_pairs, log_pair_total, pad

__all__ = ["ENormResult", "enorm_objective", "unit_balance", "solve_enorm", "solve_enorm_block",
           "solve_enorm_coordinate", "solve_enorm_newton"]


def enorm_objective(w, B, z, c=None) -> float:
    """E(z) = Σ_i c_i w_i e^{-(Bz)_i}.

    >>> import numpy as np, scipy.sparse as sp
    >>> B = sp.csr_array(np.array([[-1.], [1.]]))     # one unit: weight 2 in, weight 8 out
    >>> print(f"{enorm_objective([4.0, 64.0], B, [0.0]):.6g} {enorm_objective([4.0, 64.0], B, [np.log(4)]):.6g}")
    68 32
    """
    B = canonical(B)
    m = _masses(w, c, B.shape[0])
    return math.exp(logsumexp(log0(m) - B @ np.asarray(z, dtype=np.float64)))


def unit_balance(w, B, z, c=None) -> np.ndarray:
    """log(O_h / I_h) per unit at z: the ENorm step each unit would take (nan where a side is empty)."""
    B = canonical(B)
    m = _masses(w, c, B.shape[0])
    u = m * np.exp(-(B @ np.asarray(z, dtype=np.float64)))
    out_mass = B.maximum(0).T @ u
    in_mass = (-B).maximum(0).T @ u
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(out_mass) - np.log(in_mass)


def clamp(z, bound: float | None):
    """z clipped to [-bound, bound] (as is when unbounded)."""
    return z if bound is None else np.clip(z, -bound, bound)


def _finish(m, B, z, degenerate, method, sweeps, converged, start, history, bound=None) -> ENormResult:
    log_m = log0(m)
    e0, e1 = math.exp(logsumexp(log_m)), math.exp(logsumexp(log_m - B @ z))
    balance = unit_balance(m, B, z)
    live = np.ones(z.size, dtype=bool)
    live[degenerate] = False
    history = list(history)
    history[0], history[-1] = e0, e1
    imbalance = float(np.max(np.abs(balance[live]), initial=0.0))
    step = float(np.max(np.abs(clamp(z + 0.5 * balance, bound) - z)[live], initial=0.0))
    return ENormResult(z, e0, e1, sweeps, converged, np.asarray(degenerate, dtype=np.int64),
                       time.perf_counter() - start, np.asarray(history), imbalance, method,
                       at_bound(z, bound), step)


def solve_enorm_coordinate(w, B, c=None, *, max_sweeps: int = 1000, tol: float = 1e-10,
                           row_key=None, max_log_scale: float | None = None, callback=None) -> ENormResult:
    """ENorm one unit at a time, in index order (cyclic coordinate descent on E, in log-space).

    >>> import numpy as np, scipy.sparse as sp
    >>> r = solve_enorm_coordinate([4.0, 64.0], sp.csr_array(np.array([[-1.], [1.]])))
    >>> print(f"{r.z[0]:.6f} {r.e_final:.6g}")
    1.386294 32
    """
    start = time.perf_counter()
    B = canonical(B) if row_key is None else keys_for(B, row_key, balance=False)[0]
    n, H = B.shape
    m = _masses(w, c, n)
    csc = B.tocsc()
    units, degenerate = [], []
    for h in range(H):
        rows, sign = csc.indices[csc.indptr[h]:csc.indptr[h + 1]], csc.data[csc.indptr[h]:csc.indptr[h + 1]]
        rin, rout = rows[sign < 0].astype(np.intp), rows[sign > 0].astype(np.intp)  # intp: no conversion per gather
        if m[rin].any() and m[rout].any():
            units.append((h, rin, rout))
        else:
            degenerate.append(h)
    ell = log0(m)  # log(c w e^{-Bz})
    z = np.zeros(H)
    history = [logsumexp(ell)]
    converged, sweeps = False, 0
    for sweeps in range(1, max_sweeps + 1):
        z_before = z.copy()
        for h, rin, rout in units:
            lo, li = ell[rout], ell[rin]
            step = 0.5 * (logsumexp(lo) - logsumexp(li))
            if max_log_scale is not None:
                step = min(max_log_scale, max(-max_log_scale, z[h] + step)) - z[h]
            ell[rout] = lo - step
            ell[rin] = li + step
            z[h] += step
        history.append(logsumexp(ell))
        if callback is not None:
            callback(sweeps, math.exp(history[-1]))
        if np.max(np.abs(z - z_before), initial=0.0) <= tol:
            converged = True
            break
    return _finish(m, B, z, degenerate, "coordinate", sweeps, converged, start, np.exp(history), max_log_scale)


def solve_enorm_block(w, B, c=None, *, max_sweeps: int = 1000, tol: float = 1e-10,
                      row_key=None, max_log_scale: float | None = None, callback=None) -> ENormResult:
    """ENorm over the colours of the unit adjacency graph, all units of a colour at once.

    >>> import numpy as np, scipy.sparse as sp
    >>> B = sp.csr_array(np.array([[-1, 0], [0, -1], [1, 0], [0, 1]], dtype=float))   # 1-2-1, no biases
    >>> r = solve_enorm_block([1.0, 1.0, 4.0, 9.0], B)
    >>> np.round(r.z, 6).tolist(), f"{r.e_final:.6g}", r.sweeps
    ([0.693147, 1.098612], '10', 2)
    """
    start = time.perf_counter()
    B, key, H, _ = keys_for(B, row_key, balance=False)
    m = _masses(w, c, key.size)
    pairs = group_pairs(m, key, H)
    degenerate = pairs.degenerate()
    pairs = pairs.freeze(degenerate)
    live = np.ones(H, dtype=bool)
    live[degenerate] = False
    blocks = blocks_of(pairs, greedy_coloring(pairs, live))
    everything = all_pairs(pairs)
    z = np.zeros(H)
    # E(z) = Σ_k P_k e^{z_enter - z_leave}: the PathCond pair sum at -z
    history = [log_pair_total(everything, pad(-z))]
    converged, sweeps = False, 0
    for sweeps in range(1, max_sweeps + 1):
        z_before = z.copy()
        for blk in blocks:
            zp = pad(z)
            z[blk.units] = clamp(0.5 * (blk.outgoing(zp) - blk.incoming(-zp)), max_log_scale)
        history.append(log_pair_total(everything, pad(-z)))
        if callback is not None:
            callback(sweeps, math.exp(history[-1]))
        if np.max(np.abs(z - z_before), initial=0.0) <= tol:
            converged = True
            break
    return _finish(m, B, z, degenerate, "block", sweeps, converged, start, np.exp(history), max_log_scale)


def solve_enorm(w, B, c=None, *, method: str = "newton", max_sweeps: int = 1000, tol: float = 1e-10,
                row_key=None, max_log_scale: float | None = None, callback=None) -> ENormResult:
    """Minimise E(z) = Σ c_i w_i e^{-(Bz)_i} over the unit log-scales z.

    Parameters
    ----------
    w : (n,) squared parameters θ², non-negative.
    B : (n, H) sparse unit incidence matrix (entries -1, 0, +1; at most one of each sign per row).
    c : (n,) non-negative costs (Stock et al. weight layers by depth); None for all ones.
    method : "newton" (projected Newton-CG, `pathir.enorm.newton`), "block" (all units of an
        independent set at once) or "coordinate" (one unit at a time); the last two are the reference.
    tol : stop when a sweep moves no z_h by more than ``tol`` (a unit's step is half its log-imbalance);
        Newton stops when no unit's exact update would move it by more than ``tol``.
    max_log_scale : None (unbounded) or L ≥ 0: minimise over the box |z_h| ≤ L (every unit's exact
        update is clamped to it; ``result.at_bound`` lists the units that end on it).
    callback : called as ``callback(sweep, E)`` after every sweep (Newton: iteration).
    row_key : optional row keys of B, as ``Compiled.row_keys()`` builds them (`unit_rows.keys_for`).

    Returns
    -------
    ENormResult; θ rescales as θ_i e^{-(Bz)_i/2}.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> B = sp.csr_array(np.array([[-1.], [1.]]))
    >>> r = solve_enorm(np.array([4.0, 64.0]), B)
    >>> print(f"{r.e_initial:.6g} -> {r.e_final:.6g}", r.converged)
    68 -> 32 True
    """
    solvers = {"newton": solve_enorm_newton, "block": solve_enorm_block, "coordinate": solve_enorm_coordinate}
    if method not in solvers:
        raise ArgumentError(f"method={method!r}: unknown ENorm method (solver= of cm.enorm); choose one of {sorted(solvers)}")
    if max_log_scale is not None and not max_log_scale >= 0:
        raise ArgumentError(f"max_log_scale must be >= 0 or None, got {max_log_scale}")
    return solvers[method](w, B, c, max_sweeps=max_sweeps, tol=tol, row_key=row_key, max_log_scale=max_log_scale,
                           callback=callback)
