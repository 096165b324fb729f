"""``np.unique`` of a 1-D integer array by one sort.

numpy >= 2.3 answers ``np.unique`` with a hash table first; on millions of
distinct int64 keys (unit pairs, condensation edges) that is 10-30x slower than
sorting (5M keys: 4.9 s against 0.17 s). The answer is the same: the distinct
values in increasing order and, on request, each entry's index among them.

>>> import numpy as np
>>> values, inverse = sorted_unique(np.array([5, 2, 5, 7, 2]), return_inverse=True)
>>> values.tolist(), inverse.tolist()
([2, 5, 7], [1, 0, 1, 2, 0])
"""

from __future__ import annotations

import numpy as np

__all__ = ["sorted_unique"]


def sorted_unique(values: np.ndarray, return_inverse: bool = False):
    """The distinct entries of ``values`` (flattened) in increasing order, as ``np.unique``; with
    ``return_inverse`` also the index of each entry's value among them (``distinct[inverse] == values``)."""
    flat = np.asarray(values).reshape(-1)
    if not return_inverse:
        ordered = np.sort(flat)
        return ordered[np.r_[True, ordered[1:] != ordered[:-1]]] if ordered.size else ordered
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    first = np.r_[True, ordered[1:] != ordered[:-1]] if ordered.size else np.zeros(0, dtype=bool)
    inverse = np.empty(flat.size, dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse
