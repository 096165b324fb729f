"""PathCond by exact block updates over independent sets of units (MATH.md §7).

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
sweep's, turns its linear convergence into a few dozen sweeps. The sums run over distinct unit pairs
(`unit_pairs`), as sparse mat-vecs in the linear domain with log-space
fallback, so a sweep costs O(#pairs) and g may span any range.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .pathcond_objective import PathCondResult, _as_g, finish, log_positive_root
from .unit_pairs import (
    Pairs, SideSums, degenerate_units, greedy_coloring, group_pairs, pad, row_units, side_counts, side_sums,
)

__all__ = ["solve_block", "Block", "blocks_of"]


@dataclass(frozen=True)
class Block:
    """One independent set of units and the pair sums its update reads.

    ``outgoing(f)[j]`` = log Σ_{pairs leaving units[j]} P_k e^{f[other end]},
    ``incoming(f)[j]`` likewise over the pairs entering units[j]; ``rest`` holds
    the pairs touching no unit of the block, rows = left unit, cols = entered unit.
    """

    units: np.ndarray
    outgoing: SideSums
    incoming: SideSums
    rest: SideSums

    def rest_log(self, z_padded: np.ndarray) -> float:
        """log Σ_{rest pairs} P_k e^{z_leave - z_enter}."""
        return _log_total(self.rest, z_padded)


def blocks_of(pairs: Pairs, colour: np.ndarray) -> list[Block]:
    """The Blocks of a colouring (``colour[h] = -1``: unit not updated)."""
    H = pairs.num_units
    colour_pad = np.append(colour, -1)
    local = np.full(H + 1, -1, dtype=np.int64)
    e_col, l_col = colour_pad[pairs.enter], colour_pad[pairs.leave]
    blocks = []
    for c in range(int(colour.max(initial=-1)) + 1):
        units = np.flatnonzero(colour == c)
        local[:] = -1
        local[units] = np.arange(units.size)
        out_k, in_k = l_col == c, e_col == c
        rest_k = ~(out_k | in_k)
        outgoing = side_sums(local[pairs.leave[out_k]], pairs.enter[out_k], pairs.log_mass[out_k], H + 1)
        incoming = side_sums(local[pairs.enter[in_k]], pairs.leave[in_k], pairs.log_mass[in_k], H + 1)
        rest = side_sums(pairs.leave[rest_k], pairs.enter[rest_k], pairs.log_mass[rest_k], H + 1)
        for side in (outgoing, incoming):
            if side.rows.size != units.size:
                raise ValueError(f"colour {c}: a unit has no mass on one side (it should have been found degenerate)")
        blocks.append(Block(units, outgoing, incoming, rest))
    return blocks


def _solve_s(log_b, log_c, log_d, a, log_s_prev):
    """log S solving ψ(S) = 0 (module docstring); ``a`` = |A_h| / n."""
    half = 0.5 * (log_b + log_c)
    shift = max(log_d, float(half.max()) + math.log(2.0))
    c = np.exp(2.0 * (half + math.log(2.0) - shift))
    d = math.exp(log_d - shift)
    a2 = a * a

    def psi(s):
        r = np.sqrt(a2 * s * s + c)
        return d + float(r.sum()) - s, float((a2 * s / r).sum()) - 1.0

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


def _log_total(sums: SideSums, z_padded: np.ndarray) -> float:
    """log Σ_k P_k e^{z_leave - z_enter} over the pairs of ``sums`` (rows = left unit, cols = entered unit)."""
    if sums.rows.size == 0:
        return -math.inf
    v = sums(-z_padded) + z_padded[sums.rows]
    top = float(v.max())
    return top + math.log(float(np.exp(v - top).sum()))


def solve_block(g, B, *, max_sweeps: int = 1000, tol: float = 1e-10, anderson: int = 5) -> PathCondResult:
    """Minimise F by exact block updates over independent sets of units (the default solver).

    Parameters
    ----------
    g : (n,) array, diag G, non-negative.
    B : (n, H) sparse matrix with entries in {-1, 0, +1}, at most one of each sign per row.
    max_sweeps : sweeps over all colours at most.
    anderson : memory of the Anderson acceleration of the sweep map (0: plain block sweeps); an
        extrapolated point is taken only where it lowers F below the plain sweep's.
    tol : stop when a sweep changes F by at most ``tol * max(1, |F|)`` or moves no z_h by more than ``tol``.

    Returns
    -------
    PathCondResult (``method == "block"``; ``extra``: number of ``colours`` and ``pairs``, accepted
    ``anderson_steps``).

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
    enter, leave, H = row_units(B)
    n = enter.size
    g = _as_g(g, n)
    A = side_counts(enter, leave, H).astype(np.float64)
    degenerate = degenerate_units(g > 0, enter, leave, H)
    live = np.ones(H, dtype=bool)
    live[degenerate] = False
    pairs = group_pairs(g, enter, leave, H, frozen=degenerate)
    colour = greedy_coloring(pairs, live)
    blocks = blocks_of(pairs, colour)
    abs_a = [np.abs(A[b.units]) / n for b in blocks]

    everything = side_sums(pairs.leave, pairs.enter, pairs.log_mass, H + 1)

    def sweep(z, log_s):
        z = z.copy()
        for blk, a in zip(blocks, abs_a):
            zp = pad(z)
            log_b, log_c = blk.outgoing(-zp), blk.incoming(zp)
            log_s = _solve_s(log_b, log_c, blk.rest_log(zp), a, log_s)
            half = 0.5 * (log_b + log_c)
            z[blk.units] = 0.5 * (log_c - log_b) + log_positive_root(A[blk.units], log_s - half, n, n)
        return z, log_s

    z = np.zeros(H)
    log_s = _log_total(everything, pad(z))
    f = n * log_s
    history, times = [f], [time.perf_counter() - start]
    d_res, d_img, last = [], [], None
    converged, sweeps, accepted = False, 0, 0
    for sweeps in range(1, max_sweeps + 1):
        image, log_s_image = sweep(z, log_s)
        f_image = n * log_s_image + float(A @ image)
        res = image - z
        if anderson and last is not None:
            d_res.append(res - last[0])
            d_img.append(image - last[1])
            del d_res[:-anderson], d_img[:-anderson]
        last = (res, image)
        new, log_s_new, f_new = image, log_s_image, f_image
        if d_res:
            # Anderson (type II): the image combination whose residual is smallest,
            # kept only if it beats the plain sweep, so F still decreases monotonically
            gamma = np.linalg.lstsq(np.column_stack(d_res), res, rcond=1e-12)[0]
            trial = image - np.column_stack(d_img) @ gamma
            log_s_trial = _log_total(everything, pad(trial))
            f_trial = n * log_s_trial + float(A @ trial)
            if f_trial < f_image:
                new, log_s_new, f_new = trial, log_s_trial, f_trial
                accepted += 1
            else:
                d_res.clear(), d_img.clear()
        step = float(np.max(np.abs(new - z), initial=0.0))
        z, log_s = new, log_s_new
        history.append(f_new)
        times.append(time.perf_counter() - start)
        if abs(f - f_new) <= tol * max(1.0, abs(f_new)) or step <= tol:
            converged = True
            break
        f = f_new
    return finish(g, B, z, method="block", sweeps=sweeps, converged=converged, degenerate=degenerate,
                  start=start, history=history, times=times,
                  extra={"colours": len(blocks), "pairs": int(pairs.log_mass.size), "anderson_steps": accepted})
