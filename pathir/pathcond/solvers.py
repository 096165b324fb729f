"""PathCond solvers on arrays (docs/math.md §7): the one import point.

Inputs: ``g`` (n,) = diag G, non-negative, any range of magnitudes; ``B``
(n x H) the unit incidence matrix, any scipy.sparse matrix/array (or dense)
with entries in {-1, 0, +1} and at most one -1 (the unit a parameter enters)
and one +1 (the unit it leaves) per row. Output: a `PathCondResult` whose
``z`` (H,) rescales θ_i ← θ_i e^{-(Bz)_i/2} (so g ← g e^{Bz}); degenerate units
(no mass on one whole side) are listed in ``degenerate`` and keep z = 0.

- ``solve(g, B)``: the default, projected Newton-CG from a coarse start (no block sweeps unless ``warm_sweeps``)
  (`newton.solve_newton`): quadratic convergence on deep and
  concatenation-heavy graphs;
- ``solve_block(g, B)``: exact block updates over independent sets of units
  with Anderson acceleration, L-BFGS to finish (`block.solve_block`);
- ``solve_coordinate(g, B)``: the published cyclic coordinate descent, kept as
  the reference (`pathcond_coordinate`);
- ``objective(g, B, z)``, ``gradient(g, B, z)``, ``rescaled_log_g(g, B, z)``.

>>> import numpy as np, scipy.sparse as sp
>>> B = sp.csr_array(np.array([[-1.], [1.]]))   # one unit: a weight in, a weight out
>>> r = solve(np.array([1.0, 4.0]), B)
>>> round(float(r.z[0]), 6), r.converged, r.degenerate.tolist()
(-0.693147, True, [])
>>> sorted(r.to_dict())[:5]
['converged', 'degenerate', 'f_final', 'f_initial', 'grad_max']
"""

from __future__ import annotations

import math

from pathir.errors import ArgumentError
from pathir.pairs.gridded_pairs import GriddedPairs
from pathir.pathcond.block import solve_block
from pathir.pathcond.coordinate import solve_coordinate
from pathir.pathcond.newton import solve_newton
from pathir.pathcond.objective import PathCondResult, gradient, log_spread, objective, rescaled_log_g

__all__ = ["solve", "solve_newton", "solve_block", "solve_coordinate", "objective", "gradient", "rescaled_log_g",
           "log_spread", "PathCondResult", "METHODS"]

METHODS = {"newton": solve_newton, "block": solve_block, "coordinate": solve_coordinate}


def solve(g, B, *, method: str = "newton", max_sweeps: int = 1000, tol: float = 1e-10,
          row_key=None, max_log_scale: float = math.inf, callback=None, pairs=None, groups=None) -> PathCondResult:
    """Minimise F(z) = n log Σ_i g_i e^{(Bz)_i} - Σ_i (Bz)_i with ``method`` in METHODS.

    Stops when F has stopped moving (relative change at most ``tol``) or no
    z_h moves by more than ``tol`` in a sweep (details in each solver);
    ``result.converged`` says whether that happened within ``max_sweeps``.
    ``row_key``: B's rows as unit keys, where the caller built B from them
    (``Compiled.row_keys()``; see `unit_rows.keys_for`); with a `unit_rows.RowKeys`
    the newton and block solvers need no B at all (``B=None``). ``max_log_scale`` bounds every
    |z_h| (box-constrained F, still convex; ``math.inf``: unconstrained). ``callback(step, F)`` is
    called after each sweep or iteration (a hook for progress display). ``pairs``: g already
    grouped by unit pair over ``row_key`` (`unit_pairs.group_compact`), for the newton and block
    solvers; g may then be None (the caller keeps what it needs of g, and g need not stay in memory).
    A `GriddedPairs` (dense layers' grids factored) is read as it is by newton, materialised for block.
    ``groups``: the units grouped by layer (`pathir.pairs.coarse.unit_groups`), for the newton
    solver's coarse start and preconditioner; the other methods do not use them.
    """
    if method not in METHODS:
        raise ArgumentError(f"method={method!r}: unknown PathCond method; choose one of {sorted(METHODS)}")
    if B is None and method == "coordinate":
        raise ArgumentError("the coordinate solver needs B itself (the newton and block solvers run on row keys alone)")
    if not max_log_scale >= 0:
        raise ArgumentError(f"max_log_scale must be >= 0 (math.inf: unbounded), got {max_log_scale}")
    options = {"groups": groups} if method == "newton" else {}
    if pairs is not None:
        if method == "coordinate":
            raise ArgumentError("the coordinate solver reads g itself, not its unit pairs")
        # only Newton reads factored grids: any other method gets every pair one by one
        options["pairs"] = pairs if method == "newton" or not isinstance(pairs, GriddedPairs) else pairs.materialise()
    return METHODS[method](g, B, max_sweeps=max_sweeps, tol=tol, row_key=row_key, max_log_scale=max_log_scale,
                           callback=callback, **options)
