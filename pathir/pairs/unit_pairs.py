"""The unit incidence matrix B (docs/math.md §5) read as pairs of units.

Row i of B holds at most one -1 (the unit parameter i enters, e(i)) and at most
one +1 (the unit it leaves, l(i)). With the convention z_none = 0,

    (Bz)_i = z_{l(i)} - z_{e(i)}   and   Σ_i m_i e^{(Bz)_i} = Σ_k P_k e^{z_{l_k} - z_{e_k}}

over the distinct pairs k = (e_k, l_k), with P_k = Σ_{i in k} m_i. The PathCond
sum S (m = g) and the ENorm criterion (m = c θ², z -> -z) depend on the masses
only through the pairs, so the block solvers work on them: a dense layer of
fan-in 3072 collapses to one pair per unit, a 3x3 convolution to one pair per
(out, in) channel.

Units are 0..H-1; index H stands for "no unit" (an input, an output, or a unit
frozen at z = 0), so z is padded with one trailing 0 (`pad`). The rows come in
as keys e(i) (H + 1) + l(i) (`unit_rows`).
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import scipy.sparse as sp

from pathir.analyses.unit_rows import CompactRows

__all__ = [
    "degenerate_units", "pad", "Pairs", "LeaveOrder", "group_pairs", "group_compact", "greedy_coloring", "segment_logsumexp",
    "SideSums", "side_sums", "all_pairs", "log_pair_total", "pair_terms", "Block", "blocks_of", "PairExtremes",
    "least_positive",
]

# A linear-domain sum below this (relative to its static bound 1) may have lost
# terms to underflow: recompute it in log-space.
_TINY = 1e-280


def degenerate_units(positive: np.ndarray | None, enter: np.ndarray, leave: np.ndarray, H: int) -> np.ndarray:
    """Units with no positive mass on their whole incoming or whole outgoing side (sorted).

    ``positive`` masks the rows with mass > 0 (None: all of them).
    """
    if positive is not None:
        enter, leave = enter[positive], leave[positive]
    has_in = np.bincount(enter, minlength=H + 1)[:H] > 0
    has_out = np.bincount(leave, minlength=H + 1)[:H] > 0
    return np.flatnonzero(~(has_in & has_out))


def pad(z: np.ndarray) -> np.ndarray:
    """z with the trailing 0 of "no unit"."""
    return np.append(z, 0.0)


def segment_logsumexp(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """log Σ exp over the contiguous, non-empty segments beginning at ``starts``."""
    top = np.maximum.reduceat(values, starts)
    lengths = np.diff(np.append(starts, values.size))
    with np.errstate(divide="ignore"):
        return top + np.log(np.add.reduceat(np.exp(values - np.repeat(top, lengths)), starts))


class Pairs:
    """Distinct (entered, left) unit pairs, sorted by (enter, leave), with masses P_k > 0.

    ``log_mass`` = log P_k. ``mass``, when not None, is P_k / max P in the
    linear domain (every P_k within 1e-282 of the max) and ``log_top`` = log
    max P; ``log_mass`` is then derived from them on first use.
    """

    def __init__(self, log_mass, enter: np.ndarray, leave: np.ndarray, num_units: int,
                 mass: np.ndarray | None = None, log_top: float | None = None):
        if log_mass is None and (mass is None or log_top is None):
            raise ValueError("Pairs needs log_mass, or mass with log_top")
        self._log_mass = log_mass
        self.enter, self.leave, self.num_units, self.mass = enter, leave, num_units, mass
        if log_top is None:
            log_top = float(log_mass.max(initial=-math.inf))
        self.log_top = log_top

    @property
    def size(self) -> int:
        return int(self.enter.size)

    @property
    def log_mass(self) -> np.ndarray:
        if self._log_mass is None:
            self._log_mass = np.log(self.mass) + self.log_top
        return self._log_mass

    @cached_property
    def by_leave(self) -> "LeaveOrder":
        """The pairs sorted by (leave, enter), by a counting sort."""
        H = self.num_units
        indptr = np.searchsorted(self.enter, np.arange(H + 2))
        # CSR -> CSC moves every entry to its column in row order: a stable counting sort by leave
        by_column = sp.csr_array((np.arange(self.size), self.leave, indptr), shape=(H + 1, H + 1)).tocsc()
        leave = np.repeat(np.arange(H + 1), np.diff(by_column.indptr))
        return LeaveOrder(by_column.data, leave, by_column.indices.astype(np.int64))

    def drop_leave_order(self) -> None:
        """Free :attr:`by_leave` (three arrays of the pairs' size; built again if asked for)."""
        self.__dict__.pop("by_leave", None)

    def __repr__(self) -> str:
        return f"Pairs({self.size} pairs over {self.num_units} units)"

    def degenerate(self) -> np.ndarray:
        """Units missing from the entered side or from the left side of every pair."""
        return degenerate_units(None, self.enter, self.leave, self.num_units)

    def freeze(self, units) -> "Pairs":
        """The pairs with ``units`` read as "no unit" (their z fixed at 0), regrouped: only the pairs
        touching them are sorted again, then merged into the others (already sorted and distinct)."""
        units = np.asarray(units, dtype=np.int64)
        if units.size == 0 or self.size == 0:
            return self
        H, width = self.num_units, self.num_units + 1
        remap = np.arange(H + 1)
        remap[units] = H
        moved = (remap[self.enter] != self.enter) | (remap[self.leave] != self.leave)
        if not moved.any():
            return self
        kept = ~moved
        keys, log_mass = self.enter[kept] * width + self.leave[kept], self.log_mass[kept]
        key = remap[self.enter[moved]] * width + remap[self.leave[moved]]
        order = np.argsort(key, kind="stable")
        sk = key[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        new_keys, new_log = sk[starts], segment_logsumexp(self.log_mass[moved][order], starts)
        at = np.searchsorted(keys, new_keys)
        same = at < keys.size
        same[same] = keys[at[same]] == new_keys[same]
        log_mass[at[same]] = np.logaddexp(log_mass[at[same]], new_log[same])  # a pair it regrouped onto
        keys = np.insert(keys, at[~same], new_keys[~same])
        return Pairs(np.insert(log_mass, at[~same], new_log[~same]), keys // width, keys % width, H)


@dataclass(frozen=True)
class LeaveOrder:
    """Pairs in (leave, enter) order: ``order`` indexes the (enter, leave)-sorted pairs; ``leave``
    and ``enter`` are their ends in that order."""

    order: np.ndarray
    leave: np.ndarray
    enter: np.ndarray


# masses within this factor of the largest are summed in the linear domain
_LINEAR_RANGE = 1e-282


def group_pairs(m: np.ndarray, key, H: int) -> Pairs:
    """Group the rows with mass m_i > 0 by unit pair (``key`` from `unit_rows.row_keys`, or a
    `unit_rows.CompactRows`: then param by param, `group_compact`).

    Sums are linear (one bincount) when the masses span less than ~650 nats,
    and grouped log-sum-exps otherwise, so no mass is lost to underflow.
    """

    if isinstance(key, CompactRows):
        return group_compact(m, key)
    low = m.min(initial=math.inf)
    if not low > 0:
        pos = m > 0
        m, key = m[pos], key[pos]
        low = m.min(initial=math.inf)
    if m.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Pairs(np.zeros(0), empty, empty, H)
    top = float(m.max())
    if low > top * _LINEAR_RANGE:
        # sum m as is when neither the total can overflow nor a summand is subnormal
        scale = 1.0 if top * m.size < 1e300 and low > 1e-290 else top
        w = m if scale == 1.0 else m / scale
        if (H + 1) ** 2 <= 1 << 22:  # a grid of at most 32 MB; larger ones cost more than summing runs
            sums = np.bincount(key, weights=w, minlength=(H + 1) ** 2)
            keys = np.flatnonzero(sums != 0)
            total = sums[keys]
        else:
            keys, total = _sum_by_key(key, w)
        big = float(total.max())
        pairs = (None, total / big, math.log(big) + math.log(scale))
    else:
        order = np.argsort(key, kind="stable")
        sk = key[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        keys = sk[starts]
        pairs = (segment_logsumexp(np.log(m[order]), starts), None, None)
    # keys are sorted: the entered unit of each from where its row of the (H + 1)² key grid begins
    bounds = np.searchsorted(keys, np.arange(H + 2) * (H + 1))
    enter = np.repeat(np.arange(H + 1), np.diff(bounds))
    leave = keys - enter * (H + 1)
    return Pairs(pairs[0], enter, leave, H, *pairs[1:])


def _sum_by_key(key: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct keys in increasing order, the sum of w over each). The keys come in long
    non-decreasing runs (a parameter's rows), so w is first summed over each stretch of equal
    consecutive keys (no sort, no gather of the n rows), and only those partial sums are sorted."""
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    part_keys, part = key[starts], np.add.reduceat(w, starts)
    if np.all(part_keys[1:] > part_keys[:-1]):
        return part_keys, part
    order = np.argsort(part_keys, kind="stable")  # sorted runs: timsort's best case
    sk = part_keys[order]
    starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
    return sk[starts], np.add.reduceat(part[order], starts)


def _pairs_from_sums(keys: np.ndarray, total: np.ndarray, scale: float, H: int) -> Pairs:
    """Pairs of the sorted distinct ``keys`` with linear sums ``total`` (all > 0) of masses / ``scale``."""
    big = float(total.max())
    enter, leave = ends_of_keys(keys, H)
    total /= big  # the caller's own merged sums
    return Pairs(None, enter, leave, H, total, math.log(big) + math.log(scale))


def ends_of_keys(keys: np.ndarray, H: int, chunk: int = 1 << 18) -> tuple[np.ndarray, np.ndarray]:
    """(enter, leave) of sorted pair keys e (H + 1) + l; ``keys`` (the caller's own int64 array) becomes
    ``leave`` in place, a chunk at a time: one new array of the pairs' size, not two."""
    # sorted keys: the entered unit of each from where its row of the (H + 1)² key grid begins
    bounds = np.searchsorted(keys, np.arange(H + 2) * (H + 1))
    enter = np.repeat(np.arange(H + 1), np.diff(bounds))
    for i in range(0, keys.size, chunk):
        keys[i:i + chunk] -= enter[i:i + chunk] * (H + 1)
    return enter, keys


def _ranks(ends: np.ndarray, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """(distinct units, each entry's index among them), the latter with ``ndim`` axes."""
    values, rank = np.unique(ends, return_inverse=True)
    return values, rank.reshape((1,) * (ndim - ends.ndim) + ends.shape)


def least_positive(m: np.ndarray) -> float:
    """The smallest entry > 0 of m ≥ 0 (inf if none)."""
    low = float(m.min(initial=math.inf))
    return low if low > 0 else float(np.min(m, where=m > 0, initial=math.inf))


#: rows longer than this are reduced by numpy (its min and max run at memory speed along a long row, where
#: torch's aminmax is 2-4x slower); shorter ones, a convolution's kernel, by torch's aminmax in one pass (numpy's
#: reductions over a few trailing entries are 2x slower)
_NUMPY_ROWS = 64


def _trailing_min_max(m: np.ndarray, axes: tuple):
    """(min, max) of m over ``axes`` (kept as axes of size 1), where ``axes`` are m's last axes and m is a
    C-contiguous float64 array: m itself where they hold one entry (a 1 × 1 kernel), else in one pass over m
    (torch's aminmax) for rows of at most ``_NUMPY_ROWS`` entries where torch is already loaded; else None."""
    nd, k = m.ndim, len(axes)
    if not k or tuple(axes) != tuple(range(nd - k, nd)) or m.dtype != np.float64 or not m.flags.c_contiguous:
        return None
    width = math.prod(m.shape[nd - k:])
    if width == 1:
        return m, m
    torch = sys.modules.get("torch")
    if torch is None or width > _NUMPY_ROWS:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": only read
        rows = torch.from_numpy(m).view(-1, width)
    low, high = torch.aminmax(rows, dim=1)
    shape = m.shape[:nd - k] + (1,) * k
    return low.numpy().reshape(shape), high.numpy().reshape(shape)


def _extremes(m: np.ndarray, axes: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(min of the positive entries (inf if none), max, number of positive entries) over ``axes``."""
    both = _trailing_min_max(m, axes) if m.size else None
    # every entry positive (the usual g): no mask, no masked copy of m (the one-pass minima already tell)
    positive_everywhere = m.size > 0 and float((m if both is None else both[0]).min()) > 0
    if both is not None and positive_everywhere:  # one pass gave both
        count = math.prod(m.shape[a] for a in axes)
        return both[0], both[1], np.full(both[0].shape, count, dtype=np.int64)
    if positive_everywhere:
        if not axes:
            return m, m, np.ones(m.shape, dtype=bool)
        count = math.prod(m.shape[a] for a in axes)
        low = m.min(axis=axes, keepdims=True)
        return low, m.max(axis=axes, keepdims=True), np.full(low.shape, count, dtype=np.int64)
    positive = m > 0
    low = np.where(positive, m, math.inf)
    if not axes:
        return low, m, positive
    return low.min(axis=axes, keepdims=True), m.max(axis=axes, keepdims=True), positive.sum(axis=axes, keepdims=True)


def _runs(enter: np.ndarray, leave: np.ndarray, nd: int):
    """``(axis, starts, enter, leave)`` where one end varies along one axis (past the first) only, in runs of
    equal units each unit in one run (a flatten: every channel's positions in a row), the ends then given
    per run; None where no axis is so."""
    for ax in range(1, nd):
        for k, end in enumerate((enter, leave)):
            other = (leave, enter)[k]
            if end.ndim != nd or other.ndim != nd or other.shape[ax] != 1:
                continue
            if end.shape[ax] < 2 or any(n != 1 for i, n in enumerate(end.shape) if i != ax):
                continue
            line = end.reshape(-1)
            starts = np.flatnonzero(np.r_[True, line[1:] != line[:-1]])
            values = line[starts]
            if starts.size == line.size or np.unique(values).size != values.size:
                continue
            shape = [1] * nd
            shape[ax] = values.size
            short = values.reshape(shape)
            return (ax, starts, short, other) if k == 0 else (ax, starts, other, short)
    return None


def _place(target: np.ndarray, block: np.ndarray, rows, col_order, width: int) -> None:
    """Write a block of a param's rows into its (entered x left) table ``target`` (flat, ``width`` columns):
    ``rows`` its rows there, ``col_order`` its columns in sorted-unit order (None: already so)."""
    values = block.reshape(block.shape[0], -1)
    target.reshape(-1, width)[rows] = values if col_order is None else values[:, col_order]


class GridKeys:
    """The sorted pair keys ``rows[r] + cols[c]`` of an (entered x left) grid, row-major, not written out:
    ``rows`` = entered units x width (increasing), ``cols`` = left units (increasing, < width). The merge
    (`_merge_sorted`) reads their ends, column range and row bounds from the two short arrays and writes
    the keys straight into its result; anything else sees them as an int64 array (``np.asarray``).

    >>> k = GridKeys(np.array([0, 10]), np.array([2, 3, 5]))
    >>> np.asarray(k).tolist(), k.size, int(k[-1]), k.row_bounds(np.array([0, 10, 20])).tolist()
    ([2, 3, 5, 12, 13, 15], 6, 15, [0, 3, 6])
    """

    dtype = np.dtype(np.int64)
    ndim = 1

    def __init__(self, rows: np.ndarray, cols: np.ndarray):
        self.rows, self.cols = rows.astype(np.int64), cols.astype(np.int64)
        self.size = self.rows.size * self.cols.size
        self.shape = (self.size,)

    def __array__(self, dtype=None, copy=None):
        out = np.empty((self.rows.size, self.cols.size), dtype=np.int64)
        np.add(self.rows[:, None], self.cols[None, :], out=out)
        return out.reshape(-1) if dtype is None else out.reshape(-1).astype(dtype)

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            r, c = divmod(int(index) % self.size, self.cols.size)
            return self.rows[r] + self.cols[c]
        return np.asarray(self)[index]

    def column_range(self) -> tuple[int, int]:
        """(min, max) of the left units."""
        return int(self.cols[0]), int(self.cols[-1])

    def row_bounds(self, starts: np.ndarray) -> np.ndarray:
        """``np.searchsorted(keys, starts)`` for ``starts`` multiples of the width (row starts)."""
        return np.searchsorted(self.rows, starts) * self.cols.size

    def write_rows(self, table: np.ndarray) -> None:
        """The keys into ``table`` (rows x cols, a view: a band of the merge's result)."""
        np.add(self.rows[:, None], self.cols[None, :], out=table)


def _add_pairs(parts: dict, keys: np.ndarray, kept: list) -> None:
    """Append a param's pair keys and their sums (then lows, highs, counts) to ``parts``, the pairs
    with no mass (rows of zeros) left out."""
    if np.count_nonzero(kept[0]) != keys.size:
        keep = kept[0] != 0
        keys, kept = np.asarray(keys)[keep], [None if x is None else x[keep] for x in kept]
    parts["keys"].append(keys)
    for name, x in zip(("sums", "low", "high", "count"), kept):
        parts[name].append(x)


def _reduce_runs(block: np.ndarray, runs, ufunc=np.add) -> np.ndarray:
    return block if runs is None else ufunc.reduceat(block, runs[1], axis=runs[0])


def group_compact(m: np.ndarray, rows, extremes: bool = False):
    """`group_pairs` of m over the rows of a `unit_rows.CompactRows`, param by param: each param's
    masses are summed over the axes its two unit ends do not vary along, then by (entered, left)
    pair a block of rows at a time into that param's own small grid of pairs, so neither a key per
    row nor a (H + 1)² table is built. The same pairs and sums (up to rounding order) as
    `group_pairs` on the row keys; masses spanning beyond ~650 nats go through it (log-space sums).
    ``m``: flat in θ order, or a list of one array per param (then never concatenated in the linear case).

    ``extremes=True`` returns ``(pairs, low, high, count)``: per pair (in ``pairs`` order) the
    smallest positive m_i, the largest m_i and the number of rows with m_i > 0 (what a report on m
    under a rescaling needs once m itself is gone: m_i e^{(Bz)_i} is m_i times its pair's factor).
    ``extremes="compact"`` returns ``(pairs, PairExtremes)``: the same without the pairs made of one
    row (a dense layer's weights between unit layers, a bias), whose extremes are their mass."""
    H = rows.num_units
    pieces = m if isinstance(m, (list, tuple)) else [m]  # (per-param arrays: no flat copy of m)
    size = sum(x.size for x in pieces)
    low = min((least_positive(x) for x in pieces), default=math.inf)  # the rows with mass 0 take no part
    top = max((float(x.max()) for x in pieces if x.size), default=-math.inf)
    if not low < math.inf:
        empty = np.zeros(0, dtype=np.int64)
        pairs = Pairs(np.zeros(0), empty, empty, H)
        if extremes == "compact":
            return pairs, PairExtremes(None, np.zeros(0), np.zeros(0), empty)
        return (pairs, np.zeros(0), np.zeros(0), empty) if extremes else pairs
    if not low > top * _LINEAR_RANGE:  # log-space sums: through the row keys
        m = pieces[0].reshape(-1) if len(pieces) == 1 else np.concatenate([x.reshape(-1) for x in pieces])
        key = np.concatenate([np.broadcast_to(e * (H + 1) + l, shape).reshape(-1) for shape, e, l, _ in rows.parts(m)])
        pairs = group_pairs(m, key, H)
        if not extremes:
            return pairs
        pos = m > 0
        m, key = m[pos], key[pos]
        order = np.argsort(key, kind="stable")
        sk, m = key[order], m[order]
        starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        count = np.diff(np.append(starts, sk.size))
        found = (np.minimum.reduceat(m, starts), np.maximum.reduceat(m, starts), count)
        return (pairs, PairExtremes(None, *found)) if extremes == "compact" else (pairs, *found)
    scale = 1.0 if top * size < 1e300 and low > 1e-290 else float(top)
    parts = {"keys": [], "sums": [], "low": [], "high": [], "count": []}
    for shape, enter, leave, mk in rows.parts(m):
        nd = len(shape)
        enter, leave = np.asarray(enter), np.asarray(leave)
        runs = _runs(enter, leave, nd)  # summed run by run inside the loop: the grid is then one to one
        if runs is not None:
            enter, leave = runs[2], runs[3]
        e_units, e_rank = _ranks(np.asarray(enter), nd)
        l_units, l_rank = _ranks(np.asarray(leave), nd)
        if runs is None:  # an end with one unit throughout (a classifier's pinned outputs) varies along no axis
            e_rank, l_rank = (r if u.size != 1 else r.reshape(-1)[:1].reshape((1,) * nd)
                              for u, r in ((e_units, e_rank), (l_units, l_rank)))
        grid = np.broadcast_shapes(e_rank.shape, l_rank.shape, (1,) * nd)
        flat_axes = tuple(ax for ax in range(nd) if grid[ax] == 1 and shape[ax] != 1)
        raw = mk
        if scale != 1.0:
            mk = mk / scale
        if flat_axes:  # the ends do not vary along these axes: sum them out first
            mk = mk.sum(axis=flat_axes, keepdims=True)
        size = e_units.size * l_units.size
        if int(np.prod(grid)) * 4 < size and runs is None:
            # a sparse grid (a per-channel scale: the diagonal of its units' grid; a grouped conv): its
            # cells keyed one by one, no table of every (entered, left) combination
            cell_keys = np.broadcast_to(e_units[e_rank] * (H + 1) + l_units[l_rank], grid).reshape(-1)
            if extremes:
                lows, highs, counts = (np.broadcast_to(x, grid).reshape(-1) for x in _extremes(raw, flat_axes))
            order = np.argsort(cell_keys, kind="stable")
            ordered = cell_keys[order]
            starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
            keys = ordered[starts]
            kept = [np.add.reduceat(np.broadcast_to(mk, grid).reshape(-1)[order], starts)]
            if extremes:
                kept += [np.minimum.reduceat(lows[order], starts), np.maximum.reduceat(highs[order], starts),
                         np.add.reduceat(counts.astype(np.int32)[order], starts)]
            _add_pairs(parts, keys, kept)
            continue
        # every grid cell its own pair (distinct ends along disjoint axes: a conv, a dense layer between
        # two unit layers): the cells are placed, not reduced
        one_to_one = e_rank.size == e_units.size and l_rank.size == l_units.size and int(np.prod(grid)) == size
        # enter along the first axis, leave along at most one other (a conv, a dense layer, a bias): a block
        # of rows is placed by a row assignment (a slice where the entered units come sorted) and a column
        # permutation (none where the left units come sorted), with no per-entry index array
        placed = (one_to_one and nd >= 1 and e_rank.shape[0] == e_units.size and l_rank.shape[0] == 1
                  and sum(n != 1 for n in l_rank.shape[1:]) <= 1)
        if placed:
            row_of, col_order = e_rank.reshape(-1), np.argsort(l_rank.reshape(-1))
            rows_sorted = np.array_equal(row_of, np.arange(e_units.size))
            if np.array_equal(col_order, np.arange(l_units.size)):
                col_order = None
        # every cell one entry, unscaled (a dense layer between unit layers, a bias): each pair's extremes
        # are its sum and its count 1, taken from the sums by the merge (`_STAND_INS`), no tables
        derived = extremes and one_to_one and not flat_axes and runs is None and scale == 1.0
        # the masses already lie in the grid's row-major order (a dense layer between unit layers, its units
        # in order): the pairs' sums are a view of them, read by the merge, nothing placed
        in_order = (placed and rows_sorted and col_order is None and not flat_axes and runs is None
                    and (derived or not extremes) and mk.flags.c_contiguous)
        if in_order:
            sums = mk.reshape(-1)
            _add_pairs(parts, GridKeys(e_units * (H + 1), l_units), [sums] + ([None] * 3 if derived else []))
            continue
        sums = np.zeros(size)
        if extremes and not derived:
            low_k, high_k, count_k = np.full(size, math.inf), np.full(size, -math.inf), np.zeros(size, dtype=np.int32)
            if flat_axes:  # reduced like the sums (the grid is smaller than the param)
                reduced = _extremes(raw, flat_axes)
        row = grid if runs is None else shape  # entries read per row: the runs are summed block by block
        step = max(1, (1 << 22) // max(1, int(np.prod(row[1:])))) if nd else 1
        for i in range(0, grid[0] if nd else 1, step):
            rows_i = slice(i, i + step) if nd else ...
            block = _reduce_runs(mk[rows_i], runs)
            if placed:
                local = slice(i, i + block.shape[0]) if rows_sorted else row_of[rows_i]
                _place(sums, block, local, col_order, l_units.size)
            else:
                local = e_rank[rows_i if e_rank.shape[:1] != (1,) else slice(None)] * l_units.size \
                    + l_rank[rows_i if l_rank.shape[:1] != (1,) else slice(None)]
                local = np.broadcast_to(local, block.shape).reshape(-1)
                if one_to_one:
                    sums[local] = block.reshape(-1)
                else:
                    sums += np.bincount(local, weights=block.reshape(-1), minlength=size)
            if extremes and not derived:  # a block at a time: no temporary of the param's size
                lows, highs, counts = (r[rows_i] for r in reduced) if flat_axes else _extremes(raw[rows_i], ())
                if runs is not None:
                    lows, highs = _reduce_runs(lows, runs, np.minimum), _reduce_runs(highs, runs, np.maximum)
                    counts = _reduce_runs(counts.astype(np.int32), runs)
                if placed:
                    for target, values in ((low_k, lows), (high_k, highs), (count_k, counts)):
                        _place(target, values, local, col_order, l_units.size)
                    continue
                if one_to_one:
                    low_k[local], high_k[local], count_k[local] = lows.reshape(-1), highs.reshape(-1), counts.reshape(-1)
                    continue
                np.minimum.at(low_k, local, lows.reshape(-1))
                np.maximum.at(high_k, local, highs.reshape(-1))
                counts = counts.reshape(-1)
                count_k += (np.bincount(local[counts], minlength=size) if counts.dtype == bool  # no float weights
                            else np.bincount(local, weights=counts, minlength=size)).astype(np.int32)
        keys = GridKeys(e_units * (H + 1), l_units)  # the grid's cells, row-major (written by the merge)
        _add_pairs(parts, keys, [sums] + ([None] * 3 if derived else [low_k, high_k, count_k] if extremes else []))
    names = ("sums", "count", "low", "high") if extremes else ("sums",)
    sums = low_k = high_k = count_k = keys = None  # the merge frees each param's arrays once it is copied
    keys, merged, single = _merge_sorted(parts["keys"], [parts[name] for name in names],
                                         (np.add, np.add, np.minimum, np.maximum)[:len(names)], H + 1,
                                         _STAND_INS[:len(names)] if extremes else None)
    if extremes == "compact":  # (single pairs: their sum is their extreme, read back from pairs.mass)
        found = PairExtremes(single if single.any() else None, merged[2], merged[3], merged[1])
        return _pairs_from_sums(keys, merged[0], scale, H), found
    if extremes:  # every pair's own: the single ones' extremes are their (unscaled: scale 1) sums
        full = [_expand(single, x, merged[0] if x.dtype.kind == "f" else 1) for x in merged[1:]]
        return _pairs_from_sums(keys, merged[0], scale, H), full[1], full[2], full[0]  # counts as int32
    return _pairs_from_sums(keys, merged[0], scale, H)


def _expand(single: np.ndarray, compact: np.ndarray, stand) -> np.ndarray:
    """A per-pair array from the values of the pairs not ``single`` and ``stand`` (array or scalar) at those."""
    out = np.empty(single.size, dtype=compact.dtype)
    out[~single] = compact
    out[single] = stand[single] if isinstance(stand, np.ndarray) else stand
    return out


@dataclass(frozen=True, eq=False)
class PairExtremes:
    """Per unit pair (in ``pairs`` order), what a report on m under a rescaling needs: the smallest
    positive m_i, the largest m_i and the number of rows with m_i > 0. ``single`` (bool per pair, or
    None for none): pairs made of one row, whose extremes are their mass and count 1, not stored;
    ``low``, ``high``, ``count`` hold the other pairs', in order."""

    single: np.ndarray | None
    low: np.ndarray
    high: np.ndarray
    count: np.ndarray


#: group_compact's per-pair (sums, count, low, high) of a pair made of one row: its count is 1 and its
#: extremes are its sum (None in a value list stands for these, computed from the member's first list)
_STAND_INS = (None, lambda sums: np.broadcast_to(np.int32(1), sums.shape), lambda sums: sums, lambda sums: sums)


def _fold_equal_keys(members: list, keys: list, values: list, reduces: tuple, get) -> list:
    """``members`` with those holding the very same keys (a layer's weights and bias entering the same
    units from the input) reduced into the first of them, entry by entry (``keys``/``values`` updated;
    ``get(list, member)``: a member's values, stand-ins resolved)."""
    kept = []
    for i in members:
        twin = next((j for j in kept if _same_keys(keys[j], keys[i])), None)
        if twin is None:
            kept.append(i)
            continue
        pairs = [(get(v, twin), get(v, i)) for v in range(len(values))]  # all read before any is replaced
        for vals, reduce, (a, b) in zip(values, reduces, pairs):
            vals[twin] = reduce(a, b)
    return kept


def _same_keys(a, b) -> bool:
    if a.size != b.size:
        return False
    if isinstance(a, GridKeys) and isinstance(b, GridKeys):
        return np.array_equal(a.rows, b.rows) and np.array_equal(a.cols, b.cols)
    return np.array_equal(np.asarray(a), np.asarray(b))


def _column_range(keys: np.ndarray, width: int, chunk: int = 1 << 16) -> tuple[int, int]:
    """(min, max) of keys % width (the left units), a cache-sized chunk at a time into one buffer."""
    if isinstance(keys, GridKeys):
        return keys.column_range()
    buf = np.empty(min(chunk, keys.size), dtype=keys.dtype)
    low, high = None, None
    for i in range(0, keys.size, chunk):
        part = np.remainder(keys[i:i + chunk], width, out=buf[:min(chunk, keys.size - i)])
        a, b = int(part.min()), int(part.max())
        low, high = (a, b) if low is None else (min(low, a), max(high, b))
    return low, high


def _row_pieces(members: list, keys: list, width: int):
    """Where ``members``' left units (key % width) lie in disjoint ranges, each entered unit's row of the
    merge is each member's run of that row, in the order of those ranges. Returns None where the ranges
    overlap; ``("rect", [(member, columns), ...])`` where every member has the same rows and a constant
    number of columns in each (a residual stream's convolutions and bias: the merge is then a table of
    those rows, each member a band of columns); else ``("runs", [(member, start, stop), ...])``, the
    runs in merged order."""
    spans = sorted((*_column_range(keys[i], width), i) for i in members)
    if any(spans[a][1] >= spans[a + 1][0] for a in range(len(spans) - 1)):
        return None
    order = [i for _, _, i in spans]
    first = min(int(keys[i][0]) // width for i in order)
    size = max(int(keys[i][-1]) // width for i in order) - first + 1
    # the keys are sorted, so each row's run starts where the keys pass row x width: no division of them all
    starts = np.arange(first, first + size + 1, dtype=np.int64) * width
    bounds = {i: keys[i].row_bounds(starts) if isinstance(keys[i], GridKeys) else np.searchsorted(keys[i], starts)
              for i in order}
    counts = {i: np.diff(b) for i, b in bounds.items()}
    present = counts[order[0]] > 0
    columns = [(i, int(counts[i][present][0])) for i in order]
    if all(np.array_equal(counts[i], np.where(present, w, 0)) for i, w in columns):
        return ("rect", columns)
    bounds = {i: b.tolist() for i, b in bounds.items()}
    return ("runs", [(i, bounds[i][r], bounds[i][r + 1]) for r in range(size) for i in order
                     if bounds[i][r + 1] > bounds[i][r]])


def _merge_sorted(keys: list, values: list, reduces: tuple, width: int, stand_ins: tuple | None = None):
    """``(keys, outs, single)``: the union of the strictly increasing key arrays ``keys`` (entered unit x
    ``width`` + left unit) in increasing order, and for each list in ``values`` (one array per key
    array) its values reduced over equal keys with its ufunc.

    ``stand_ins``: a member whose ``values[1]`` is None is a stand-in member (every list past the first
    None for it); ``stand_ins[v]`` gives its values of list v from its ``values[0]`` where they must be
    reduced with another member's (equal keys: folded or sorted). The lists past the first then hold
    only the other pairs, in merged order, and ``single`` (bool, one per merged pair) marks the pairs
    of stand-in members; without ``stand_ins`` every list holds every pair and ``single`` is None.

    Arrays whose key ranges overlap no other's are copied as they are; arrays holding the very same
    keys are reduced entry by entry (a layer's weights and bias from the input); overlapping ones are
    woven row by row where their left units lie in disjoint ranges (`_row_pieces`: the convolutions
    writing into one residual stream, a layer's weights and its bias); only the rest are sorted.
    Each piece is written once, into the preallocated result, and each cluster's arrays are released
    from ``keys`` and ``values`` (set to None) once written: the result's pages then reuse theirs
    instead of adding a second copy of every pair to the peak.
    """
    compact = stand_ins is not None
    if not keys:
        return np.zeros(0, dtype=np.int64), [np.zeros(0) for _ in values], (np.zeros(0, bool) if compact else None)

    def get(v: int, i: int):
        got = values[v][i]
        return stand_ins[v](values[0][i]) if got is None else got

    def stand_in(i: int) -> bool:
        return compact and values[1][i] is None

    spans = sorted((int(k[0]), int(k[-1]), i) for i, k in enumerate(keys) if k.size)
    clusters, current, reach = [], [], -1
    for low, high, i in spans:
        if current and low > reach:
            clusters.append(current)
            current = []
        current.append(i)
        reach = max(reach, high)
    if current:
        clusters.append(current)
    plans = []  # per cluster: ("runs", cluster, pieces) | ("rect", cluster, bands) | ("sort", cluster, ...)
    total = explicit = 0
    for cluster in clusters:
        members = _fold_equal_keys(cluster, keys, values, reduces, get)
        woven = _row_pieces(members, keys, width) if len(members) > 1 else ("runs", [(members[0], 0, keys[members[0]].size)])
        if woven is not None:
            plans.append((woven[0], cluster, woven[1]))
            total += _woven_size(woven[0], woven[1], keys)
            explicit += _woven_size(woven[0], [x for x in woven[1] if not stand_in(x[0])], keys)
            continue
        k = np.concatenate([keys[i] for i in members])
        order = np.argsort(k, kind="stable")
        k = k[order]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        plans.append(("sort", cluster, k[starts], order, starts, members))
        total += starts.size
        explicit += starts.size
    live = [i for i, k in enumerate(keys) if k is not None]
    out_keys = np.empty(total, dtype=np.result_type(*(k.dtype for k in keys if k is not None)))
    outs = [np.empty(total if v == 0 or not compact else explicit, dtype=np.result_type(*(get(v, i) for i in live)))
            for v in range(len(values))]
    single = np.zeros(total, dtype=bool) if compact else None
    full = [out_keys, outs[0]] if compact else [out_keys, *outs]  # the lists every pair is written to
    full_sources = [lambda i: keys[i]] + [lambda i, v=v: get(v, i) for v in range(len(full) - 1)]
    at = ct = 0  # next pair, next pair of a member that is no stand-in
    for plan in plans:
        if plan[0] in ("runs", "rect"):
            kind, pieces = plan[0], plan[2]
            fill = _fill_runs if kind == "runs" else _fill_rect
            size = _woven_size(kind, pieces, keys)
            for out, source in zip(full, full_sources):
                fill(out[at:at + size], pieces, source)
            if compact:  # the other lists take the members that are no stand-in; the mask marks the rest
                kept = [x for x in pieces if not stand_in(x[0])]
                step = _woven_size(kind, kept, keys)
                if step:
                    for v in range(1, len(values)):
                        fill(outs[v][ct:ct + step], kept, lambda i, v=v: values[v][i])
                fill(single[at:at + size], pieces, lambda i: np.broadcast_to(stand_in(i), keys[i].shape))
                ct += step
        else:
            _, _, merged_keys, order, starts, members = plan
            size = merged_keys.size
            out_keys[at:at + size] = merged_keys
            for v, (out, reduce) in enumerate(zip(outs, reduces)):
                lo = ct if compact and v else at
                out[lo:lo + size] = reduce.reduceat(np.concatenate([get(v, i) for i in members])[order], starts)
            ct += size
        for source in (keys, *values):  # written: free this cluster's arrays before the next is copied
            for i in plan[1]:
                source[i] = None
        at += size
    return out_keys, outs, single


def _woven_size(kind: str, pieces: list, keys: list) -> int:
    """Pairs written by a woven plan's ``pieces``: runs (member, start, stop), or rect bands (member, width)."""
    return sum(b - a for _, a, b in pieces) if kind == "runs" else sum(keys[i].size for i, _ in pieces)


def _fill_runs(out: np.ndarray, pieces: list, source) -> None:
    """``out`` ← the runs (member, start, stop) of ``source(member)``, one after the other."""
    if len(pieces) == 1 and isinstance(source(pieces[0][0]), GridKeys) and pieces[0][1] == 0 \
            and pieces[0][2] == out.size == source(pieces[0][0]).size:  # one whole grid: written in place
        grid = source(pieces[0][0])
        grid.write_rows(out.reshape(grid.rows.size, grid.cols.size))
        return
    np.concatenate([_run(source(i), a, b) for i, a, b in pieces], out=out)


def _run(values, a: int, b: int) -> np.ndarray:
    """values[a:b]; of `GridKeys`, only the rows it spans are written out."""
    if not isinstance(values, GridKeys):
        return values[a:b]
    width = values.cols.size
    first, last = a // width, -(-b // width)
    part = np.asarray(GridKeys(values.rows[first:last], values.cols))
    return part[a - first * width:b - first * width]


def _fill_rect(out: np.ndarray, bands: list, source) -> None:
    """``out`` as a table of rows × Σ widths ← each band (member, width) of ``source(member)``, in turn."""
    table, left = out.reshape(-1, sum(w for _, w in bands)), 0
    for i, w in bands:
        values = source(i)
        if isinstance(values, GridKeys) and values.cols.size == w:
            values.write_rows(table[:, left:left + w])
        else:
            table[:, left:left + w] = np.asarray(values).reshape(-1, w)
        left += w


def greedy_coloring(pairs: Pairs, active: np.ndarray) -> np.ndarray:
    """Colour per unit (-1 for inactive ones) such that no pair joins two active units of one colour.

    Greedy in unit order: each unit takes the smallest colour unused by its
    lower-numbered neighbours (layered networks, numbered layer by layer, get
    two colours). Computed run by run: a run of consecutive units none of which
    neighbours another unit of the run has all its lower neighbours coloured
    before it, so the whole run is coloured at once.
    """
    H = pairs.num_units
    active_pad, every = np.append(active, False), bool(active.all())
    # each edge once, grouped by its higher end: from the enter-sorted pairs where enter > leave,
    # from the leave-sorted pairs where leave > enter ("no unit" = H is never the lower end)
    sides = []
    for hi, lo in ((pairs.enter, pairs.leave), (pairs.by_leave.leave, pairs.by_leave.enter)):
        keep = (hi > lo) & (hi < H) if every else (hi > lo) & active_pad[hi] & active_pad[lo]
        hi, lo = hi[keep], lo[keep]
        sides.append((hi, lo, np.searchsorted(hi, np.arange(H + 1))))
    max_low = np.full(H, -1, dtype=np.int64)
    for hi, lo, bounds in sides:
        has = np.flatnonzero(bounds[1:] > bounds[:-1])
        if has.size:
            max_low[has] = np.maximum(max_low[has], np.maximum.reduceat(lo, bounds[has]))
    run_starts, start = [], 0
    for u, low in enumerate(max_low.tolist()):
        if low >= start:
            run_starts.append(start)
            start = u
    run_starts.append(start)
    colour = np.full(H, -1, dtype=np.int64)
    for a, b in zip(run_starts, run_starts[1:] + [H]):
        width = int(colour.max(initial=-1)) + 2
        used = np.zeros((b - a) * width, dtype=bool)
        for hi, lo, bounds in sides:
            k = slice(bounds[a], bounds[b])
            used[(hi[k] - a) * width + colour[lo[k]]] = True
        colour[a:b] = np.argmin(used.reshape(b - a, width), axis=1)  # the first colour no lower neighbour has
    colour[~active] = -1
    return colour


@dataclass(frozen=True)
class SideSums:
    """Row sums log Σ_{k in row r} P_k e^{f[col_k]} for a fixed pattern of (row, col, log P_k).

    Evaluated as one sparse mat-vec on P_k / max_row P (static) times
    e^{f - max f}; rows whose linear sum might have underflowed are redone in
    log-space, so the result is exact for any spread of P and f.
    """

    rows: np.ndarray
    matrix: sp.csr_array
    log_data: np.ndarray | None  # log P_k in matrix order; None: log(data) + row_top is exact
    row_top: np.ndarray
    starts: np.ndarray

    def __call__(self, f: np.ndarray) -> np.ndarray:
        shift = f.max()
        with np.errstate(divide="ignore"):
            out = self.row_top + shift + np.log(self.matrix @ np.exp(f - shift))
        bad = ~(out - self.row_top - shift > math.log(_TINY))
        if bad.any():
            log_data = self.log_data
            if log_data is None:
                log_data = np.log(self.matrix.data) + np.repeat(self.row_top, np.diff(self.matrix.indptr))
            exact = segment_logsumexp(log_data + f[self.matrix.indices], self.starts)
            out[bad] = exact[bad]
        return out


def side_sums(row: np.ndarray, col: np.ndarray, log_mass: np.ndarray | None, num_cols: int,
              mass: np.ndarray | None = None, log_top: float = 0.0) -> SideSums:
    """The SideSums of pairs given with ``row`` non-decreasing; ``rows`` lists the distinct row ids.

    P_k is given as ``log_mass``, or as linear ``mass`` = P_k e^{-log_top} with every
    entry above 1e-282 of the largest (`Pairs.mass`), which skips the exponentials.
    """
    if row.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return SideSums(empty, sp.csr_array((0, num_cols)), np.zeros(0), np.zeros(0), empty)
    starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
    lengths = np.diff(np.append(starts, row.size))
    if mass is not None:
        row_max = np.maximum.reduceat(mass, starts)
        data = mass / np.repeat(row_max, lengths)
        row_top = np.log(row_max) + log_top
    else:
        row_top = np.maximum.reduceat(log_mass, starts)
        data = np.exp(log_mass - np.repeat(row_top, lengths))
    indptr = np.append(starts, row.size)
    matrix = sp.csr_array((data, col, indptr), shape=(starts.size, num_cols))
    return SideSums(row[starts], matrix, None if mass is not None else log_mass, row_top, starts)


def _masses(pairs: Pairs, order) -> tuple:
    """(log_mass or None, mass or None) of the pairs in ``order`` (a slice, index or mask): the log
    masses only where the linear ones are missing."""
    if pairs.mass is not None:
        return None, pairs.mass[order]
    return pairs.log_mass[order], None


def all_pairs(pairs: Pairs) -> SideSums:
    """Every pair as one SideSums (rows = left unit, cols = entered unit), for `log_pair_total`."""
    by_leave = pairs.by_leave
    log_mass, mass = _masses(pairs, by_leave.order)
    return side_sums(by_leave.leave, by_leave.enter, log_mass, pairs.num_units + 1, mass, pairs.log_top)


def pair_terms(pairs: Pairs, z_padded: np.ndarray) -> tuple[float, np.ndarray]:
    """``(c, t)`` with P_k e^{z_leave - z_enter} = t_k e^c for every pair, max t = 1.

    Linear (exponentials of the H + 1 log-scales only) when ``pairs.mass`` is
    set and the spread of z cannot push a term below the float64 range;
    exponentials of every log-term otherwise.
    """
    if pairs.size == 0:
        return -math.inf, np.zeros(0)
    if pairs.mass is not None:
        high, low = float(z_padded.max()), float(z_padded.min())
        if 2.0 * (high - low) < math.log(float(pairs.mass.min())) + 690.0:
            # P e^{z_l - z_e} = P_top mass e^{z_l - high} e^{low - z_e} e^{high - low}, each factor in (1e-300, 1]
            t = pairs.mass * np.exp(z_padded - high)[pairs.leave] * np.exp(low - z_padded)[pairs.enter]
            top = float(t.max())
            return pairs.log_top + (high - low) + math.log(top), t / top
    v = pairs.log_mass + z_padded[pairs.leave] - z_padded[pairs.enter]
    top = float(v.max())
    return top, np.exp(v - top)


def log_pair_total(sums: SideSums, z_padded: np.ndarray) -> float:
    """log Σ_k P_k e^{z_leave - z_enter} over the pairs of ``sums`` (rows = left unit, cols = entered unit)."""
    if sums.rows.size == 0:
        return -math.inf
    v = sums(-z_padded) + z_padded[sums.rows]
    top = float(v.max())
    return top + math.log(float(np.exp(v - top).sum()))


@dataclass(frozen=True)
class Block:
    """One independent set of units and the pair sums its update reads.

    ``outgoing(f)[j]`` = log Σ_{pairs leaving units[j]} P_k e^{f[other end]},
    ``incoming(f)[j]`` likewise over the pairs entering units[j]; ``rest`` holds
    the pairs touching no unit of the block, rows = left unit, cols = entered unit.
    """

    units: np.ndarray
    outgoing: SideSums
    incoming: SideSums
    rest: SideSums

    def rest_log(self, z_padded: np.ndarray) -> float:
        """log Σ_{rest pairs} P_k e^{z_leave - z_enter}."""
        return log_pair_total(self.rest, z_padded)


def _part(values: np.ndarray | None, keep) -> np.ndarray | None:
    return None if values is None else values[keep]


def blocks_of(pairs: Pairs, colour: np.ndarray) -> list[Block]:
    """The Blocks of a colouring (``colour[h] = -1``: unit not updated)."""
    H = pairs.num_units
    num = int(colour.max(initial=-1)) + 1
    colour_pad = np.append(colour, -1)
    # position of each unit within its colour, the block's row index
    local = np.zeros(H + 1, dtype=np.int64)
    for c in range(num):
        units = np.flatnonzero(colour == c)
        local[units] = np.arange(units.size)
    e_col = colour_pad[pairs.enter]
    by_leave = pairs.by_leave
    leave_s, enter_s = by_leave.leave, by_leave.enter
    log_s, mass_s = _masses(pairs, by_leave.order)
    l_col_s, e_col_s = colour_pad[leave_s], colour_pad[enter_s]
    top = pairs.log_top
    blocks = []
    for c in range(num):
        units = np.flatnonzero(colour == c)
        out_k, in_k = l_col_s == c, e_col == c
        rest_k = ~out_k & (e_col_s != c)
        outgoing = side_sums(local[leave_s[out_k]], enter_s[out_k], _part(log_s, out_k), H + 1,
                             _part(mass_s, out_k), top)
        log_in, mass_in = _masses(pairs, in_k)
        incoming = side_sums(local[pairs.enter[in_k]], pairs.leave[in_k], log_in, H + 1, mass_in, top)
        rest = side_sums(leave_s[rest_k], enter_s[rest_k], _part(log_s, rest_k), H + 1, _part(mass_s, rest_k), top)
        for side in (outgoing, incoming):
            if side.rows.size != units.size:
                raise ValueError(f"colour {c}: a unit has no mass on one side (it should have been found degenerate)")
        blocks.append(Block(units, outgoing, incoming, rest))
    return blocks
