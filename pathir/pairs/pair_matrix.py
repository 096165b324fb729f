"""The unit pairs' masses as a matrix M[e_k, l_k] = mass_k, for fast mat-vecs (docs/math.md §8).

A convolution or dense layer gives every one of its output units a pair with
every one of its input units, and the pairs come sorted by (enter, leave): the
rows of M of such a layer are consecutive and hold the same columns. Runs of
consecutive rows with identical column sets are kept as dense blocks (views of
the masses, no copy; one BLAS mat-vec each; small blocks of one shape copied
into a stack, one batched call for all), the remaining rows as one CSR
matrix. ``M @ x`` and ``Mᵀ @ y`` are then exact sums of the same terms as the
CSR of every pair would give, in another order; the dense blocks save the
column indices' memory traffic and the per-point rebuilds of a CSR.

>>> import numpy as np
>>> enter, leave = np.array([0, 0, 1, 1, 2]), np.array([1, 2, 1, 2, 0])
>>> M = PairMatrix(enter, leave, np.array([1.0, 2.0, 3.0, 4.0, 5.0]), 3, min_block=4)
>>> len(M.blocks), M(np.ones(3)).tolist(), M.T(np.ones(3)).tolist()
(1, [3.0, 7.0, 5.0], [5.0, 4.0, 6.0])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

__all__ = ["PairMatrix", "DenseBlock"]

#: a run of rows becomes a dense block from this many entries on (fewer: the CSR's per-call cost wins)
MIN_BLOCK = 4096
#: dense blocks of one shape below this many entries are copied into one stack (a batched BLAS call
#: for all of them instead of one call each: the grouped and pointwise layers of a small network)
STACK_BELOW = 1 << 16
#: rows of a block read at a time by `PairMatrix.both`: a few MB, still in the last-level cache for the
#: second product, large enough that each BLAS call runs at memory speed (256 KB chunks ran at half of it)
_CHUNK_BYTES = 1 << 22


@dataclass(frozen=True)
class DenseBlock:
    """Rows ``first:first + values.shape[0]`` of M, non-zero exactly at ``cols`` (a slice when contiguous)."""

    first: int
    cols: slice | np.ndarray
    values: np.ndarray

    @property
    def rows(self) -> slice:
        return slice(self.first, self.first + self.values.shape[0])


class PairMatrix:
    """M (size x size) with M[enter_k, leave_k] = mass_k for pairs sorted by (enter, leave), distinct.

    ``M(x)`` = M @ x, ``M.T(y)`` = Mᵀ @ y and ``M.both(x, y)`` = both in one pass.
    """

    def __init__(self, enter: np.ndarray, leave: np.ndarray, mass: np.ndarray, size: int, min_block: int | None = None):
        self.size = size
        min_block = MIN_BLOCK if min_block is None else min_block
        indptr = np.searchsorted(enter, np.arange(size + 1))
        lengths = np.diff(indptr)
        same_next = _same_as_next_row(leave, indptr, lengths)
        starts = np.flatnonzero(np.r_[True, ~same_next[:-1]]) if size else np.zeros(0, dtype=np.int64)
        ends = np.r_[starts[1:], size].astype(np.int64)
        blocks, in_block = [], np.zeros(size, dtype=bool)
        for a, b in zip(starts.tolist(), ends.tolist()):
            width = int(lengths[a])
            if width == 0 or (b - a) * width < min_block:
                continue
            lo, hi = int(indptr[a]), int(indptr[b])
            cols = leave[lo:lo + width]
            if int(cols[-1]) - int(cols[0]) + 1 == width:  # sorted and distinct: contiguous iff it spans width
                cols = slice(int(cols[0]), int(cols[0]) + width)
            blocks.append(DenseBlock(a, cols, mass[lo:hi].reshape(b - a, width)))
            in_block[a:b] = True
        keep = ~in_block[enter]
        self.blocks = blocks
        self.rest = sp.csr_array((mass[keep], (enter[keep], leave[keep])), shape=(size, size))
        self._rest_t = self.rest.T  # its transpose (a CSC view of the same arrays), made once, not per product
        by_shape: dict[tuple, list] = {}
        for blk in blocks:
            if blk.values.size < STACK_BELOW:
                by_shape.setdefault(blk.values.shape, []).append(blk)
        stacked = [group for group in by_shape.values() if len(group) > 1]
        self._stacks = [_Stack.of(group, size) for group in stacked]
        in_stack = {id(blk) for group in stacked for blk in group}
        self._alone = [blk for blk in blocks if id(blk) not in in_stack]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """M @ x."""
        y = self.rest @ x
        for blk in self._alone:
            y[blk.rows] = blk.values @ x[blk.cols]
        for stack in self._stacks:
            y[stack.rows] = stack.times(x)
        return y

    def T(self, y: np.ndarray) -> np.ndarray:
        """Mᵀ @ y."""
        x = self._rest_t @ y
        for blk in self._alone:
            x[blk.cols] += blk.values.T @ y[blk.rows]
        for stack in self._stacks:
            x += stack.transposed_times(y)
        return x

    def both(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(M @ x, Mᵀ @ y) in one pass over the blocks: each chunk of rows, read for the first
        product, is still in cache for the second (half the memory traffic of two passes)."""
        mx, my = self.rest @ x, self._rest_t @ y
        for stack in self._stacks:
            mx[stack.rows] = stack.times(x)
            my += stack.transposed_times(y)
        for blk in self._alone:
            values, xs, first = blk.values, x[blk.cols], blk.first
            rows, width = values.shape
            step = max(1, _CHUNK_BYTES // (values.itemsize * width))
            if step >= rows:
                mx[blk.rows] = values @ xs
                my[blk.cols] += values.T @ y[blk.rows]
                continue
            acc = np.zeros(width, dtype=my.dtype)
            for a in range(0, rows, step):
                chunk = values[a:a + step]
                mx[first + a:first + a + chunk.shape[0]] = chunk @ xs
                acc += chunk.T @ y[first + a:first + a + chunk.shape[0]]
            my[blk.cols] += acc
        return mx, my

    def grouped(self, x: np.ndarray, w: np.ndarray, groups: np.ndarray, m1: int) -> np.ndarray:
        """T (m1 x m1) with T[a, b] = Σ w_r M[r, c] x_c over the rows r of group a and the columns c of
        group b (``groups`` one per row/column, in [0, m1)): the terms w_r M[r, c] x_c summed by group
        pair, at the cost of one M @ x (each dense block's columns split into runs of one group)."""
        plan = self._group_plan(groups)
        table = np.zeros(m1 * m1)
        for blk, row_groups, runs in plan.blocks:
            rows = blk.rows
            xs = x[blk.cols]
            wr = w[rows]
            for start, stop, b in runs:
                y = blk.values[:, start:stop] @ xs[start:stop]
                y *= wr
                if row_groups.size == 1:
                    table[int(row_groups[0]) * m1 + b] += float(y.sum())
                else:
                    table += np.bincount(row_groups * m1 + b, weights=y, minlength=m1 * m1)
        rest = self.rest
        if rest.nnz:
            terms = rest.data * w[plan.rest_rows] * x[rest.indices]
            table += np.bincount(groups[plan.rest_rows] * m1 + groups[rest.indices], weights=terms, minlength=m1 * m1)
        return table.reshape(m1, m1)

    def _group_plan(self, groups: np.ndarray) -> "_GroupPlan":
        cached = getattr(self, "_plan", None)
        if cached is not None and cached.groups is groups:
            return cached
        blocks = []
        for blk in self.blocks:
            cols = np.arange(self.size)[blk.cols]
            col_groups = groups[cols]
            cut = np.flatnonzero(np.diff(col_groups)) + 1
            starts, stops = np.r_[0, cut], np.r_[cut, cols.size]
            runs = [(int(a), int(b), int(col_groups[a])) for a, b in zip(starts, stops)]
            row_groups = groups[blk.rows]
            if np.all(row_groups == row_groups[0]):
                row_groups = row_groups[:1]
            blocks.append((blk, row_groups, runs))
        rest_rows = np.repeat(np.arange(self.size), np.diff(self.rest.indptr))
        self._plan = _GroupPlan(groups, blocks, rest_rows)
        return self._plan


@dataclass(frozen=True)
class _Stack:
    """Dense blocks of one shape R x W copied into ``values`` (G, R, W): block g holds rows ``rows[g]`` and
    columns ``cols[g]`` of M (rows distinct over the stack; columns may repeat across blocks)."""

    values: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    size: int

    @classmethod
    def of(cls, blocks: list, size: int) -> "_Stack":
        every = np.arange(size)
        return cls(np.stack([blk.values for blk in blocks]), np.stack([every[blk.rows] for blk in blocks]),
                   np.stack([every[blk.cols] for blk in blocks]), size)

    def times(self, x: np.ndarray) -> np.ndarray:
        """(G, R): each block times its columns of x."""
        return np.matmul(self.values, x[self.cols][:, :, None])[:, :, 0]

    def transposed_times(self, y: np.ndarray) -> np.ndarray:
        """(size,): Σ over the blocks of blockᵀ times its rows of y, scattered to their columns."""
        part = np.matmul(y[self.rows][:, None, :], self.values)[:, 0, :]
        return np.bincount(self.cols.ravel(), part.ravel(), minlength=self.size)


@dataclass(frozen=True)
class _GroupPlan:
    """`PairMatrix.grouped`'s per-block column runs for one grouping (``groups``, compared by identity)."""

    groups: np.ndarray
    blocks: list
    rest_rows: np.ndarray


def _same_as_next_row(leave: np.ndarray, indptr: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per row r, whether row r + 1 holds exactly the columns of row r (False for the last row).

    Rows of one length that follow each other hold their columns in one contiguous stretch of
    ``leave``: each such run is compared as a (rows x width) view, row against next row, a chunk of
    rows at a time (no index array of the pairs' size)."""
    size = lengths.size
    same = np.zeros(size, dtype=bool)
    if size < 2:
        return same
    candidate = (lengths[:-1] == lengths[1:]) & (lengths[:-1] > 0)
    edges = np.diff(np.r_[0, candidate.astype(np.int8), 0])
    for a, b in zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()):
        # rows a..b (b included) share one width: row r is compared with row r + 1 for r in [a, b)
        width = int(lengths[a])
        view = leave[int(indptr[a]):int(indptr[b + 1])].reshape(b + 1 - a, width)
        step = max(1, _CHUNK_BYTES // (view.itemsize * width))
        for r in range(0, b - a, step):
            stop = min(r + step, b - a)
            same[a + r:a + stop] = (view[r:stop] == view[r + 1:stop + 1]).all(axis=1)
    return same
