"""A param's weight-gradient kept as its two factors.

On the all-ones input (batch 1) the backward walk's weight-gradient of a dense edge is the outer
product g xᵀ of the target's gradient and the source's value, so diag G of a dense param used
once is b aᵀ (docs/math.md §6). A 1×1 convolution (stride 1, no padding, one group) is a dense
map at every one of its P output positions: its weight-gradient is the sum over positions,
b aᵀ with b (out channels × P) the target's gradient and a (in channels × P) the source's value,
of rank at most P. Kept factored it costs (|out| + |in|)·P numbers instead of |out| |in|.

A dense param's factors are vectors and no product is ever formed: nothing is lost to rounding.
A convolution's are kept only where each row of each factor is all zero or spans at most
``ROW_SPREAD`` between its entries (`rows_bounded`): with each row normalised to largest entry 1,
every row pair's product is then at least ROW_SPREAD⁻² and nothing underflows. Otherwise the walk
forms the weight-gradient as for any other param. PathCond reads such params as factored grids
(`pathir.pairs.factored_grid`); every other consumer asks for the product.

Which params qualify (`factorable`): a dense or 1×1-convolution param used by exactly one edge,
nowhere a bias, whose rows of B enter a unit that depends on its output channel only and leave one
that depends on its input channel only (`pathir.analyses.incidence.compact_rows`), large enough for
the factoring to pay, and for a convolution with (|out| + |in|)·P at most ``CONV_RATIO`` of |out| |in|.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pathir.errors import PathirError
from pathir.ir import Graph, MapKind

__all__ = ["LowRank", "factorable", "separable", "row_and_column_units", "rows_bounded", "MIN_SIZE"]

#: a param with fewer entries is grouped pair by pair as every other param is
MIN_SIZE = 1 << 16
#: a 1×1 convolution is kept factored where its factors hold at most this fraction of its entries
CONV_RATIO = 0.5
#: the largest ratio between two entries of one row of a convolution's factor (zero rows aside)
ROW_SPREAD = 1e100


@dataclass(eq=False)
class LowRank:
    """The value b aᵀ, b ≥ 0 one row per output and a ≥ 0 one row per input (numpy float64): vectors
    for a dense param (rank one), matrices of P columns for a 1×1 convolution."""

    b: np.ndarray
    a: np.ndarray

    @classmethod
    def of(cls, backend, b, a) -> "LowRank":
        """Copies of a backend's vectors ``b`` and ``a`` (the walk may reuse their memory)."""
        return cls(*(np.array(backend.to_numpy(x), dtype=np.float64).reshape(-1) for x in (b, a)))

    @classmethod
    def of_conv(cls, backend, g, x) -> "LowRank | None":
        """A 1×1 convolution's factors from the target's gradient ``g`` (out, *positions) and the source's
        value ``x`` (in, *positions) of one sample (copies); None where a row of either is not
        `rows_bounded`."""
        b, a = (np.array(backend.to_numpy(v), dtype=np.float64).reshape(v.shape[0], -1) for v in (g, x))
        return cls(b, a) if rows_bounded(b) and rows_bounded(a) else None

    @property
    def size(self) -> int:
        return len(self.b) * len(self.a)

    def normalised(self, log_scale: float, what: str, name: str) -> "tuple[LowRank, float] | None":
        """(the factors scaled in place to largest entry 1, and the log of the scale taken out plus
        ``log_scale``): the product's largest entry is then 1 for vectors, at most the rank P for
        matrices. None where the value vanishes. Raises PathirError where a factor is not finite."""
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
        """b aᵀ as an array of shape (outputs, inputs) (numpy factors)."""
        return np.outer(self.b, self.a) if self.b.ndim == 1 else self.b @ self.a.T


def rows_bounded(x: np.ndarray) -> bool:
    """Whether ``x`` (≥ 0) is finite and each of its rows all zero or within ROW_SPREAD between its entries."""
    if not np.all(np.isfinite(x)):
        return False
    low, high = x.min(axis=1), x.max(axis=1)
    return bool(np.all((high == 0) | (low * ROW_SPREAD >= high)))


def factorable(graph: Graph, ends) -> frozenset[int]:
    """The ids of the params of ``graph.params()`` that qualify (module docstring); ``ends``: the params'
    compact row ends (entered, left), in that order."""
    uses: dict[int, int] = {}
    kinds: set[int] = set()
    for node in graph.nodes:
        for e in node.edges:
            w = e.map.weight
            if w is not None:
                uses[id(w)] = uses.get(id(w), 0) + 1
                if e.map.kind is MapKind.DENSE or _pointwise_conv_pays(e.map, node.shape):
                    kinds.add(id(w))
        if node.bias is not None:
            uses[id(node.bias)] = uses.get(id(node.bias), 0) + 1
    return frozenset(id(p) for p, (enter, leave) in zip(graph.params(), ends, strict=True)
                     if id(p) in kinds and uses[id(p)] == 1 and p.size >= MIN_SIZE and separable(enter, leave))


def _pointwise_conv_pays(m, out_shape) -> bool:
    """A 1×1 convolution, stride 1, no padding, one group, whose factors hold at most CONV_RATIO of its entries."""
    if m.kind is not MapKind.CONV or m.groups != 1 or any(k != 1 for k in m.W.shape[2:]):
        return False
    if any(s != 1 for s in m.stride) or any(p != (0, 0) for p in m.padding):
        return False
    O, I = m.W.shape[:2]
    return (O + I) * math.prod(out_shape[1:]) <= CONV_RATIO * O * I


def separable(enter, leave) -> bool:
    """Whether compact row ends of a param of shape (out, in) or (out, in, 1, ...) enter a unit fixed by
    the output and leave one fixed by the input."""
    enter, leave = np.asarray(enter), np.asarray(leave)
    return (enter.ndim == 0 or (enter.ndim >= 2 and enter.shape[1] == 1 and math.prod(enter.shape[2:]) == 1)) and \
        (leave.ndim <= 1 or (leave.ndim >= 2 and leave.shape[0] == 1 and math.prod(leave.shape[2:]) == 1))


def row_and_column_units(enter, leave, shape) -> tuple[np.ndarray, np.ndarray]:
    """(unit entered per output, unit left per input) of `separable` ends of a param of ``shape``."""
    O, I = shape[0], math.prod(shape[1:])
    return np.broadcast_to(enter, shape).reshape(O, I)[:, 0], np.broadcast_to(leave, shape).reshape(O, I)[0, :]
