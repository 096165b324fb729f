"""incidence: the sparse matrix B of docs/math.md §5, and the flat layout of θ.

θ is the concatenation of ``graph.params()`` values, each flattened in C order.
B is n × H (n = len θ, H units) with

    B[i, h] = -1   θ_i is a bias of a neuron of unit h, or a free weight
                   entering unit h from outside it;
    B[i, h] = +1   θ_i is a free weight leaving unit h;
    B[i, h] =  0   otherwise (a weight with both ends in unit h included).

A rescaling with log-scales z ∈ R^H is θ ← θ ⊙ exp(-Bz/2). Each row has at most
two non-zeros (a weight enters one unit and leaves one). The solvers read the
rows as unit pairs: `row_keys` gives them (and A = -Bᵀ1) without B.

>>> import numpy as np
>>> from pathir.ir import GraphBuilder, Dense
>>> from pathir.analyses.find_units import find_units
>>> b = GraphBuilder()
>>> x = b.input("x", (2,))
>>> h = b.relu("h", [(x, Dense(b.param("w1", np.ones((1, 2)))))], bias=b.param("b1", np.zeros(1)))
>>> y = b.identity("y", [(h, Dense(b.param("w2", np.ones((1, 1)))))])
>>> g = b.build(outputs=[y])
>>> units = find_units(g)[1]
>>> B, layout = incidence(g, units)
>>> B.toarray().ravel().tolist()    # w1 (2 entries) and b1 enter unit h:c0, w2 leaves it
[-1.0, -1.0, -1.0, 1.0]
>>> rows = row_keys(units)          # H = 1: entering unit 0 is key 0*2 + 1, leaving it 1*2 + 0
>>> rows.key.tolist(), rows.balance.tolist()
([1, 1, 1, 2], [2])
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pathir.analyses.unit_rows import CompactRows, RowKeys
from pathir.errors import ArgumentError, ArgumentKeyError, PathirError
from pathir.ir import Graph, Param

from .find_units import Units

__all__ = ["incidence", "row_keys", "compact_rows", "ParamLayout"]


@dataclass(frozen=True, eq=False)
class ParamLayout:
    """Flat offsets of θ ↔ (param, index) ↔ source names.

    Param k occupies ``offsets[k]:offsets[k+1]`` of θ, flattened in C order.

    >>> import numpy as np
    >>> from pathir.ir import Param
    >>> lay = ParamLayout((Param("w", np.ones((2, 3))), Param("b", np.zeros(2))))
    >>> len(lay), lay.slice("b"), lay.locate(4)
    (8, slice(6, 8, None), ('w', (1, 1)))
    """

    params: tuple[Param, ...]

    @cached_property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([p.size for p in self.params], dtype=np.int64)])

    @cached_property
    def _index(self) -> dict[str, int]:
        return {p.name: k for k, p in enumerate(self.params)}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def position(self, param: Param | str) -> int:
        """Index of ``param`` (object or name) in ``params``."""
        name = param if isinstance(param, str) else param.name
        try:
            return self._index[name]
        except KeyError:
            raise ArgumentKeyError(f"no param named '{name}' in the layout") from None

    def slice(self, param: Param | str) -> slice:
        k = self.position(param)
        return slice(int(self.offsets[k]), int(self.offsets[k + 1]))

    def locate(self, i: int) -> tuple[str, tuple[int, ...]]:
        """(param name, index in the param) of flat entry ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"flat index {i} outside 0..{len(self) - 1}")
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        p = self.params[k]
        return p.name, tuple(int(j) for j in np.unravel_index(i - int(self.offsets[k]), p.shape))

    def source_name(self, i: int) -> str:
        """The source tensor name flat entry ``i`` is reported under."""
        return self.params[self.position(self.locate(i)[0])].source_name

    def theta(self) -> np.ndarray:
        """θ: every param value flattened, in order (float64)."""
        out = np.empty(len(self))  # filled param by param: no list of flattened copies beside it
        for p, start in zip(self.params, self.offsets.tolist()):
            out[start:start + p.size].reshape(p.shape)[...] = p.value
        return out

    def split(self, flat) -> dict[str, np.ndarray]:
        """{param name: its entries of ``flat``, in the param's shape}."""
        flat = np.asarray(flat)
        if flat.shape != (len(self),):
            raise ArgumentError(f"expected a flat vector of length {len(self)}, got shape {flat.shape}")
        return {p.name: flat[self.slice(p)].reshape(p.shape) for p in self.params}

    def by_source(self, flat) -> dict[str, np.ndarray]:
        """{source name (``Param.source_name``): entries of ``flat`` in the param's shape}."""
        out: dict[str, np.ndarray] = {}
        for p, value in zip(self.params, self.split(flat).values()):
            if p.source_name in out:
                raise PathirError(f"two params are reported under the source name '{p.source_name}'")
            out[p.source_name] = value
        return out


