"""Unit pairs as the ones grouped one by one plus dense layers' factored grids (`FactoredGrid`).

Only Newton-CG reads the grids as they are (`GriddedLaplacian`); every other consumer calls
`materialise`, which gives exactly the `Pairs` the grouping of g would have given (a pair in
several parts merged, masses summed in log space).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pathir.pairs.factored_grid import FactoredGrid
from pathir.pairs.gridded_laplacian import GriddedLaplacian
from pathir.pairs.unit_pairs import Pairs, segment_logsumexp

__all__ = ["GriddedPairs"]


@dataclass(frozen=True, eq=False)
class GriddedPairs:
    """``rest`` (pairs grouped one by one) and ``grids`` over the same H units, together the pairs of g."""

    rest: Pairs
    grids: tuple[FactoredGrid, ...]

    @property
    def num_units(self) -> int:
        return self.rest.num_units

    @property
    def size(self) -> int:
        """The number of pairs, a pair present in two parts counted twice."""
        return self.rest.size + sum(grid.size for grid in self.grids)

    def degenerate(self) -> np.ndarray:
        """Units missing from the entered side or from the left side of every pair (sorted)."""
        H = self.num_units
        has_in, has_out = np.zeros(H + 1, dtype=bool), np.zeros(H + 1, dtype=bool)
        for part in (self.rest, *self.grids):  # marked part by part: no concatenation of the pairs' ends
            has_in[part.enter] = True
            has_out[part.leave] = True
        return np.flatnonzero(~(has_in[:H] & has_out[:H]))

    def freeze(self, units) -> "GriddedPairs":
        """Every part with ``units`` read as "no unit" (`Pairs.freeze`, `FactoredGrid.freeze`)."""
        return GriddedPairs(self.rest.freeze(units), tuple(grid.freeze(units) for grid in self.grids))

    def laplacian(self) -> GriddedLaplacian:
        return GriddedLaplacian(self.rest, self.grids)

    def materialise(self) -> Pairs:
        """Every pair one by one, sorted and distinct (the fallback for any consumer of `Pairs`)."""
        H = self.num_units
        parts = [self.rest] + [grid.materialise() for grid in self.grids]
        key = np.concatenate([p.enter * (H + 1) + p.leave for p in parts])
        log_mass = np.concatenate([p.log_mass for p in parts])
        order = np.argsort(key, kind="stable")
        sk = key[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]]) if sk.size else np.zeros(0, dtype=np.int64)
        merged = segment_logsumexp(log_mass[order], starts) if sk.size else np.zeros(0)
        return Pairs(merged, sk[starts] // (H + 1), sk[starts] % (H + 1), H)
