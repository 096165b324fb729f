"""What the PathCond report needs of diag G, kept beside the solve instead of g itself.

The report (``pathir.pathcond.run``) gives the log-spread of g and of g ⊙ e^{Bz*}
and the log-det divergences of both from the identity, over the entries g_i > 0.
Within one unit pair k = (e, l) every row is moved by the same factor e^{z_l - z_e},
so those figures need of g only: per pair its smallest positive and its largest
entry and its number of positive rows (`unit_pairs.group_compact` with
``extremes="compact"``: a pair made of one row stores none, its g is its mass),
and Σ log g_i and their number. That is a few arrays of the pairs' size at most,
so g (one float64 per parameter) is freed before the solver runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from pathir.analyses.unit_rows import CompactRows
from pathir.lifting.low_rank import LowRank, row_and_column_units
from pathir.pairs.factored_grid import FactoredGrid
from pathir.pairs.gridded_pairs import GriddedPairs
from pathir.pairs.unit_pairs import group_compact
from pathir.pathcond.grid_summary import GridSummary, LowRankSummary
from pathir.support.fast_log import log_in_place, sum_log_positive

__all__ = ["GSummary", "summarize", "summarize_factored", "with_grids"]

_CHUNK = 1 << 20


@dataclass(frozen=True, eq=False)
class GSummary:
    """Per unit pair (``enter``, ``leave``; H = "no unit"): log of the smallest positive and of the
    largest g_i, and the number of rows with g_i > 0; over all of g: n, the number ``kept`` of
    entries > 0 and the sum of their logs.

    ``single`` (bool per pair, or None for none) marks the pairs made of one row (every weight of a
    dense layer between unit layers, a bias): their extremes are their g, ``mass`` e^{``log_top``}
    (the pairs' own normalised masses), and ``log_low``, ``log_high``, ``count`` hold only the other
    pairs', in order. ``grids``: params kept factored (`GridSummary`, `LowRankSummary`), counted in
    n and kept (`with_grids`) and in `sum_log`; ``rest_sum_log`` is the other params' Σ log g."""

    enter: np.ndarray
    leave: np.ndarray
    log_low: np.ndarray
    log_high: np.ndarray
    count: np.ndarray
    n: int
    kept: int
    rest_sum_log: float
    single: np.ndarray | None = None
    mass: np.ndarray | None = None
    log_top: float = 0.0
    grids: tuple = ()

    @property
    def sum_log(self) -> float:
        """Σ log g_i over the entries > 0 (a factored convolution's read when first asked)."""
        return math.fsum([self.rest_sum_log] + [g.sum_log for g in self.grids])

    def _chunks(self, z: np.ndarray):
        """(shift of the pairs not single, their stored slice, log g and shift of the single ones or None)
        a chunk of pairs at a time: no temporary of the pairs' size."""

        zp = np.append(np.asarray(z, dtype=np.float64), 0.0)
        stored = 0
        for i in range(0, self.enter.size, _CHUNK):
            part = slice(i, i + _CHUNK)
            shift = zp[self.leave[part]] - zp[self.enter[part]]
            if self.single is None:
                yield shift, slice(stored, stored + shift.size), None
                stored += shift.size
                continue
            one = self.single[part]
            rest = shift[~one]
            ones = None
            if one.any():
                logs = log_in_place(self.mass[part][one])
                logs += self.log_top
                ones = (logs, shift[one])
            yield rest, slice(stored, stored + rest.size), ones
            stored += rest.size

    def spreads(self, z: np.ndarray) -> tuple[float, float]:
        """max − min of log g and of log(g ⊙ e^{Bz}) over the entries g > 0 ((0, 0) if there are none)."""
        top, bottom, high, low = -math.inf, math.inf, -math.inf, math.inf
        zp = np.append(np.asarray(z, dtype=np.float64), 0.0)
        for grid in self.grids:
            g_top, g_bottom, g_high, g_low = grid.extremes(zp)
            top, bottom, high, low = max(top, g_top), min(bottom, g_bottom), max(high, g_high), min(low, g_low)
        for shift, stored, ones in self._chunks(z):
            if shift.size:
                log_high, log_low = self.log_high[stored], self.log_low[stored]
                top, bottom = max(top, float(log_high.max())), min(bottom, float(log_low.min()))
                high, low = max(high, float((log_high + shift).max())), min(low, float((log_low + shift).min()))
            if ones is not None:
                logs, shift = ones
                top, bottom = max(top, float(logs.max())), min(bottom, float(logs.min()))
                logs += shift
                high, low = max(high, float(logs.max())), min(low, float(logs.min()))
        if top == -math.inf:
            return 0.0, 0.0
        return top - bottom, high - low

    def kept_shift(self, z: np.ndarray, balance: np.ndarray) -> float:
        """Σ_i (Bz)_i over the rows with g_i > 0 (−A·z from B's column balance A when all are)."""
        if self.kept == self.n:
            return -float(balance @ z)
        zp = np.append(np.asarray(z, dtype=np.float64), 0.0)
        total = math.fsum(grid.kept_shift(zp) for grid in self.grids)
        for shift, stored, ones in self._chunks(z):
            total += float(self.count[stored] @ shift) + (0.0 if ones is None else float(ones[1].sum()))
        return total

    def divergences(self, f_initial: float, f_final: float, z: np.ndarray, balance: np.ndarray) -> tuple[float, float]:
        """n'·log(mean g') − Σ log g' over the n' entries of g' = g ⊙ e^{Bz} that are > 0, at z = 0 and
        at z, given F(0) and F(z) of the (normalised) g the summary was taken of. The log-sums come from
        F (F(z) = n log Σ g e^{Bz} − Σ Bz, and Σ_i (Bz)_i = −A·z)."""
        if not self.kept:
            return 0.0, 0.0
        kept, n = self.kept, self.n
        bz_all = -float(balance @ z)
        log_s0, log_s1 = f_initial / n, (f_final + bz_all) / n
        sum_log = self.sum_log
        before = kept * (log_s0 - math.log(kept)) - sum_log
        after = kept * (log_s1 - math.log(kept)) - sum_log - self.kept_shift(z, balance)
        return float(before), float(after)


def summarize(g: np.ndarray, rows):
    """``(pairs, summary)``: g grouped by unit pair over B's ``rows`` (a `unit_rows.CompactRows`;
    `unit_pairs.group_compact`), ready for the solvers' ``pairs=``, and its :class:`GSummary`.
    ``g``: flat in θ order, or one array per param (`pathir.lifting.diag_g.diag_g_parts`)."""

    pairs, ext = group_compact(g, rows, extremes="compact")
    pieces = g if isinstance(g, (list, tuple)) else [g]
    logs = [sum_log_positive(x) for x in pieces]
    kept, sum_log, n = sum(k for k, _ in logs), math.fsum(v for _, v in logs), sum(x.size for x in pieces)
    # the extremes are the merge's own arrays: their logs are taken in place
    summary = GSummary(pairs.enter, pairs.leave, log_in_place(ext.low), log_in_place(ext.high), ext.count, int(n),
                       kept, sum_log, ext.single, None if ext.single is None else pairs.mass, pairs.log_top)
    return pairs, summary


def with_grids(summary: GSummary, grids: tuple) -> GSummary:
    """``summary`` (of the params grouped pair by pair) with the params kept factored added."""
    return dataclasses.replace(summary, n=summary.n + sum(g.n for g in grids),
                               kept=summary.kept + sum(g.kept for g in grids),
                               grids=summary.grids + tuple(grids))


def summarize_factored(g: list, rows: CompactRows):
    """`summarize` of g given one part per param, where a part may be a `LowRank` (a dense or 1×1
    convolution param's g = b aᵀ kept factored, `pathir.lifting.low_rank`): those become
    `FactoredGrid`s beside the pairs of the other params (a `GriddedPairs`, the same pairs once
    materialised) and `GridSummary`s (`LowRankSummary`s) added to their summary; without one,
    exactly `summarize`."""
    H = rows.num_units
    rest, ends, shapes, grids, summaries = [], [], [], [], []
    for part, shape, (enter, leave) in zip(g, rows.shapes, rows.ends, strict=True):
        if not isinstance(part, LowRank):
            rest.append(part)
            ends.append((enter, leave))
            shapes.append(shape)
            continue
        e, l = row_and_column_units(enter, leave, shape)
        if part.b.ndim == 1:
            grid, grid_summary = FactoredGrid.of_outer(part.b, part.a, e, l, H), GridSummary.of_outer(part.b, part.a, e, l)
        else:
            grid, grid_summary = FactoredGrid.of_low_rank(part.b, part.a, e, l, H), LowRankSummary(part.b, part.a, e, l)
        grids.extend([] if grid is None else [grid])
        summaries.append(grid_summary)
    if not summaries:
        return summarize(g, rows)
    pairs, summary = summarize(rest, CompactRows(tuple(ends), tuple(shapes), rows.balance))
    return GriddedPairs(pairs, tuple(grids)), with_grids(summary, tuple(summaries))