def check_units_match(graph_params, units: Units) -> None:
    """Raise unless ``units`` were found on a graph with these params (names and shapes, in order)."""
    if len(graph_params) != len(units.params) or any(
        a.name != b.name or a.shape != b.shape for a, b in zip(graph_params, units.params)
    ):
        raise PathirError("the units were found on another graph (params differ): run find_units on this graph")


def incidence(graph: Graph, units: Units):
    """B (scipy.sparse CSR, n × H, float64 entries in {-1, 0, 1}) and the ParamLayout.

    ``units`` from :func:`find_units` on this graph, or on one with the same
    structure and param names (e.g. a rescaled copy).

    Example in the module docstring.
    """
    from scipy.sparse import csr_matrix

    params = graph.params()
    check_units_match(params, units)
    layout = ParamLayout(tuple(params))
    H, n = len(units), len(layout)
    index_dtype = np.int32 if max(n, H) < 2**31 - 1 else np.int64
    # CSR built row by row in θ order: per entry, the unit it enters (-1) and the
    # one it leaves (+1), each where it exists and differs from the other end,
    # in increasing column order
    counts, cols, vals = [], [], []
    mixed = False
    for p, (enter, leave) in zip(params, units.ends):
        fast = _uniform_rows(p, enter, leave, H, index_dtype)
        if fast is not None:
            counts.append(np.full(p.size, fast[0], np.int64)), cols.append(fast[1]), vals.append(fast[2])
            continue
        mixed = True
        t = np.broadcast_to(enter, p.shape).reshape(-1)
        s = np.full(t.shape, H, dtype=t.dtype) if leave is None else np.broadcast_to(leave, p.shape).reshape(-1)
        both = np.stack([t, s], axis=1)
        keep = (both < H) & (t != s)[:, None]
        counts.append(keep.sum(axis=1, dtype=np.int64))
        cols.append(both[keep])
        vals.append(np.broadcast_to(np.array([-1.0, 1.0]), both.shape)[keep])
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt, copy=False) if xs else np.zeros(0, dt))
    indptr = np.concatenate([[0], np.cumsum(cat(counts, np.int64))]).astype(np.int64)
    indices = cat(cols, index_dtype)
    if indptr[-1] < 2**31 - 1:
        indptr = indptr.astype(index_dtype)
    B = csr_matrix((cat(vals, np.float64), indices, indptr), shape=(n, H))
    if mixed:
        B.sort_indices()
    else:
        B.has_sorted_indices = True  # _uniform_rows writes every row in increasing column order
    return B, layout


def row_keys(units: Units):
    """B's rows as a ``pathir.analyses.unit_rows.RowKeys``: per row, key_i = e(i) (H + 1) + l(i), the unit θ_i
    enters and the one it leaves (H for none), as ``unit_rows.matrix_row_keys(B)`` reads them from B, and
    the column balance A_h = #rows entering h - #rows leaving h, here straight from the units' ends.

    Example in the module docstring.
    """

    H = len(units)
    balance = np.zeros(H + 1, dtype=np.int64)
    key = np.empty(sum(p.size for p in units.params), dtype=np.int64)  # filled param by param: no second copy
    start = 0
    for p, (enter, leave) in zip(units.params, compact_rows(units)):
        key[start:start + p.size].reshape(p.shape)[...] = enter * (H + 1) + leave
        start += p.size
        # each compact entry stands for p.size / its broadcast size rows
        balance += _counts(enter, p.shape, H) - _counts(leave, p.shape, H)
    return RowKeys(key, balance[:H])


