"""PathCond solvers on arrays (MATH.md §7): the one import point.

``solve(g, B)`` is the default (exact block updates, `pathcond_block`);
``solve_coordinate`` is the published cyclic coordinate descent
(`pathcond_coordinate`), kept as the reference. Both take diag G as ``g``
(n,) and the unit incidence matrix ``B`` (n x H, scipy.sparse, entries in
{-1, 0, +1}) and return a `PathCondResult`; the parameters rescale as
θ_i ← θ_i e^{-(Bz)_i / 2} and g ← g e^{Bz}.

>>> import numpy as np, scipy.sparse as sp
>>> B = sp.csr_array(np.array([[-1.], [1.]]))
>>> r = solve(np.array([1.0, 4.0]), B)
>>> round(float(r.z[0]), 6), r.converged, r.degenerate.tolist()
(-0.693147, True, [])
"""

from __future__ import annotations

from .pathcond_block import solve_block
from .pathcond_coordinate import solve_coordinate
from .pathcond_objective import PathCondResult, gradient, log_spread, objective, rescaled_log_g

__all__ = ["solve", "solve_block", "solve_coordinate", "objective", "gradient", "rescaled_log_g",
           "log_spread", "PathCondResult", "METHODS"]

METHODS = {"block": solve_block, "coordinate": solve_coordinate}


def solve(g, B, *, method: str = "block", max_sweeps: int = 1000, tol: float = 1e-10) -> PathCondResult:
    """Minimise the PathCond objective F(z) = n log Σ g e^{Bz} - Σ Bz; ``method`` in METHODS."""
    if method not in METHODS:
        raise ValueError(f"unknown PathCond method {method!r}; choose one of {sorted(METHODS)}")
    return METHODS[method](g, B, max_sweeps=max_sweeps, tol=tol)
