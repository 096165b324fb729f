"""A coarse space for the rescaling solvers: one degree of freedom per group of units.

The units of one layer (the channels of one node) move together in the slow
modes of the unit-pair Laplacian: shifting a whole layer up and the next one
down moves mass across depth, and per-unit (Jacobi) preconditioning sees such a
mode one unit at a time. With P the H x m matrix putting unit h in group
``groups[h]``, the coarse Laplacian PᵀLP is the pair terms summed by group
pair, m x m and dense (m ~ the number of layers), so

    M⁻¹ r = D⁻¹ r + P (PᵀHP)⁻¹ Pᵀ r          (two-level additive Schwarz)

costs one small Cholesky solve per CG step and cuts the iterations several
times on deep and concatenation-heavy graphs. The same aggregation gives the
coarse problem (`pathir.pathcond.coarse_start`): the objective restricted to
z = z₀ + P w.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg as sla

from pathir.errors import ArgumentError

__all__ = ["unit_groups", "CoarseSpace"]


def unit_groups(units) -> np.ndarray:
    """(H,) group per unit: units whose first member lies in the same node share a group, numbered
    in unit order (``pathir.analyses.find_units.Units``)."""
    first = units.first_nodes()
    if not first.size:
        return first
    nodes, at, group = np.unique(first, return_index=True, return_inverse=True)
    rank = np.empty(nodes.size, dtype=np.int64)
    rank[np.argsort(at, kind="stable")] = np.arange(nodes.size)  # numbered by first appearance in unit order
    return rank[group.reshape(-1)]


class CoarseSpace:
    """The groups of ``num_units`` units (``groups[h]``, renumbered to [0, m)); "no unit" H is group m.

    ``aggregate(point, keep)`` sums a `pair_laplacian` point's terms by (group entered, group left).
    """

    def __init__(self, groups: np.ndarray, num_units: int):
        groups = np.asarray(groups, dtype=np.int64)
        if groups.shape != (num_units,):
            raise ArgumentError(f"groups must give one group per unit ({num_units}), got shape {groups.shape}")
        if groups.size and groups.min() < 0:
            raise ArgumentError("groups must be non-negative")
        _, self.groups = np.unique(groups, return_inverse=True)  # densely: every group holds a unit
        self.m = int(self.groups.max(initial=-1)) + 1
        self.padded = np.append(self.groups, self.m)  # one array for every call: the matrices' plans key on it

    def aggregate(self, point, keep: np.ndarray | None = None) -> np.ndarray:
        """T (m + 1) x (m + 1) over the point's scale: T[a, b] sums the terms of the pairs entering a unit
        of group a and leaving one of group b ("no unit": m). With ``keep`` (per unit), only the pairs
        with both ends kept count in T[:m, :m] (what the preconditioner of the kept units reads)."""
        mask = None if keep is None else np.append(keep, True).astype(np.float64)
        return point.grouped(self.padded, self.m + 1, mask)

    def restrict(self, x: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
        """Pᵀ x over the units (those outside ``keep`` left out)."""
        return np.bincount(self.groups, weights=x if keep is None else x * keep, minlength=self.m)

    def preconditioner(self, T: np.ndarray, diag_sum: np.ndarray, c: np.ndarray, free: np.ndarray, jacobi: np.ndarray):
        """r ↦ D⁻¹ r + P (PᵀHP)⁻¹ Pᵀ r on the free units, for H = L + damping D - c cᵀ with the
        Laplacian L of the shares aggregated in ``T`` (``aggregate(point, free)`` over the total), ``diag_sum`` = Pᵀ
        of H's diagonal part (I + O with the damping) and ``jacobi`` = 1 / D (0 off the free units).
        Returns None where the coarse matrix is not positive definite (the caller keeps Jacobi)."""
        m = self.m
        inner = T[:m, :m]
        coarse = np.diag(diag_sum) - inner - inner.T
        cc = self.restrict(c, free)
        coarse -= np.outer(cc, cc)
        scale = float(np.max(diag_sum, initial=0.0))
        if not scale > 0:
            return None
        # a group with no free unit, or whose mass cancels (pairs within it only): left out of the correction
        empty = np.diag(coarse) <= 1e-10 * diag_sum
        coarse[empty, :] = 0.0
        coarse[:, empty] = 0.0
        coarse[empty, empty] = scale
        coarse[np.diag_indices(m)] += 1e-12 * scale
        try:
            factor = sla.cho_factor(coarse, check_finite=False)
        except np.linalg.LinAlgError:
            return None
        keep = ~empty

        def apply(r: np.ndarray) -> np.ndarray:
            w = sla.cho_solve(factor, self.restrict(r, free), check_finite=False) * keep
            return jacobi * r + w[self.groups] * free

        return apply
