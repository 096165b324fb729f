"""Large float64 arrays whose memory is reused once they die.

A fresh large array costs a page fault per 4 KiB on first write, and on a machine that
hands freed memory back to its host each fault is slow: widening VGG-16's 138M weights
into fresh arrays took 0.1 to 3 s, into arrays written before 0.07 s. :class:`ArrayPool`
hands out arrays over blocks it keeps; a block returns to the pool only once the array
it backs, and every view of it, has been collected (a finalizer on the array every view
refers to), so an array still held anywhere is never written again.

>>> pool = ArrayPool()
>>> pool.min_bytes = 0  # every array pooled (the default pools 64 KiB and more)
>>> a = pool.empty((2, 3)); a[:] = 1.0
>>> block = a.base.base.obj  # the pool's block under the array's buffer
>>> del a
>>> b = pool.empty((3, 2))  # same size: the freed block again
>>> b.base.base.obj is block
True
>>> c = pool.empty((3, 2))  # b still lives: a new block
>>> c.base.base.obj is block
False
"""

from __future__ import annotations

import math
import weakref

import numpy as np

__all__ = ["ArrayPool"]


class ArrayPool:
    """Float64 arrays of ``min_bytes`` or more over reused blocks (smaller ones: ``np.empty``,
    which the heap already reuses). Contents of a new array are undefined: write all of it."""

    min_bytes = 1 << 16

    def __init__(self):
        self._free: dict[int, list[np.ndarray]] = {}  # size -> blocks no live array is over

    def empty(self, shape) -> np.ndarray:
        n = math.prod(shape)
        if n == 0 or 8 * n < self.min_bytes:
            return np.empty(shape)
        free = self._free.get(n)
        block = free.pop() if free else np.empty(n)
        # numpy collapses a view's base to the first array whose base is not an ndarray: ``flat``
        # (over a memoryview), so every view of the result keeps ``flat`` alive.
        flat = np.frombuffer(memoryview(block), dtype=np.float64)
        weakref.finalize(flat, self._free.setdefault(n, []).append, block)
        return flat.reshape(shape)
