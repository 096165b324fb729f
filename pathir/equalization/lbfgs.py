"""A small limited-memory BFGS for box-bounded smooth minimisation (the equalization solver's inner loop).

scipy's L-BFGS-B spends milliseconds per iteration on its own bookkeeping at the ten thousand units
of a zoo model with bounds, more than one objective evaluation costs; this one costs a few vector
operations per stored pair. Bounds are kept by projection: variables at a bound whose gradient
points outward are held, the two-loop direction is taken over the others, and a backtracking
(Armijo) search runs along the projected path.

The search is safeguarded for the sharply smoothed maxima it meets (a direction whose unit step
overshoots the point where another cell takes over a tensor's range): a cut step shrinks to the
minimiser of the quadratic through f(0), f'(0) and the rejected value, kept within [0.1, 0.5] of
it (Nocedal & Wright §3.5), not by halves; and the next iteration tries twice the last accepted
length first (the whole step once steps are whole again). On shufflenet_v2 this halves the
evaluations of the sharpest stage, whose unit steps failed at every other iteration.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["minimize_box", "BoxResult"]


@dataclass
class BoxResult:
    x: np.ndarray
    fun: float
    nit: int
    success: bool
    message: str


def minimize_box(fun, x0: np.ndarray, lower=-math.inf, upper=math.inf, max_iter: int = 200,
                 ftol: float = 1e-8, gtol: float = 1e-8, memory: int = 20, atol: float = 0.0,
                 window: int = 1) -> BoxResult:
    """Minimise ``fun`` (x ↦ (value, gradient)) over lower ≤ x ≤ upper (scalars or arrays) from ``x0``.
    Stops when an iteration lowers the value by less than ``ftol`` relative to max(|f|, 1), when the
    last ``window`` iterations lowered it by less than ``atol`` each on average, when the projected
    gradient's largest entry is at most ``gtol``, or after ``max_iter`` iterations (``success``
    False). Every iterate is feasible, and the value never increases."""
    x = np.clip(np.asarray(x0, dtype=np.float64), lower, upper)
    fx, g = fun(x)
    pairs: deque = deque(maxlen=memory)
    history = deque([fx], maxlen=window + 1)
    last = 1.0  # the last accepted step length
    for it in range(1, max_iter + 1):
        held = ((x <= lower) & (g > 0)) | ((x >= upper) & (g < 0))
        gf = np.where(held, 0.0, g)
        if float(np.max(np.abs(gf), initial=0.0)) <= gtol:
            return BoxResult(x, fx, it - 1, True, "projected gradient below gtol")
        d = -_two_loop(gf, pairs)
        d[held] = 0.0
        if not float(g @ d) < 0:  # not a descent direction: restart from the gradient
            pairs.clear()
            d = -gf / max(1.0, float(np.linalg.norm(gf)))
        step = min(1.0, 2.0 * last)
        while True:
            xn = np.clip(x + step * d, lower, upper)
            fn, gn = fun(xn)
            slope = float(g @ (xn - x))  # < 0: the projected step's directional derivative times its length
            if math.isfinite(fn) and fn <= fx + 1e-4 * slope:
                break
            step *= _cut(fx, fn, slope)
            if step < 1e-12:
                return BoxResult(x, fx, it, True, "no decrease along the search direction")
        last = step
        s, y = xn - x, gn - g
        sy = float(s @ y)
        if sy > 1e-12 * float(np.linalg.norm(s) * np.linalg.norm(y)):
            pairs.append((s, y, 1.0 / sy))
        decrease = fx - fn
        x, fx, g = xn, fn, gn
        if decrease <= ftol * max(abs(fx), 1.0):
            return BoxResult(x, fx, it, True, "relative decrease below ftol")
        history.append(fx)
        if len(history) > window and history[0] - fx <= atol * window:
            return BoxResult(x, fx, it, True, f"decrease over the last {window} iterations below atol")
    return BoxResult(x, fx, max_iter, False, "iteration limit reached")


def _cut(f0: float, f1: float, slope: float) -> float:
    """The factor a rejected step is cut by: the minimiser of the quadratic q with q(0) = f0, q'(0) = slope
    and q(1) = f1 (over the rejected step's length), kept within [0.1, 0.5]; 0.5 where f1 is not finite."""
    curvature = f1 - f0 - slope
    if not (math.isfinite(f1) and curvature > 0):
        return 0.5
    return min(0.5, max(0.1, -slope / (2.0 * curvature)))


def _two_loop(g: np.ndarray, pairs) -> np.ndarray:
    """H g for the inverse-Hessian estimate of the stored (s, y) pairs (a scaled identity without any)."""
    if not pairs:
        return g / max(1.0, float(np.linalg.norm(g)))
    q = g.copy()
    alphas = []
    for s, y, rho in reversed(pairs):
        a = rho * float(s @ q)
        q -= a * y
        alphas.append(a)
    s, y, _ = pairs[-1]
    q *= float(s @ y) / float(y @ y)
    for (s, y, rho), a in zip(pairs, reversed(alphas)):
        q += s * (a - rho * float(y @ q))
    return q
