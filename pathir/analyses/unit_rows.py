"""The rows of the unit incidence matrix B (docs/math.md §5) as unit pairs.

Row i of B holds at most one -1 (the unit parameter i enters, e(i)) and at most
one +1 (the unit it leaves, l(i)); with H units and H standing for "none", the
row is the key e(i) (H + 1) + l(i). The solvers read B through these keys
(`unit_pairs` groups the rows by them) and through the column balance
A = -Bᵀ1. `keys_for` derives both from a bare matrix, checking it, or takes
them from whoever built B (``Compiled.row_keys()``, a `RowKeys`).

>>> import numpy as np, scipy.sparse as sp
>>> B = sp.csr_array(np.array([[-1.0, 0.0], [1.0, -1.0], [0.0, 1.0], [0.0, 0.0]]))
>>> key, H = matrix_row_keys(B)
>>> [divmod(int(k), H + 1) for k in key]           # (entered, left), 2 = none
[(0, 2), (1, 0), (2, 1), (2, 2)]
>>> column_balance(B).tolist(), key_balance(key, H).tolist()
([0, 0], [0, 0])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from pathir.errors import ArgumentError

__all__ = ["canonical", "matrix_row_keys", "RowKeys", "CompactRows", "keys_for", "row_units", "column_balance", "key_balance", "row_shifts"]


def canonical(B) -> sp.csr_array:
    """B as a canonical CSR array, checked: non-zeros are ±1, at most one of each sign per row."""
    csr = B if isinstance(B, sp.csr_array) else sp.csr_array(B)
    if not csr.has_canonical_format:
        csr = csr.copy()
        csr.sum_duplicates()
    if not np.all(np.abs(csr.data) == 1):
        csr = csr.copy()
        csr.eliminate_zeros()
        if not np.all(np.abs(csr.data) == 1):
            raise ArgumentError("B may hold only -1, 0 and +1")
    counts = np.diff(csr.indptr)
    if counts.max(initial=0) > 2:
        raise ArgumentError(f"row {int(np.argmax(counts))} of B has more than two non-zeros")
    # a row of at most two ±1 entries sums to ±2 iff both have one sign
    same = np.flatnonzero(np.abs(csr @ np.ones(csr.shape[1])) > 1)
    if same.size:
        row = int(same[0])
        raise ArgumentError(f"row {row} of B has two {csr.data[csr.indptr[row]]:+g} entries: "
                         "a parameter enters at most one unit and leaves at most one")
    return csr


def matrix_row_keys(B, checked: bool = False) -> tuple[np.ndarray, int]:
    """``(key, H)`` with key_i = e(i) (H + 1) + l(i) (e, l = H for "no unit").

    B is checked by `canonical` unless ``checked`` says it already was.
    """
    csr = B if checked else canonical(B)
    n, H = csr.shape
    # one mat-vec: a -1 at column j adds (j - H)(H + 1) to the "no unit" key H(H + 1) + H, a +1 adds j - H
    weight = np.where(csr.data < 0, float(H + 1), 1.0)
    key = sp.csr_array((weight, csr.indices, csr.indptr), shape=csr.shape) @ np.arange(-H, 0, dtype=np.float64)
    key += float(H * (H + 1) + H)
    return key.astype(np.int64), H


@dataclass(frozen=True, eq=False)
class RowKeys:
    """B's rows as unit pairs, as whoever built B knows them: ``key`` (`matrix_row_keys`) and the
    column balance A = -Bᵀ1 (`column_balance`) of an n x H matrix B."""

    key: np.ndarray
    balance: np.ndarray

    @property
    def num_units(self) -> int:
        return int(self.balance.size)


@dataclass(frozen=True, eq=False)
class CompactRows:
    """B's rows as the units' compact row ends, param by param (``passes.incidence.compact_rows``): per
    param of ``shapes``, (entered, left) unit arrays broadcastable to its shape (H for none), and the
    column balance A = -Bᵀ1. Describes the same B as a `RowKeys` without one int64 key per row:
    the solvers group masses into unit pairs param by param (`unit_pairs.group_compact`)."""

    ends: tuple
    shapes: tuple
    balance: np.ndarray

    @property
    def num_units(self) -> int:
        return int(self.balance.size)

    @property
    def size(self) -> int:
        """n, the number of rows of B."""
        return int(sum(int(np.prod(s)) for s in self.shapes))

    def parts(self, flat):
        """(shape, enter, leave, that param's entries of ``flat`` in its shape) in turn. ``flat``: one
        array in the order of θ, or a list of one array per param (`pathir.lifting.diag_g.diag_g_parts`)."""
        if isinstance(flat, (list, tuple)):
            for shape, (enter, leave), part in zip(self.shapes, self.ends, flat, strict=True):
                yield shape, enter, leave, part.reshape(shape)
            return
        start = 0
        for shape, (enter, leave) in zip(self.shapes, self.ends):
            size = int(np.prod(shape))
            yield shape, enter, leave, flat[start:start + size].reshape(shape)
            start += size

    def shifts(self, z: np.ndarray):
        """(start, (Bz)_i for that param's rows) in turn, as `row_shifts` gives them from keys."""
        zp = np.append(np.asarray(z, dtype=np.float64), 0.0)
        start = 0
        for shape, (enter, leave) in zip(self.shapes, self.ends):
            yield start, np.broadcast_to(zp[leave] - zp[enter], shape).reshape(-1)
            start += int(np.prod(shape))


def keys_for(B, row_key=None, balance: bool = True) -> tuple[sp.csr_array | None, np.ndarray, int, np.ndarray | None]:
    """``(B, key, H, A)`` for a solver: B checked by `canonical`, its `matrix_row_keys` and column balance
    derived, or, where the caller passes the ``row_key`` it built B from (an array of keys or a
    `RowKeys`, as ``Compiled.row_keys()`` gives), those, checked for shape and range and against
    B on a sample of rows. ``B`` may be None where ``row_key`` is a `RowKeys`: the block solver
    needs nothing else (returned B is then None). ``balance=False``: A is None unless given."""
    if isinstance(row_key, CompactRows):
        if B is not None:
            raise ArgumentError("row_key as CompactRows is given without B (it is B's description)")
        return None, row_key, row_key.num_units, row_key.balance
    if row_key is None:
        csr = canonical(B)
        key, H = matrix_row_keys(csr, checked=True)
        given = None
    else:
        csr = None if B is None else (B if isinstance(B, sp.csr_array) else sp.csr_array(B))
        given = np.asarray(row_key.balance) if isinstance(row_key, RowKeys) else None
        if csr is None and given is None:
            raise ArgumentError("without B, row_key must be a RowKeys (keys and column balance)")
        H = given.size if csr is None else csr.shape[1]
        if given is not None and given.shape != (H,):
            raise ArgumentError(f"RowKeys for {given.size} units given with a B of {H} columns")
        key = np.asarray(row_key.key if isinstance(row_key, RowKeys) else row_key)
        n = key.size if csr is None else csr.shape[0]
        if key.shape != (n,) or key.dtype.kind not in "iu":
            raise ArgumentError(f"row_key must be an integer vector of length {n}, got {key.dtype} {key.shape}")
        if n and not (key.min() >= 0 and key.max() < (H + 1) ** 2):
            raise ArgumentError(f"row_key must lie in [0, (H + 1)²) = [0, {(H + 1) ** 2})")
        if csr is not None and n:
            sample = np.unique(np.linspace(0, n - 1, min(n, 1024)).astype(np.int64))
            if not np.array_equal(matrix_row_keys(csr[sample])[0], key[sample]):
                raise ArgumentError("row_key does not describe the rows of B")
        key = key.astype(np.int64, copy=False)
    if given is None and balance:
        given = key_balance(key, H)
    return csr, key, H, given


def row_units(B) -> tuple[np.ndarray, np.ndarray, int]:
    """``(enter, leave, H)``: per row of B, the unit it enters (-1 entry) and leaves (+1 entry), or H.

    Raises ValueError unless every non-zero of B is ±1 and no row has two
    entries of one sign.
    """
    key, H = matrix_row_keys(B)
    enter, leave = np.divmod(key, H + 1)
    return enter, leave, H


def column_balance(B) -> np.ndarray:
    """A_h = |in_h| - |out_h| = -(Bᵀ1)_h straight from B."""
    B = sp.csr_array(B)
    return -np.rint(B.T @ np.ones(B.shape[0])).astype(np.int64)


def key_balance(key: np.ndarray, H: int) -> np.ndarray:
    """`column_balance` from the row keys: A_h = #rows entering h - #rows leaving h."""
    size = (H + 1) ** 2
    if size <= max(4 * key.size, 1 << 22):
        counts = np.bincount(key, minlength=size).reshape(H + 1, H + 1)  # [enter, leave]
        return (counts.sum(axis=1) - counts.sum(axis=0))[:H]
    enter, leave = np.divmod(key, H + 1)
    return (np.bincount(enter, minlength=H + 1) - np.bincount(leave, minlength=H + 1))[:H]


def row_shifts(key: np.ndarray, z: np.ndarray, chunk: int = 1 << 22):
    """(start, (Bz)_i for the rows start..start+chunk) in turn, from the row keys: (Bz)_i = z_l(i) - z_e(i)
    with z_none = 0. Chunked, so a 100M-row B z never sits in memory at once."""
    H = z.size
    zp = np.append(np.asarray(z, dtype=np.float64), 0.0)
    for start in range(0, key.size, chunk):
        enter, leave = np.divmod(key[start:start + chunk], H + 1)
        yield start, zp[leave] - zp[enter]
