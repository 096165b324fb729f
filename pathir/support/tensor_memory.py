"""The memory a torch tensor's entries occupy: two tensor objects over overlapping bytes write each other."""

from __future__ import annotations

__all__ = ["extent", "overlapping"]


def extent(t) -> tuple[int, int, int] | None:
    """(storage pointer, first byte, one past the last byte) of the memory tensor ``t`` can read (None: not a
    tensor, empty, or on the meta device)."""
    if not hasattr(t, "untyped_storage") or t.device.type == "meta" or t.numel() == 0:
        return None
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), start, start + span * t.element_size()


def overlapping(a: tuple[int, int, int] | None, b: tuple[int, int, int] | None) -> bool:
    """Whether two :func:`extent` s share a byte."""
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]
