"""A dense param's weight-gradient kept as its two factors.

On the all-ones input (batch 1) the backward walk's weight-gradient of a dense edge is the outer
product g xᵀ of the target's gradient and the source's value, so diag G of a dense param used
once is b aᵀ (docs/math.md §6). Kept factored it costs |b| + |a| numbers instead of |b| |a|, and
nothing is lost to rounding: no product is formed. PathCond reads such params as factored grids
(`pathir.pairs.factored_grid`); every other consumer asks for the product.

Which params qualify (`factorable`): a dense param used by exactly one edge, nowhere a bias, whose
rows of B enter a unit that depends on its row only and leave one that depends on its column only
(`pathir.analyses.incidence.compact_rows`), and large enough for the factoring to pay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pathir.errors import PathirError
from pathir.ir import Graph, MapKind

__all__ = ["RankOne", "factorable", "separable", "row_and_column_units", "MIN_SIZE"]

#: a dense param with fewer entries is grouped pair by pair as every other param is
MIN_SIZE = 1 << 16


@dataclass(eq=False)
class RankOne:
    """The value b aᵀ (b ≥ 0 per row, a ≥ 0 per column, numpy float64)."""

    b: np.ndarray
    a: np.ndarray

    @classmethod
    def of(cls, backend, b, a) -> "RankOne":
        """Copies of a backend's vectors ``b`` and ``a`` (the walk may reuse their memory)."""
        return cls(*(np.array(backend.to_numpy(x), dtype=np.float64).reshape(-1) for x in (b, a)))

    @property
    def size(self) -> int:
        return len(self.b) * len(self.a)

    def normalised(self, log_scale: float, what: str, name: str) -> "tuple[RankOne, float] | None":
        """(the factors scaled in place to largest entry 1, and the log of the product's largest entry
        plus ``log_scale``); None where the value vanishes. Raises PathirError where a factor is not finite."""
        b, a = self.b, self.a
        peaks = [float(x.max()) if x.size else 0.0 for x in (b, a)]
        if not all(math.isfinite(v) for v in peaks):
            raise PathirError(f"{what} of param '{name}' is not finite (NaN or inf weights?)")
        if not min(peaks) > 0:
            return None
        b /= peaks[0]
        a /= peaks[1]
        return self, log_scale + math.log(peaks[0]) + math.log(peaks[1])

    def dense(self) -> np.ndarray:
        """b aᵀ as an array (numpy factors)."""
        return np.outer(self.b, self.a)


def factorable(graph: Graph, ends) -> frozenset[int]:
    """The ids of the params of ``graph.params()`` that qualify (module docstring); ``ends``: the params'
    compact row ends (entered, left), in that order."""
    uses: dict[int, int] = {}
    dense: set[int] = set()
    for node in graph.nodes:
        for e in node.edges:
            w = e.map.weight
            if w is not None:
                uses[id(w)] = uses.get(id(w), 0) + 1
                if e.map.kind is MapKind.DENSE:
                    dense.add(id(w))
        if node.bias is not None:
            uses[id(node.bias)] = uses.get(id(node.bias), 0) + 1
    return frozenset(id(p) for p, (enter, leave) in zip(graph.params(), ends, strict=True)
                     if id(p) in dense and uses[id(p)] == 1 and len(p.shape) == 2 and p.size >= MIN_SIZE
                     and separable(enter, leave))


def separable(enter, leave) -> bool:
    """Whether compact row ends of a 2-d param enter a unit fixed by the row and leave one fixed by the column."""
    enter, leave = np.asarray(enter), np.asarray(leave)
    return (enter.ndim == 0 or (enter.ndim == 2 and enter.shape[1] == 1)) and \
        (leave.ndim <= 1 or (leave.ndim == 2 and leave.shape[0] == 1))


def row_and_column_units(enter, leave, shape) -> tuple[np.ndarray, np.ndarray]:
    """(unit entered per row, unit left per column) of `separable` ends of a param of ``shape``."""
    return np.broadcast_to(enter, shape)[:, 0], np.broadcast_to(leave, shape)[0, :]
