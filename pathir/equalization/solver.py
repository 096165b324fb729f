"""Minimising an equalization objective over |z_h| ≤ max_log_scale.

The objectives are convex but piecewise linear (maxima). The solver follows the smoothed objective
(each max a log-sum-exp of sharpness p) along increasing p, each stage a bounded L-BFGS-B started
where the last one stopped. The exact objective is flat along many directions (a channel below its
tensor's range may move freely until it reaches it); a small multiple ``balance`` of the objective at
sharpness ``BALANCE_SHARPNESS`` is added at every stage so that the channels left free end balanced
(on a chain of two layers, r¹_h/R¹ = r²_h/R² as in Nagel's closed form), and a tiny ridge
(ridge/2)‖z‖² keeps z = 0 where nothing is seen at all (a tensor scaled as a whole, units no quantized
tensor touches). Every stage's iterate is function-preserving; the last one's convergence is reported.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

from pathir.equalization.objective import Objective

__all__ = ["SolveResult", "solve", "SHARPNESS"]

#: the sharpness schedule: the last stage is within log(#pairs)/p of the exact objective per max
SHARPNESS = (1.0, 4.0, 16.0)
#: the sharpness of the balance term, and its weight
BALANCE_SHARPNESS, BALANCE = 2.0, 1e-2


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


def solve(objective: Objective, max_log_scale: float = math.inf, sharpness=SHARPNESS, ridge: float = 1e-6,
          balance: float = BALANCE,
          max_iter: int = 300, tol: float = 1e-7, callback=None) -> SolveResult:
    """Minimise ``objective`` over z with |z_h| ≤ ``max_log_scale``; ``callback(stage, value)`` after
    each stage. The result's z never does worse than z = 0 on the exact objective (else z = 0)."""
    start = time.perf_counter()
    H = objective.H
    z = np.zeros(H)
    before = objective.value(z)
    bounds = None if math.isinf(max_log_scale) else [(-max_log_scale, max_log_scale)] * H
    iterations, converged, message = [], True, ""
    for stage, p in enumerate(sharpness):
        def f(x, p=p):
            value, grad = objective.value_and_grad(x, p, extra=((BALANCE_SHARPNESS, balance),))
            return value + 0.5 * ridge * float(x @ x), grad + ridge * x

        res = minimize(f, z, jac=True, method="L-BFGS-B", bounds=bounds,
                       options={"maxiter": max_iter, "ftol": tol, "gtol": 1e-8, "maxcor": 20})
        z = np.asarray(res.x, dtype=np.float64)
        iterations.append(int(res.nit))
        converged, message = bool(res.success), str(res.message)
        if callback is not None:
            callback(stage, objective.value(z))
    after = objective.value(z)
    if not after <= before:  # the smoothing never makes things worse than doing nothing
        z, after = np.zeros(H), before
    at_bound = 0 if bounds is None else int(np.sum(np.abs(z) >= max_log_scale * (1 - 1e-9)))
    return SolveResult(z, before, after, iterations, converged, at_bound, time.perf_counter() - start, message)
