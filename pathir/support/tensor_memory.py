"""The memory a torch tensor's entries occupy: two tensor objects over overlapping bytes write each other."""

from __future__ import annotations

import numpy as np

__all__ = ["extent", "overlapping", "share_bytes"]

#: tensors with more entries than this are compared by their byte ranges only (conservative: interleaved
#: strided views of a large buffer count as overlapping)
_EXACT_UP_TO = 1 << 22


def extent(t) -> tuple[int, int, int] | None:
    """(storage pointer, first byte, one past the last byte) of the memory tensor ``t`` can read (None: not a
    strided tensor, empty, or on the meta device)."""
    if not hasattr(t, "untyped_storage") or getattr(t, "layout", None) is None or str(t.layout) != "torch.strided" \
            or t.device.type == "meta" or t.numel() == 0:
        return None
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), start, start + span * t.element_size()


def overlapping(a: tuple[int, int, int] | None, b: tuple[int, int, int] | None) -> bool:
    """Whether two :func:`extent` s' byte ranges meet (a necessary condition for sharing a byte)."""
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _starts(t) -> np.ndarray:
    """The first byte of every entry of strided tensor ``t``, relative to its storage, sorted."""
    offsets = np.zeros(1, dtype=np.int64) + t.storage_offset()
    for n, s in zip(t.shape, t.stride()):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
    return np.sort(offsets * t.element_size())


def share_bytes(a, b) -> bool:
    """Whether strided tensors ``a`` and ``b`` read a common byte: their ranges meet and (up to a size) some
    entry of one overlaps an entry of the other (column blocks of one buffer interleave without sharing)."""
    ea, eb = extent(a), extent(b)
    if not overlapping(ea, eb):
        return False
    if a.numel() > _EXACT_UP_TO or b.numel() > _EXACT_UP_TO:
        return True
    sa, sb = _starts(a), _starts(b)
    la, lb = a.element_size(), b.element_size()
    i = np.searchsorted(sa, sb, side="right") - 1  # the entry of a starting at or before each entry of b
    if np.any((i >= 0) & (sa[np.maximum(i, 0)] + la > sb)):
        return True
    j = np.searchsorted(sb, sa, side="right") - 1
    return bool(np.any((j >= 0) & (sb[np.maximum(j, 0)] + lb > sa)))
