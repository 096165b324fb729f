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

When a pool dies (its Compiled is dropped), its free blocks, and those of its arrays that die later,
go to one process-wide reserve that a new pool draws from before it allocates: a model compiled
again (a benchmark loop, a script run per checkpoint) widens into memory already faulted in
(resnet18: compile + path-norm 94 -> 75 ms). The reserve keeps at most ``RESERVE_BYTES`` (the
blocks returned last; a larger model's blocks are freed as before); :func:`release` frees it.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict

import numpy as np

__all__ = ["ArrayPool", "RESERVE_BYTES", "release"]

#: the most memory the process-wide reserve of dead pools' blocks keeps (module docstring)
RESERVE_BYTES = 256 << 20


class _Reserve:
    """Blocks of dead pools, the last returned kept first, at most ``RESERVE_BYTES`` in all."""

    def __init__(self):
        self.blocks: OrderedDict[int, np.ndarray] = OrderedDict()  # id -> block, oldest first
        self.bytes = 0
        self.lock = threading.Lock()  # blocks come back from finalizers, on whichever thread collects

    def put(self, block: np.ndarray) -> None:
        with self.lock:
            if block.nbytes > RESERVE_BYTES:
                return
            self.blocks[id(block)] = block
            self.bytes += block.nbytes
            while self.bytes > RESERVE_BYTES:
                _, old = self.blocks.popitem(last=False)
                self.bytes -= old.nbytes

    def take(self, n: int) -> np.ndarray | None:
        with self.lock:
            for key in reversed(self.blocks):
                block = self.blocks[key]
                if block.size == n:
                    del self.blocks[key]
                    self.bytes -= block.nbytes
                    return block
        return None

    def clear(self) -> None:
        with self.lock:
            self.blocks.clear()
            self.bytes = 0


_RESERVE = _Reserve()


def release() -> None:
    """Free the reserve of dead pools' blocks (pools still alive keep theirs)."""
    _RESERVE.clear()


def _returned(pool_ref, n: int, block: np.ndarray) -> None:
    """An array over ``block`` died: the block back to its pool, or to the reserve once the pool is gone."""
    pool = pool_ref()
    if pool is None:
        _RESERVE.put(block)
    else:
        pool._free.setdefault(n, []).append(block)


def _retire(free: dict) -> None:
    """A pool died: its free blocks to the reserve."""
    for blocks in free.values():
        for block in blocks:
            _RESERVE.put(block)
    free.clear()


class ArrayPool:
    """Float64 arrays of ``min_bytes`` or more over reused blocks (smaller ones: ``np.empty``,
    which the heap already reuses). Contents of a new array are undefined: write all of it."""

    min_bytes = 1 << 16

    def __init__(self):
        self._free: dict[int, list[np.ndarray]] = {}  # size -> blocks no live array is over
        weakref.finalize(self, _retire, self._free)

    def drop_free(self) -> None:
        """Free the blocks no live array is over (arrays alive now still return theirs when they die)."""
        self._free.clear()

    def empty(self, shape) -> np.ndarray:
        n = math.prod(shape)
        if n == 0 or 8 * n < self.min_bytes:
            return np.empty(shape)
        free = self._free.get(n)
        block = free.pop() if free else _RESERVE.take(n)
        if block is None:
            block = np.empty(n)
        # numpy collapses a view's base to the first array whose base is not an ndarray: ``flat``
        # (over a memoryview), so every view of the result keeps ``flat`` alive.
        flat = np.frombuffer(memoryview(block), dtype=np.float64)
        weakref.finalize(flat, _returned, weakref.ref(self), n, block)
        return flat.reshape(shape)