def row_ends(units: Units):
    """B's rows as a ``pathir.analyses.unit_rows.CompactRows``: the units' compact row ends per param
    (:func:`compact_rows`) and the column balance, as :func:`row_keys` gives it, without a key per row."""

    H = len(units)
    ends = compact_rows(units)
    balance = np.zeros(H + 1, dtype=np.int64)
    for p, (enter, leave) in zip(units.params, ends):
        balance += _counts(enter, p.shape, H) - _counts(leave, p.shape, H)
    return CompactRows(tuple(ends), tuple(p.shape for p in units.params), balance[:H])


def compact_rows(units: Units) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per param of ``units.params``, the (entered, left) unit of its rows of B in compact form: two
    int arrays broadcastable to the param's shape, H for none (an input or output end, or a weight
    with both ends in one unit, whose row is empty)."""
    H = len(units)
    out = []
    for enter, leave in units.ends:
        t = np.asarray(enter, dtype=np.int64)
        s = np.full((), H, dtype=np.int64) if leave is None else np.asarray(leave, dtype=np.int64)
        if _overlap(t[t < H], s[s < H], H):  # maybe some entry has both ends in one unit: entry by entry
            same = t == s
            if same.any():  # (else the ends stay compact: shared units at different entries are rows as usual)
                t, s = np.where(same, H, t), np.where(same, H, s)
        out.append((t, s))
    return out


def _overlap(a: np.ndarray, b: np.ndarray, H: int) -> bool:
    """Whether the unit ids (< H) of ``a`` and ``b`` share one (a mask, not np.intersect1d's sorts)."""
    if a.size == 0 or b.size == 0:
        return False
    mark = np.zeros(H, dtype=bool)
    mark[a] = True
    return bool(mark[b].any())


def _counts(units: np.ndarray, shape: tuple[int, ...], H: int) -> np.ndarray:
    """Rows per unit (0..H) of a param of ``shape`` whose rows get ``units`` broadcast to it: each
    compact entry stands for prod(shape) / units.size of them."""
    if units.size == 0:
        return np.zeros(H + 1, dtype=np.int64)
    return np.bincount(units.reshape(-1), minlength=H + 1) * (int(np.prod(shape)) // units.size)


def _uniform_rows(p: Param, enter, leave, H: int, index_dtype):
    """(entries per row, columns, values) of a param whose rows all look alike (both
    ends in distinct units, or one end pinned everywhere), written from its compact
    end arrays without per-entry masks; None otherwise."""

    def fill(dtype, *parts):
        out = np.empty((*p.shape, len(parts)), dtype)
        for k, part in enumerate(parts):
            out[..., k] = part
        return out.reshape(-1)

    t_ok, t_none = bool(np.all(enter < H)), bool(np.all(enter == H))
    s_ok, s_none = (False, True) if leave is None else (bool(np.all(leave < H)), bool(np.all(leave == H)))
    if t_none and s_none:
        return 0, np.zeros(0, index_dtype), np.zeros(0)
    if t_ok and s_none:
        return 1, fill(index_dtype, enter), np.full(p.size, -1.0)
    if t_none and s_ok:
        return 1, fill(index_dtype, leave), np.full(p.size, 1.0)
    if not (t_ok and s_ok):
        return None
    t, s = np.broadcast_arrays(enter, leave)  # compact: no spatial axes
    if np.any(t == s):
        return None
    first = np.where(t < s, -1.0, 1.0)  # the lower column is the unit the entry enters
    return 2, fill(index_dtype, np.minimum(t, s), np.maximum(t, s)), fill(np.float64, first, -first)
