"""What the PathCond report needs of a dense param whose g is an outer product b aᵀ, per side.

Row o enters unit enter[o], column i leaves unit leave[i]; the entries g_{o,i} > 0 are the
products of b_o > 0 and a_i > 0. Per unit of each side the smallest and largest positive
factor and their number fix every figure of `GSummary` over the param's |b| |a| entries:
min/max log g (shifted by z_l - z_e) are sums of one side's min/max, Σ log g and Σ (Bz) over
the kept entries are sums of products of side totals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["GridSummary"]


def _side(x: np.ndarray, unit: np.ndarray):
    """(units with some x > 0; per unit log min, log max of its x > 0, their number; Σ log x > 0)."""
    live = x > 0
    unit, logs = unit[live], np.log(x[live])
    order = np.argsort(unit, kind="stable")
    unit, logs = unit[order], logs[order]
    if unit.size == 0:
        return unit, logs, logs, np.zeros(0, dtype=np.int64), 0.0
    starts = np.flatnonzero(np.r_[True, unit[1:] != unit[:-1]])
    count = np.diff(np.append(starts, unit.size))
    return (unit[starts], np.minimum.reduceat(logs, starts), np.maximum.reduceat(logs, starts), count,
            math.fsum(logs))


@dataclass(frozen=True, eq=False)
class GridSummary:
    """Per side (``e_*`` rows, ``l_*`` columns): units, log min, log max of the positive factors,
    their count; ``n`` = the param's entries, ``kept`` = its entries > 0, ``sum_log`` = their Σ log g."""

    e_units: np.ndarray
    e_low: np.ndarray
    e_high: np.ndarray
    e_count: np.ndarray
    l_units: np.ndarray
    l_low: np.ndarray
    l_high: np.ndarray
    l_count: np.ndarray
    n: int
    kept: int
    sum_log: float

    @classmethod
    def of_outer(cls, b: np.ndarray, a: np.ndarray, enter: np.ndarray, leave: np.ndarray) -> "GridSummary":
        e_units, e_low, e_high, e_count, e_log = _side(b, enter)
        l_units, l_low, l_high, l_count, l_log = _side(a, leave)
        ce, cl = int(e_count.sum()), int(l_count.sum())
        sum_log = cl * e_log + ce * l_log if ce and cl else 0.0
        return cls(e_units, e_low, e_high, e_count, l_units, l_low, l_high, l_count, int(b.size * a.size),
                   ce * cl, float(sum_log))

    def extremes(self, zp: np.ndarray) -> tuple[float, float, float, float]:
        """(max, min) of log g and of log g + z_l - z_e over the entries > 0 (``zp``: z padded with 0);
        (-inf, inf, -inf, inf) if there are none."""
        if not self.kept:
            return -math.inf, math.inf, -math.inf, math.inf
        ze, zl = zp[self.e_units], zp[self.l_units]
        return (float(self.e_high.max() + self.l_high.max()), float(self.e_low.min() + self.l_low.min()),
                float((self.e_high - ze).max() + (self.l_high + zl).max()),
                float((self.e_low - ze).min() + (self.l_low + zl).min()))

    def kept_shift(self, zp: np.ndarray) -> float:
        """Σ (z_l - z_e) over the entries > 0."""
        if not self.kept:
            return 0.0
        ce, cl = float(self.e_count.sum()), float(self.l_count.sum())
        return ce * float(self.l_count @ zp[self.l_units]) - cl * float(self.e_count @ zp[self.e_units])
