"""Constants an ONNX graph computes from its batch size.

The ONNX walk runs at one batch size (the lowering's ``batch``), so ``Shape`` and ``Size`` of an
activation fold to numbers. As the target of a Reshape, an Expand or a Slice that is what they are:
an element move whose batch axis the walk then finds. As a coefficient (``y / x.shape[0]``,
exported as Shape → Gather → Cast → Div) the number would be frozen at the walk's batch size, and the
graph wrong at every other. So each such constant carries its value at a second batch size
(:class:`BatchSized`); constant folding computes both, and an entry that differs between them is
refused where a rule reads the constant as a number.

>>> v = batch_sized(np.array([2, 4]), np.array([3, 4]))
>>> depends_on_batch(v), depends_on_batch(batch_sized(np.array([4]), np.array([4])))
(True, False)
"""

from __future__ import annotations

import numpy as np

__all__ = ["BatchSized", "batch_sized", "depends_on_batch", "ALT_BATCH", "alternatives", "SHAPE_OPERANDS"]

#: the walk's batch size plus this is the second one every batch-sized constant is also computed at
ALT_BATCH = 1

#: ops whose constant operands are shapes, indices, counts or bounds (read by an element move): a
#: batch-sized one there is what it means, the batch axis, which the element move's walk follows
SHAPE_OPERANDS = frozenset({
    "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Split", "Slice", "Gather", "Expand", "Tile",
    "DepthToSpace", "SpaceToDepth", "GatherElements", "ScatterND", "ScatterElements", "Concat", "Pad",
    "SplitToSequence", "SequenceAt", "Resize", "Upsample", "Shape", "Size", "Identity", "Dropout"})


class BatchSized(np.ndarray):
    """A constant with ``alt``, its value had the batch size been ``ALT_BATCH`` more (None: unknown, every
    entry taken to depend on it)."""

    alt: np.ndarray | None = None

    def __array_finalize__(self, obj):
        self.alt = getattr(obj, "alt", None)


def batch_sized(value: np.ndarray, alt: np.ndarray | None) -> np.ndarray:
    """``value``, marked with ``alt`` where the two differ (else the plain array)."""
    value = np.asarray(value)
    if alt is not None:
        alt = np.asarray(alt)
        if alt.shape == value.shape and np.array_equal(alt, value):
            return value
    out = value.view(BatchSized)
    out.alt = alt
    return out


def depends_on_batch(v) -> bool:
    """Whether ``v`` is a constant whose value changes with the batch size."""
    return isinstance(v, BatchSized)


def alternatives(inputs: list) -> list | None:
    """The inputs at the second batch size (each constant's ``alt``), or None where one is unknown."""
    out = []
    for v in inputs:
        if isinstance(v, BatchSized):
            if v.alt is None:
                return None
            out.append(v.alt)
        else:
            out.append(v)
    return out
