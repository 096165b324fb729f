"""`PairLaplacian` over pairs plus factored grids, never materialising the grids (docs/math.md §8).

The pairs of a model split into the ones grouped one by one (``pairs``) and factored grids
(`FactoredGrid`: a dense layer's masses u_e v_l, a 1×1 convolution's of rank k, the latter stacked
by size, `low_rank_grids`). A point evaluates the rest as `PairLaplacian` does and adds each
grid's separable sums in one common scale: the largest of the parts' scales, so every part's
terms stay at most 1 and nothing overflows. A pair present in the rest and in a grid (after a
freeze) simply adds up, as the materialised pairs would merge it.

What Newton-CG reads is here (E, I, O, the Hessian's diagonal and products, the coarse space's
group table); any other consumer materialises the grids (`FactoredGrid.materialise`).
"""

from __future__ import annotations

import math
from functools import cached_property

import numpy as np

from pathir.pairs.factored_grid import FactoredGrid
from pathir.pairs.low_rank_grids import LowRankStack
from pathir.pairs.pair_laplacian import PairLaplacian
from pathir.pairs.unit_pairs import Pairs, pad
from pathir.support.threads import beside

__all__ = ["GriddedLaplacian", "GriddedPoint"]

#: evaluate the pairs and the grids of a point on two threads (see `GriddedLaplacian`), from this many cells
#: on each side
OVERLAP, OVERLAP_CELLS = True, 200_000


def near_sizes(grids: list) -> list[list]:
    """Rank-k grids grouped for stacking: one rank and one |E| each, their |L| within a factor of 2 of the
    group's smallest (padding at most doubles a group's work, and merges its Python calls into one)."""
    by_rank: dict[tuple, list] = {}
    for grid in grids:
        by_rank.setdefault((grid.U.shape[1], grid.enter.size), []).append(grid)
    groups = []
    for same in by_rank.values():
        same.sort(key=lambda g: g.leave.size)
        start = 0
        for i in range(1, len(same) + 1):
            if i == len(same) or same[i].leave.size > 2 * same[start].leave.size:
                groups.append(same[start:i])
                start = i
    return groups


class GriddedLaplacian:
    """E(z) = Σ_k P_k e^{z_e - z_l} over ``pairs`` and every pair of ``grids`` (one unit count H)."""

    def __init__(self, pairs: Pairs, grids: tuple[FactoredGrid, ...]):
        if any(grid.num_units != pairs.num_units for grid in grids):
            raise ValueError("every grid must be over the pairs' units")
        self.pairs, self.grids, self.H = pairs, tuple(grids), pairs.num_units
        self.rest = PairLaplacian(pairs) if pairs.size else None
        # rank one: a point each; rank k: one point per stack of near sizes
        self.parts = tuple(g for g in self.grids if g.U is None) + tuple(
            LowRankStack(gs) for gs in near_sizes([g for g in self.grids if g.U is not None]))
        # the pairs and the rank-k grids evaluated side by side on two threads where both are large enough
        # that each is worth a core (numpy's products release the GIL): a hand-off costs ~50 µs
        self.overlap = OVERLAP and pairs.size >= OVERLAP_CELLS and sum(
            part.U.size + part.V.size if isinstance(part, LowRankStack) else part.enter.size + part.leave.size
            for part in self.parts) >= OVERLAP_CELLS

    def point(self, z: np.ndarray, both: bool = False) -> "GriddedPoint":
        return GriddedPoint(self, z, both)


class GriddedPoint:
    """E at z over one common factor e^{scale}: ``inc`` = I, ``out`` = O, ``total`` = E (over it),
    ``log_e`` = log E; `diag`, `hessian_times` and `grouped` as `PairPoint`'s."""

    def __init__(self, lap: GriddedLaplacian, z: np.ndarray, both: bool = False):
        H = lap.H
        self.lap, self.z = lap, z
        rest = None if lap.rest is None else beside(lap.rest.point, z, both, here=not lap.overlap)
        self.grid_points = [part.point(z) for part in lap.parts]
        self.rest = None if rest is None else rest.result()
        rest_scale = -math.inf if self.rest is None else self.rest.log_e - math.log(self.rest.total)
        self.scale = max([rest_scale] + [p.log_scale for p in self.grid_points])
        self.rest_factor = math.exp(rest_scale - self.scale)
        inc, out = np.zeros(H + 1), np.zeros(H + 1)
        if self.rest is not None:
            inc[:H], out[:H] = self.rest.inc * self.rest_factor, self.rest.out * self.rest_factor
        for p in self.grid_points:
            p.add_sides(inc, out, self.scale)
        self.total = (0.0 if self.rest is None else self.rest.total * self.rest_factor) + sum(
            math.exp(p.log_total() - self.scale) for p in self.grid_points)
        self.log_e = self.scale + math.log(self.total)
        self.inc, self.out = inc[:H], out[:H]

    def self_terms(self) -> np.ndarray:
        into = np.zeros(self.lap.H + 1)
        if self.rest is not None:
            into[:self.lap.H] = self.rest.self_terms() * self.rest_factor
        for p in self.grid_points:
            p.add_self_terms(into, self.scale)
        return into[:self.lap.H]

    def diag(self) -> np.ndarray:
        """∇²E's diagonal, I + O without the pairs entering and leaving one unit."""
        return self._diagonal

    @cached_property
    def _diagonal(self) -> np.ndarray:
        return np.maximum(self.inc + self.out - 2.0 * self.self_terms(), 0.0)

    def hessian_times(self, p: np.ndarray) -> np.ndarray:
        """∇²E p over this point's scale."""
        H, pp = self.lap.H, pad(p)
        into = np.zeros(H + 1)
        rest = None if self.rest is None else beside(self.rest.hessian_times, p, here=not self.lap.overlap)
        for point in self.grid_points:
            point.add_hessian_times(pp, into, self.scale)
        if rest is not None:
            into[:H] += rest.result() * self.rest_factor
        return into[:H]

    def grouped(self, groups: np.ndarray, m1: int, keep: np.ndarray | None = None) -> np.ndarray:
        """The terms summed by (group entered, group left) over this point's scale (`PairPoint.grouped`)."""
        table = np.zeros((m1, m1)) if self.rest is None else self.rest.grouped(groups, m1, keep) * self.rest_factor
        for point in self.grid_points:
            point.add_grouped(table, groups, keep, self.scale)
        return table
