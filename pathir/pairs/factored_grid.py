"""A dense layer's unit pairs kept factored: every (e, l) of E x L with mass P_{e,l} = u_e v_l, or
P_{e,l} = u_e v_l (U_e · V_l) for a factor of rank k (rows U_e, V_l of k entries, each row's largest 1).

A dense layer's diag G is an outer product g_{o,i} = b_o a_i, so its pairs form a full grid
whose masses are separable. Every quantity the pair solvers read is then separable too, in the
`PairLaplacian` convention E(z) = Σ P_{e,l} e^{z_e - z_l} (PathCond's S(z) is E(-z)): with
α_e = u_e e^{z_e} and β_l = v_l e^{-z_l}, each term is t_{e,l} = α_e β_l and

    E = (Σα)(Σβ),   I_e = α_e Σβ,   O_l = β_l Σα,
    (∇²E p)_e += α_e (Σβ p_e - β·p_L),   (∇²E p)_l += β_l (Σα p_l - α·p_E),

its extremes are min/max α times min/max β, and Σ log P = |L| Σ log u + |E| Σ log v. All of
it costs O(|E| + |L|) instead of O(|E| |L|). A 1×1 convolution's diag G is a sum of such
products over its P output positions (`pathir.lifting.low_rank`): with the rows α_e U_e and
β_l V_l, every sum above becomes k of them (Σα a vector of k sums, products dot products), at
O((|E| + |L|) k). Index H ("no unit") may sit on either side (z_H = 0); a unit on both sides gives
a pair (e, e) whose Hessian share cancels exactly.

A consumer that does not read grids calls `materialise` (the same pairs, sorted, distinct).
`FactoredGrid.of_outer` builds the grid of a dense param whose masses are g_{o,i} = b_o a_i, and
`FactoredGrid.of_low_rank` the one of g = b aᵀ with b, a of k columns: a unit spanning several
rows or columns (pinned outputs, a flatten's run of positions) sums them, so P_{e,l} stays
separable. The rank-k rows are `low_rank.rows_bounded` (each row all zero or within 1e100), so
U_e · V_l ≥ 1e-200 and nothing a grid sums underflows against its largest row pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pathir.pairs.log_space import log0, logsumexp
from pathir.pairs.low_rank_grids import LowRankStack
from pathir.pairs.unit_pairs import Pairs, pad, segment_logsumexp

__all__ = ["FactoredGrid", "GridPoint"]


@dataclass(frozen=True, eq=False)
class FactoredGrid:
    """Pairs E x L with log P_{e,l} = log_u[i] + log_v[j] (+ log U[i] · V[j] with ``U``, ``V``) for
    e = enter[i], l = leave[j].

    ``enter`` and ``leave`` are sorted, distinct, non-empty, in [0, num_units] (num_units = "no unit");
    the logs are finite (a zero factor's units carry no pair: leave them out). ``U`` (|E| x k) and
    ``V`` (|L| x k), for a rank-k grid, are > 0 with each row's largest entry 1 and its smallest at
    least 1e-100 (module docstring); None for rank one.
    """

    enter: np.ndarray
    leave: np.ndarray
    log_u: np.ndarray
    log_v: np.ndarray
    num_units: int
    U: np.ndarray | None = None
    V: np.ndarray | None = None

    @classmethod
    def of_outer(cls, b: np.ndarray, a: np.ndarray, enter: np.ndarray, leave: np.ndarray,
                 num_units: int) -> "FactoredGrid | None":
        """The pairs of masses g_{o,i} = b_o a_i (b, a >= 0) with row o entering unit enter[o] and column
        i leaving unit leave[i] (units in [0, num_units]): per unit the log of its summed factor, in
        log space (exact for any spread); units whose factor is 0 carry no pair and are left out (None:
        no pair at all)."""
        (enter_units, log_u), (leave_units, log_v) = _log_sums_by_unit(log0(b), enter), _log_sums_by_unit(log0(a), leave)
        if enter_units.size == 0 or leave_units.size == 0:
            return None
        return cls(enter_units, leave_units, log_u, log_v, num_units)

    @classmethod
    def of_low_rank(cls, b: np.ndarray, a: np.ndarray, enter: np.ndarray, leave: np.ndarray,
                    num_units: int) -> "FactoredGrid | None":
        """The pairs of masses g = b aᵀ, b (outputs x k) and a (inputs x k) ≥ 0 with every row all zero or
        within 1e100 (`low_rank.rows_bounded`), output o entering unit enter[o], input i leaving
        leave[i]: per unit its rows summed; zero rows carry no pair (None: no pair at all)."""
        (enter_units, log_u, U), (leave_units, log_v, V) = (_scaled_row_sums(np.zeros(len(b)), b, enter),
                                                            _scaled_row_sums(np.zeros(len(a)), a, leave))
        if enter_units.size == 0 or leave_units.size == 0:
            return None
        return cls(enter_units, leave_units, log_u, log_v, num_units, U, V)

    @property
    def size(self) -> int:
        """The number of pairs |E| |L|."""
        return int(self.enter.size) * int(self.leave.size)

    def _log_products(self) -> np.ndarray:
        """log P over the grid (|E| x |L|)."""
        logs = self.log_u[:, None] + self.log_v[None, :]
        return logs if self.U is None else logs + np.log(self.U @ self.V.T)

    def materialise(self) -> Pairs:
        """The grid's pairs one by one (sorted by (enter, leave)): the fallback for any consumer."""
        log_mass = self._log_products().ravel()
        enter = np.repeat(self.enter, self.leave.size)
        leave = np.tile(self.leave, self.enter.size)
        return Pairs(log_mass, enter, leave, self.num_units)

    def freeze(self, units: np.ndarray) -> "FactoredGrid":
        """The grid with ``units`` read as "no unit" (z fixed at 0): on each side, their factors and
        "no unit"'s are summed into one (the grid stays separable; `Pairs.freeze` regroups the same)."""
        H, units = self.num_units, np.asarray(units, dtype=np.int64)
        if units.size == 0:
            return self
        remap = np.arange(H + 1)
        remap[units] = H
        if self.U is not None:
            (enter, log_u, U), (leave, log_v, V) = (_scaled_row_sums(self.log_u, self.U, remap[self.enter]),
                                                    _scaled_row_sums(self.log_v, self.V, remap[self.leave]))
            return FactoredGrid(enter, leave, log_u, log_v, H, U, V)
        (enter, log_u), (leave, log_v) = (_log_sums_by_unit(self.log_u, remap[self.enter]),
                                          _log_sums_by_unit(self.log_v, remap[self.leave]))
        return FactoredGrid(enter, leave, log_u, log_v, H)

    def log_mass_sum(self) -> float:
        """Σ log P over the grid's pairs."""
        total = self.leave.size * self.log_u.sum() + self.enter.size * self.log_v.sum()
        return float(total if self.U is None else total + np.log(self.U @ self.V.T).sum())

    def point(self, z: np.ndarray):
        """The terms P_{e,l} e^{z_e - z_l} at z (over units 0..H-1): a `GridPoint`, or for a rank-k grid a
        `low_rank_grids.StackPoint` of one grid."""
        return GridPoint(self, z) if self.U is None else LowRankStack((self,)).point(z)


class GridPoint:
    """A rank-one grid at one z. ``log_alpha``/``log_beta`` are log α, log β per grid row/column;
    ``alpha``/``beta`` are α e^{-a_top}, β e^{-b_top} (max 1) and ``log_scale`` = a_top + b_top,
    so each term t_{e,l} = alpha_e beta_l e^{log_scale}."""

    def __init__(self, grid: FactoredGrid, z: np.ndarray):
        zp = pad(z)
        self.grid = grid
        self.log_alpha = grid.log_u + zp[grid.enter]
        self.log_beta = grid.log_v - zp[grid.leave]
        a_top, b_top = float(self.log_alpha.max()), float(self.log_beta.max())
        self.alpha, self.beta = np.exp(self.log_alpha - a_top), np.exp(self.log_beta - b_top)
        self.log_scale = a_top + b_top

    def log_total(self) -> float:
        """log E over the grid (log Σα + log Σβ: no term is formed)."""
        return logsumexp(self.log_alpha) + logsumexp(self.log_beta)

    def log_sides(self) -> tuple[np.ndarray, np.ndarray]:
        """(log I_e per grid row, log O_l per grid column), exact for any spread of masses and z."""
        return self.log_alpha + logsumexp(self.log_beta), self.log_beta + logsumexp(self.log_alpha)

    def add_sides(self, inc: np.ndarray, out: np.ndarray, log_scale: float) -> None:
        """I and O added into ``inc``/``out`` (H + 1 entries, "no unit" last) over e^{log_scale}."""
        shift = math.exp(self.log_scale - log_scale)
        inc[self.grid.enter] += self.alpha * (float(self.beta.sum()) * shift)
        out[self.grid.leave] += self.beta * (float(self.alpha.sum()) * shift)

    def add_hessian_times(self, p: np.ndarray, into: np.ndarray, log_scale: float) -> None:
        """∇²E p over the grid's pairs added into ``into`` (H + 1 entries) over e^{log_scale};
        ``p`` has H + 1 entries, p_H = 0."""
        shift = math.exp(self.log_scale - log_scale)
        pe, pl = p[self.grid.enter], p[self.grid.leave]
        a, b = self.alpha * shift, self.beta
        into[self.grid.enter] += a * (float(b.sum()) * pe - float(b @ pl))
        into[self.grid.leave] += b * (float(a.sum()) * pl - float(a @ pe))

    def add_grouped(self, table: np.ndarray, groups: np.ndarray, keep: np.ndarray | None, log_scale: float) -> None:
        """The terms summed by (group entered, group left) added into ``table`` (m1 x m1) over
        e^{log_scale} (`PairPoint.grouped`: ``groups`` and ``keep`` have H + 1 entries)."""
        m1 = table.shape[0]
        a = self.alpha * math.exp(self.log_scale - log_scale)
        b = self.beta
        if keep is not None:
            a, b = a * keep[self.grid.enter], b * keep[self.grid.leave]
        table += np.outer(np.bincount(groups[self.grid.enter], a, m1), np.bincount(groups[self.grid.leave], b, m1))

    def add_self_terms(self, into: np.ndarray, log_scale: float) -> None:
        """The terms of the pairs (h, h) (units on both sides) added into ``into`` over e^{log_scale}."""
        both, ie, il = np.intersect1d(self.grid.enter, self.grid.leave, assume_unique=True, return_indices=True)
        into[both] += self.alpha[ie] * self.beta[il] * math.exp(self.log_scale - log_scale)

    def log_extremes(self) -> tuple[float, float]:
        """(min, max) over the grid of log t_{e,l}."""
        return (float(self.log_alpha.min() + self.log_beta.min()),
                float(self.log_alpha.max() + self.log_beta.max()))


def _scaled_row_sums(log_s: np.ndarray, M: np.ndarray, unit: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(units with some row > 0, sorted; per unit log of its largest summed entry; its summed row over
    that, largest entry 1) of the rows e^{log_s[r]} M[r] (M ≥ 0), one unit per row."""
    live = (M.max(axis=1) > 0) & (log_s > -math.inf)
    order = np.argsort(unit[live], kind="stable")
    su, ls, rows = unit[live][order], log_s[live][order], M[live][order]
    if su.size == 0:
        return su, ls, rows
    starts = np.flatnonzero(np.r_[True, su[1:] != su[:-1]])
    top = np.maximum.reduceat(ls, starts)
    weight = np.exp(ls - np.repeat(top, np.diff(np.append(starts, su.size))))
    sums = np.add.reduceat(rows * weight[:, None], starts, axis=0)
    peak = sums.max(axis=1)
    return su[starts], top + np.log(peak), sums / peak[:, None]


def _log_sums_by_unit(log_x: np.ndarray, unit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(units with some x > 0, sorted; log Σ x over each) given log x (-inf: x = 0) and one unit per entry."""
    live = log_x > -math.inf
    order = np.argsort(unit[live], kind="stable")
    su, lx = unit[live][order], log_x[live][order]
    if su.size == 0:
        return su, lx
    starts = np.flatnonzero(np.r_[True, su[1:] != su[:-1]])
    return su[starts], segment_logsumexp(lx, starts)
