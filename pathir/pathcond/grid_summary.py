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

__all__ = ["GridSummary", "LowRankSummary"]

#: entries of a low-rank param's product formed at a time
_BLOCK = 1 << 18


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


class LowRankSummary:
    """`GridSummary`'s figures for g = b aᵀ of rank k (a 1×1 convolution, `pathir.lifting.low_rank`):
    each live row (not all zero) normalised to largest entry 1, with its log-scale and its unit;
    g_{o,i} > 0 exactly where both rows live (their entries are then > 0). Σ log g and the extremes
    form the product a block of rows at a time, in one pass (the first of ``extremes`` or ``sum_log``
    asked, ``extremes`` first: the report's order); the counts are sums of side totals."""

    def __init__(self, b: np.ndarray, a: np.ndarray, enter: np.ndarray, leave: np.ndarray):
        """b: outputs x k, a: inputs x k, rows `low_rank.rows_bounded`; output o enters unit enter[o],
        input i leaves leave[i]."""
        sides = []
        for x, unit in ((b, enter), (a, leave)):
            peak = x.max(axis=1)
            live = peak > 0
            sides.append((unit[live], np.log(peak[live]), x[live] / peak[live][:, None]))
        (self.e_units, self.e_log, self.b), (self.l_units, self.l_log, self.a) = sides
        self.n, self.kept = int(b.shape[0] * a.shape[0]), int(self.e_units.size * self.l_units.size)
        self._at_zero: tuple[float, float, float] | None = None  # (Σ log g, max, min)

    def _pass(self, zp: np.ndarray | None) -> tuple[float, float]:
        """One pass over log g (a block of outputs at a time): Σ, max and min cached, and the max and min of
        log g + z_l − z_e with ``zp``."""
        rows = max(1, _BLOCK // max(1, self.a.shape[0]))
        col = self.l_log[None, :]
        moved = None if zp is None else (self.l_log + zp[self.l_units])[None, :]
        total, top, bottom, high, low = 0.0, -math.inf, math.inf, -math.inf, math.inf
        for i in range(0, self.b.shape[0], rows):
            logs = np.log(self.b[i:i + rows] @ self.a.T)
            logs += col
            logs += self.e_log[i:i + rows, None]
            total += float(logs.sum())
            top, bottom = max(top, float(logs.max())), min(bottom, float(logs.min()))
            if moved is not None:
                logs += moved - col
                logs -= zp[self.e_units[i:i + rows], None]
                high, low = max(high, float(logs.max())), min(low, float(logs.min()))
        self._at_zero = (total, top, bottom)
        return high, low

    @property
    def sum_log(self) -> float:
        """Σ log g over the entries > 0."""
        if self._at_zero is None:
            self._pass(None)
        return self._at_zero[0]

    def extremes(self, zp: np.ndarray) -> tuple[float, float, float, float]:
        """As `GridSummary.extremes`."""
        if not self.kept:
            return -math.inf, math.inf, -math.inf, math.inf
        high, low = self._pass(zp)
        return self._at_zero[1], self._at_zero[2], high, low

    def kept_shift(self, zp: np.ndarray) -> float:
        """Σ (z_l - z_e) over the entries > 0."""
        if not self.kept:
            return 0.0
        return self.e_units.size * float(zp[self.l_units].sum()) - self.l_units.size * float(zp[self.e_units].sum())
