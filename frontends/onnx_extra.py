"""ONNX ops inside the ReLU DAG model that the torch frontend lowers in lower_extra:
Sub and Neg (a fixed −1 edge), Mul / Div by a constant (a scalar, or one factor per channel,
position or element: a fixed edge),
Max of activations (a max-pool neuron over its operands), LeakyRelu(alpha=0) and
Clip(min=0, no max) as ReLU, ReduceSum / ReduceMean / ReduceMax over any non-batch axes
(reductions.reduce: fixed edges, or a max-pool neuron). A mixin of OnnxLowering; the semantics are
lower_extra's, so both frontends build the same graph."""

from __future__ import annotations

import numpy as np

from pathir.frontends.lower_extra import _max, fixed_scale
from pathir.frontends.reductions import all_spatial, reduce, where
from pathir.frontends.values import NOT_MINE, Value

from .onnx_layers import attrs
from .onnx_ops import WHY

__all__ = ["ExtraOps"]


def _scalar(c) -> float | None:
    numeric = isinstance(c, np.ndarray) and (np.issubdtype(c.dtype, np.floating) or np.issubdtype(c.dtype, np.integer))
    if numeric and c.size == 1:
        return float(c.reshape(-1)[0])
    return None


def _constant(c) -> np.ndarray | None:
    numeric = isinstance(c, np.ndarray) and (np.issubdtype(c.dtype, np.floating) or np.issubdtype(c.dtype, np.integer))
    return c.astype(np.float64) if numeric else None


class ExtraOps:
    def op_Sub(self, node, ins):
        a, b = ins
        if not (isinstance(a, Value) and isinstance(b, Value)):
            self.unsupported("subtracting a constant: a fixed non-zero bias breaks the rescaling symmetry")
        if a.shape != b.shape:
            self.unsupported(f"subtracts activations of shapes {list(a.shape)} and {list(b.shape)}: "
                             "broadcasting is not lowered")
        return [self.add(a, fixed_scale(self, b, -1.0))]

    def op_Neg(self, node, ins):
        return [fixed_scale(self, self.act(node, 0), -1.0)]

    def op_Mul(self, node, ins):
        """An activation times a constant c (one scalar, or an initializer / constant of one factor per
        channel, position or element): a fixed edge of weight c (as torch's ``x * c``, ``x * self.buf``).
        ONNX does not tell a learnable tensor from a constant: the factor is fixed, never rescaled."""
        a, b = ins
        k = 0 if isinstance(a, Value) else 1
        if isinstance(ins[1 - k], Value):
            self.unsupported("a product of two activations (a gate) is not positively homogeneous of degree 1")
        c = _scalar(ins[1 - k])
        if c is None:
            c = _constant(ins[1 - k])
        if c is None:
            self.unsupported("a product with a constant that is not numeric")
        return [fixed_scale(self, ins[k], c)]

    def op_Div(self, node, ins):
        a, b = ins
        if isinstance(b, Value):
            self.unsupported("division by an activation is not positively homogeneous")
        c = _scalar(b)
        if c is None:
            c = _constant(b)
            if c is not None and np.any(c == 0):
                c = None
        if c is None or np.ndim(c) == 0 and c == 0:
            self.unsupported("division by a constant that is not numeric and non-zero everywhere")
        return [fixed_scale(self, a, 1.0 / np.asarray(c, dtype=np.float64) if np.ndim(c) else 1.0 / c)]

    def op_Max(self, node, ins):
        if not all(isinstance(v, Value) for v in ins):
            self.unsupported("a max with a constant: clipping at a fixed non-zero level is not positively homogeneous")
        if len(ins) == 1:
            return [ins[0]]
        return [_max(self, list(ins))]

    def op_LeakyRelu(self, node, ins):
        if attrs(node).get("alpha", 0.01) != 0:
            self.unsupported("LeakyRelu with a non-zero slope: pathir's neurons are identity, ReLU and max-pool only")
        return [self.relu(self.act(node, 0))]

    def op_Clip(self, node, ins):
        a = attrs(node)
        lo = ins[1] if len(ins) > 1 and ins[1] is not None else a.get("min")
        hi = ins[2] if len(ins) > 2 and ins[2] is not None else a.get("max")
        if isinstance(lo, Value) or isinstance(hi, Value):
            self.unsupported("Clip at a bound computed from the input: not positively homogeneous")
        lo_s = None if lo is None else _scalar(np.asarray(lo, dtype=np.float64))
        hi_s = None if hi is None else _scalar(np.asarray(hi, dtype=np.float64))
        if lo_s == 0.0 and (hi_s is None or hi_s == np.inf):
            return [self.relu(self.act(node, 0))]
        self.unsupported(WHY["Clip"])

    def _reduce(self, node, kind):
        v = self.act(node, 0)
        a = attrs(node)
        axes = a.get("axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            axes = self.const(node, 1, "axes").reshape(-1).tolist()
        if not axes:
            if a.get("noop_with_empty_axes", 0):
                return [v]
            self.unsupported(f"a {kind} over every axis, the batch included")
        axes, keep = [int(x) for x in axes], bool(a.get("keepdims", 1))
        if kind == "mean" and all_spatial(v, axes):
            return [self.mean(v, axes, keep)]  # the global average pool
        return [reduce(self, v, axes, keep, kind)]

    def op_Where(self, node, ins):
        cond, a, b = ins
        out = where(self, cond, a, b)
        if out is NOT_MINE:
            self.unsupported("Where with a condition that is not a constant bool tensor")
        return [out]

    def op_ReduceSum(self, node, ins):
        return self._reduce(node, "sum")

    def op_ReduceMean(self, node, ins):
        return self._reduce(node, "mean")

    def op_ReduceMax(self, node, ins):
        return self._reduce(node, "max")
